"""Driving KVManagers in one process: their loops polled by hand, and a clock moved by hand."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any


def drive(managers: Iterable[Any], until: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll every manager (as its node loop would) until `until()` holds."""
    managers = list(managers)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in managers:
            m.poll()
        if until():
            return
        time.sleep(0.0005)
    raise AssertionError("condition not reached in time")


class Clock:
    """A monotonic clock the test moves by hand (a SIGSTOP is a jump of the writer's clock)."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t
