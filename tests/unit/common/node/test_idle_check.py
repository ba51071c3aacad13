"""The idle-time integrity check: at most once per interval, failures logged and counted."""

from __future__ import annotations

import logging

from common import metrics
from common.node.idle_check import IdleCheck


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_check_runs_once_per_interval_and_a_failure_is_counted_not_raised(caplog) -> None:
    clock = Clock()
    broken = [False]

    def check() -> None:
        if broken[0]:
            raise AssertionError("page 7 is held twice")

    idle = IdleCheck(check, interval_s=30.0, clock=clock)
    counter = metrics.INTEGRITY_CHECK_FAILURES.labels(**metrics.role_labels())
    before = counter._value.get()
    assert not idle.maybe_run()  # not before the first interval
    clock.now = 30.0
    assert idle.maybe_run() and idle.num_failures == 0
    clock.now = 45.0
    broken[0] = True
    assert not idle.maybe_run()
    clock.now = 60.0
    with caplog.at_level(logging.ERROR):
        assert idle.maybe_run()
    assert idle.num_runs == 2 and idle.num_failures == 1
    assert counter._value.get() == before + 1
    assert "page 7 is held twice" in caplog.text
