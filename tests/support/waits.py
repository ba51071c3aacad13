"""Waiting on a condition instead of sleeping a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(
    cond: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05
) -> float:
    """Poll `cond` until true; the seconds it took. Raises AssertionError naming `what`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic() - t0
