"""The fault matrix's figures: per case, what the client got and how long recovery took.

Checks record into it as they pass (times relative to the case's first fault); the
conftest prints the table at the end of the run, and writes JSON lines to
$PDSERVE_FAULT_REPORT when set.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

_CASES: dict[str, dict[str, Any]] = {}


def _case() -> dict[str, Any]:
    name = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0].rsplit("::", 1)[-1]
    return _CASES.setdefault(name, {"case": name})


def fault(at: float, *, is_the_fault: bool = False) -> None:
    """A signal sent at `at`: the case's first counts, unless a check names its fault."""
    case = _case()
    if is_the_fault and not case.get("is_named"):
        case["fault_at"], case["is_named"] = at, True
    elif "fault_at" not in case:
        case["fault_at"] = at


def _since_fault(at: float) -> float | None:
    start = _case().get("fault_at")
    return None if start is None else round(at - start, 2)


def outcome(kind: str, ended_at: float | None) -> None:
    outcomes = _case().setdefault("outcomes", {})
    outcomes[kind] = outcomes.get(kind, 0) + 1
    if ended_at is not None and kind != "completed":
        after = _since_fault(ended_at)
        if after is not None:
            _case()["error_after_s"] = max(after, _case().get("error_after_s", after))


def pages_zero(pages: dict[str, float]) -> None:
    _case()["pages_held_after"] = pages
    _case()["pages_zero_after_s"] = _since_fault(time.monotonic())


def recovered() -> None:
    _case().setdefault("fresh_ok_after_s", _since_fault(time.monotonic()))


def lines() -> list[str]:
    rows = [f"{'case':<62} {'client outcome':<34} {'err s':>6} {'pages 0 s':>9} "
            f"{'fresh ok s':>10}"]
    for c in _CASES.values():
        got = ", ".join(f"{n} {k}" for k, n in sorted(c.get("outcomes", {}).items())) or "-"
        rows.append(f"{c['case'][:62]:<62} {got[:34]:<34} {_fmt(c.get('error_after_s')):>6} "
                    f"{_fmt(c.get('pages_zero_after_s')):>9} {_fmt(c.get('fresh_ok_after_s')):>10}")
    return rows


def write_json(path: str) -> None:
    with open(path, "w") as f:
        for c in _CASES.values():
            f.write(json.dumps({"bench": "faults", **{k: v for k, v in c.items()
                                                      if k not in ("fault_at", "is_named")}})
                    + "\n")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
