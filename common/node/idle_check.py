"""A node's integrity check, run while its loop is idle.

Every page in exactly one place, every request in its state's queue: the schedulers'
``check_integrity()`` says so or raises AssertionError. Tests call it after each step; a
serving node calls it here, when a step found nothing to do and at most every
``interval_s`` (a large cache's check walks the whole tree). A failure is logged with its
reason and counted in ``pdserve_integrity_check_failures_total``, never raised: the node
keeps serving, and an operator alerts on the counter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from common import metrics

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 30.0


class IdleCheck:
    def __init__(
        self,
        check: Callable[[], None],
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.check = check
        self.interval_s = interval_s
        self.clock = clock
        self.last_run = clock()
        self.num_runs = 0
        self.num_failures = 0

    def maybe_run(self) -> bool:
        """Run the check if the interval has passed since the last run; whether it ran."""
        now = self.clock()
        if now - self.last_run < self.interval_s:
            return False
        self.last_run = now
        self.num_runs += 1
        try:
            self.check()
        except AssertionError as exc:
            self.num_failures += 1
            metrics.INTEGRITY_CHECK_FAILURES.labels(**metrics.role_labels()).inc()
            logger.error("integrity check failed: %s", exc)
        return True
