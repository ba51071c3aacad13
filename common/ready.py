"""The READY line a process prints on stdout once it serves: launchers and tests wait for it.

Kept free of heavy imports: the bootstrap service prints it too without loading the model
runner's modules.
"""

from __future__ import annotations

import json
from typing import Any

READY_PREFIX = "PDSERVE_READY "


def ready_line(info: dict[str, Any]) -> str:
    """The READY line for `info`, newline included: written in one call, so a log line from
    another thread (stderr often shares the pipe) cannot land between the JSON and its end."""
    return READY_PREFIX + json.dumps(info) + "\n"


def parse_ready(line: str) -> dict[str, Any] | None:
    """The fields of a READY line, or None for any other line. Only the JSON object right
    after the prefix is read, and the prefix may come after other text: with stderr merged
    into stdout a progress bar (no newline) can precede it, or a log write follow it on the
    same line. (A reader that took the whole rest of the line as JSON died on such a line,
    and its node looked silent at start-up for the 300 s until it was restarted.)"""
    at = line.find(READY_PREFIX)
    if at < 0:
        return None
    try:
        info, _ = json.JSONDecoder().raw_decode(line, at + len(READY_PREFIX))
    except json.JSONDecodeError:
        return None
    return info if isinstance(info, dict) else None
