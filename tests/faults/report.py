"""The fault matrix's figures: per case, what the client got and how long recovery took.

Checks record absolute monotonic times as they pass; the table gives them in seconds
after the case's fault (the one a check names, else the first signal sent). The conftest
prints the table at the end of the run and writes JSON lines to $PDSERVE_FAULT_REPORT
when set.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

_CASES: dict[str, dict[str, Any]] = {}


def _case() -> dict[str, Any]:
    name = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].rsplit("::", 1)[-1]
    return _CASES.setdefault(name.removeprefix("test_"), {"outcomes": {}, "errors_at": []})


def fault(at: float, *, is_the_fault: bool = False) -> None:
    """A signal sent at `at`: the case's first counts, unless a check names its fault."""
    case = _case()
    if is_the_fault and not case.get("is_named"):
        case["fault_at"], case["is_named"] = at, True
    elif "fault_at" not in case:
        case["fault_at"] = at


def outcome(kind: str, ended_at: float | None) -> None:
    case = _case()
    case["outcomes"][kind] = case["outcomes"].get(kind, 0) + 1
    if ended_at is not None and kind != "completed":
        case["errors_at"].append(ended_at)


def pages_zero(pages: dict[str, float]) -> None:
    _case().update(pages_held_after=pages, pages_zero_at=time.monotonic())


def recovered() -> None:
    _case().setdefault("fresh_ok_at", time.monotonic())


def figures() -> list[dict[str, Any]]:
    """One dict per case: outcomes, and seconds after the fault to the last clean error,
    to pages held 0 on every surviving node, and to a fresh request's success."""
    rows = []
    for name, c in _CASES.items():
        start = c.get("fault_at")

        def since(at: float | None, start: float | None = start) -> float | None:
            return None if at is None or start is None else round(at - start, 2)

        rows.append(
            {
                "case": name,
                "outcomes": c["outcomes"],
                "error_after_s": since(max(c["errors_at"], default=None)),
                "pages_held_after": c.get("pages_held_after"),
                "pages_zero_after_s": since(c.get("pages_zero_at")),
                "fresh_ok_after_s": since(c.get("fresh_ok_at")),
            }
        )
    return rows


def lines() -> list[str]:
    rows = [f"{'case':<66} {'client outcome':<30} {'err s':>6} {'pages 0 s':>9} {'fresh ok s':>10}"]
    for c in figures():
        got = ", ".join(f"{n} {k}" for k, n in sorted(c["outcomes"].items())) or "-"
        rows.append(
            f"{c['case'][:66]:<66} {got[:30]:<30} {_fmt(c['error_after_s']):>6} "
            f"{_fmt(c['pages_zero_after_s']):>9} {_fmt(c['fresh_ok_after_s']):>10}"
        )
    return rows


def write_json(path: str) -> None:
    with open(path, "w") as f:
        for c in figures():
            f.write(json.dumps({"bench": "faults", **c}) + "\n")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
