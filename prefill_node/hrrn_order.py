"""HRRN order of a waiting queue, vectorized: highest response ratio next, in tokens.

SGLang's key, ascending: ``(+inf, rid)`` when deprioritized by in-batch dedup,
``(-inf, rid)`` when nothing is left to prefill (drains first), else
``(-(processed - arrival_processed) / uncached, rid)`` with ``uncached = len(input) -
matched`` and the waited tokens clamped at 0. Without a counter (None) nothing ages, so a
class is in rid order. The ratios move every round, so they are computed for the whole
queue with numpy; what only changes with a match or the dedup status is kept per request.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from operator import attrgetter

import numpy as np

from common.request import Req

_RID = attrgetter("rid")
_DRAIN, _DEPRIORITIZED = 0.0, -1.0  # codes in _uncached besides a positive token count


class HrrnOrder:
    """Per-request HRRN state of one waiting queue and the sort that uses it."""

    def __init__(self) -> None:
        self._uncached: dict[Req, float] = {}  # uncached tokens, or _DRAIN / _DEPRIORITIZED
        self._arrival: dict[Req, float] = {}  # arrival_processed_tokens
        self._deprioritized_by_rid: list[Req] = []  # the +inf class, already in key order

    def update(self, reqs: Iterable[Req], deprioritized: set[Req], moved: set[Req]) -> None:
        """Recompute the state of ``reqs`` (new match or dedup status); ``moved`` are the
        requests whose dedup status changed, ``deprioritized`` this round's set."""
        for r in reqs:
            uncached = len(r.origin_input_ids) - r.prefix_len
            if r in deprioritized:
                self._uncached[r] = _DEPRIORITIZED
            else:
                self._uncached[r] = float(uncached) if uncached > 0 else _DRAIN
            self._arrival[r] = float(r.arrival_processed_tokens)
        if not moved:
            return
        ordered = self._deprioritized_by_rid
        if len(moved) * 8 > len(ordered):
            self._deprioritized_by_rid = sorted(deprioritized, key=_RID)
            return
        for r in moved:
            if r in deprioritized:
                bisect.insort(ordered, r, key=_RID)
            else:
                ordered.remove(r)

    def forget(self, r: Req) -> None:
        if self._uncached.pop(r, None) == _DEPRIORITIZED:
            self._deprioritized_by_rid.remove(r)
        self._arrival.pop(r, None)

    def sort(self, queue: list[Req], processed_tokens: int | None) -> None:
        """Sort ``queue`` in place; every request in it must have been updated."""
        n = len(queue)
        uncached = np.fromiter(map(self._uncached.__getitem__, queue), np.float64, n)
        if processed_tokens is None:
            ratio = np.zeros(n)
        else:
            arrival = np.fromiter(map(self._arrival.__getitem__, queue), np.float64, n)
            waited = np.maximum(float(processed_tokens) - arrival, 0.0)
            ratio = waited / np.where(uncached > 0, uncached, 1.0)
        key = np.where(uncached > 0, -ratio, np.where(uncached == _DRAIN, -np.inf, np.inf))
        order = np.argsort(key, kind="stable")
        num_ahead = n - len(self._deprioritized_by_rid)  # +inf sorts last
        index: list[int] = order[:num_ahead].tolist()
        ranked = key[order[:num_ahead]]
        is_tie = ranked[1:] == ranked[:-1]
        if is_tie.any():  # equal keys (the drain class, equal ratios): rid order
            starts = is_tie & ~np.concatenate(([False], is_tie[:-1]))
            ends = is_tie & ~np.concatenate((is_tie[1:], [False]))
            for lo, hi in zip(np.flatnonzero(starts), np.flatnonzero(ends) + 2, strict=True):
                index[lo:hi] = sorted(index[lo:hi], key=lambda i: queue[i].rid)
        queue[:] = [*map(queue.__getitem__, index), *self._deprioritized_by_rid]
