"""Sort orders of the cache-aware policies, kept per request between rounds.

Each order is told which requests got a new match or dedup status (``update``) and which
left the queue (``forget``), so a round's ``sort`` does C-level passes over the queue
instead of calling Python per request:

- ``StaticKeyOrder``: lpm and shortest-prefill-first, whose keys only change with those.
- ``HrrnOrder``: the ratios move every round, so they are computed with numpy.
- ``DfsWeightOrder``: request counts per radix node, ranked by one DFS over those nodes.

Like SGLang 0.5.23, lpm and hrrn key on the match capped at the prompt less its last token,
in tokens (``sort_prefix_len``; SGLang's ``num_matched_prefix_tokens``): that token is
computed even when the whole prompt is cached; both count host-tier hits. dfs-weight places
a request where its whole device match ends (SGLang's ``last_node``: a match continuing
into host-only nodes hangs on the device node above them). Admission starts from whole pages
(``usable_prefix_len``), a different number when the whole prompt is cached.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import Any, Protocol

import numpy as np

from common.radix_cache import RadixCache
from common.radix_node import TreeNode
from common.token_keys import TOKEN_BYTES
from prefill_node.dfs_weight import dfs_node_ranks
from prefill_node.request import Req

_RID = attrgetter("rid")
_BEHIND = TreeNode(b"", [], None, -1)  # dfs-weight's stand-in node of deprioritized requests


def usable_prefix_len(r: Req, page_size: int) -> int:
    """The cached prefix a prefill can start from: the match of the prompt less its last
    token, in whole pages (the last token is always computed)."""
    return min(r.prefix_len, (len(r.origin_input_ids) - 1) // page_size * page_size)


def sort_prefix_len(r: Req) -> int:
    """The cached tokens lpm and hrrn sort on: the match capped at the prompt less its last
    token, not rounded to pages (SGLang's ``num_matched_prefix_tokens``; page 4: a 20-token
    prompt fully cached keys 19, ahead of a 17-token one with 16 cached)."""
    return min(r.prefix_len, max(len(r.origin_input_ids) - 1, 0))


class CacheAwareOrder(Protocol):
    def update(self, reqs: Iterable[Req]) -> None: ...
    def forget(self, r: Req) -> None: ...
    def sort(self, queue: list[Req], processed_tokens: int | None) -> None: ...


class StaticKeyOrder:
    """A stable sort on a per-request key that changes only with the match or dedup."""

    def __init__(self, key: Callable[[Req], Any]) -> None:
        self._make_key = key
        self._key: dict[Req, Any] = {}

    def update(self, reqs: Iterable[Req]) -> None:
        for r in reqs:
            self._key[r] = self._make_key(r)

    def forget(self, r: Req) -> None:
        self._key.pop(r, None)

    def sort(self, queue: list[Req], processed_tokens: int | None) -> None:
        queue.sort(key=self._key.__getitem__)


class HrrnOrder:
    """SGLang's hrrn key, ascending: ``(+inf, rid)`` when deprioritized, else
    ``(-(processed - arrival_processed) / uncached, rid)`` with the waited tokens clamped
    at 0, where uncached counts from ``sort_prefix_len``, so it is at least 1 (a fully
    cached prompt still computes its last token). Without a counter (None) nothing ages: rid order
    within a class."""

    _DRAIN, _DEPRIORITIZED = 0.0, -1.0  # codes besides a positive uncached token count
    VECTOR_MIN = 256  # shorter queues sort with a Python key: numpy's fixed cost dominates

    def __init__(self) -> None:
        # complex(arrival_processed_tokens, uncached or a code): one C-level pass a round.
        self._state: dict[Req, complex] = {}
        self._deprioritized_by_rid: list[Req] = []  # the +inf class, already in key order

    def update(self, reqs: Iterable[Req]) -> None:
        flips = []
        for r in reqs:
            was = r in self._state and self._state[r].imag == self._DEPRIORITIZED
            uncached = len(r.origin_input_ids) - sort_prefix_len(r)
            if r.is_deprioritized:
                code = self._DEPRIORITIZED
            else:
                code = float(uncached) if uncached > 0 else self._DRAIN
            self._state[r] = complex(r.arrival_processed_tokens, code)
            if was != r.is_deprioritized:
                flips.append(r)
        ordered = self._deprioritized_by_rid
        if len(flips) > 256:  # e.g. the first round: sort once rather than insert each
            code = self._DEPRIORITIZED
            ordered[:] = sorted((r for r, s in self._state.items() if s.imag == code), key=_RID)
            return
        for r in flips:
            if r.is_deprioritized:
                bisect.insort(ordered, r, key=_RID)
            else:
                ordered.remove(r)

    def forget(self, r: Req) -> None:
        state = self._state.pop(r, None)
        if state is not None and state.imag == self._DEPRIORITIZED:
            self._deprioritized_by_rid.remove(r)

    def sort(self, queue: list[Req], processed_tokens: int | None) -> None:
        n = len(queue)
        if n < self.VECTOR_MIN:
            queue.sort(key=self._key_function(processed_tokens))
            return
        state = np.fromiter(map(self._state.__getitem__, queue), np.complex128, n)
        uncached = state.imag
        if processed_tokens is None:
            ratio = np.zeros(n)
        else:
            waited = np.maximum(float(processed_tokens) - state.real, 0.0)
            ratio = waited / np.where(uncached > 0, uncached, 1.0)
        drain_or_last = np.where(uncached == self._DRAIN, -np.inf, np.inf)
        key = np.where(uncached > 0, -ratio, drain_or_last)
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

    def _key_function(self, processed_tokens: int | None) -> Callable[[Req], tuple[float, str]]:
        """The same order as the vectorized sort, as a key for a plain sort."""
        state, now = self._state, 0.0 if processed_tokens is None else float(processed_tokens)
        is_aging = processed_tokens is not None

        def key(r: Req) -> tuple[float, str]:
            s = state[r]
            if s.imag > 0:
                return (-(max(now - s.real, 0.0) / s.imag if is_aging else 0.0), r.rid)
            return (-np.inf if s.imag == self._DRAIN else np.inf, r.rid)

        return key


class DfsWeightOrder:
    """SGLang's dfs-weight order (``prefill_node.dfs_weight``) over the requests that
    are not deprioritized, then the deprioritized ones in queue order.

    SGLang's match splits a node where a request's match ends inside it, so that request
    hangs on the new upper part, below which the rest of the node (and its children) come
    first in the post-order DFS. The same order without splitting: a request is ranked by
    the node its whole match ends in, then by how deep in that node it ends, deepest
    first (a split chain has one child per part, so the weights that order siblings do
    not change). The whole match, not the one capped for the last token: a fully cached
    prompt ends at its node's end, as deep as one that continues past it. The device part
    of the match: one that continues into host-only nodes is placed at the device node
    above them, as SGLang's ``last_node`` (its host part is loaded back once admitted)."""

    def __init__(self, tree: RadixCache) -> None:
        self.tree = tree
        self._node_of: dict[Req, tuple[TreeNode, int]] = {}  # _BEHIND: deprioritized
        self._counts: Counter[TreeNode] = Counter()

    def update(self, reqs: Iterable[Req]) -> None:
        for r in reqs:
            self._drop(r)
            if r.is_deprioritized:
                self._node_of[r] = (_BEHIND, 0)
            else:
                node, depth = self._end_of(r)
                self._node_of[r] = (node, depth)
                self._counts[node] += 1

    def _end_of(self, r: Req) -> tuple[TreeNode, int]:
        """The node the request's match ends in and the tokens of it that it covers."""
        match = r.match
        assert match is not None
        end = r.device_prefix_len
        node = match.last_node
        # Where node starts: the tokens of its ancestors' keys.
        start, up = 0, node.parent
        while up is not None:
            start += len(up.key) // TOKEN_BYTES
            up = up.parent
        while node.parent is not None and start >= end:  # no token of it (an empty match)
            node = node.parent
            start -= len(node.key) // TOKEN_BYTES
        return node, end - start

    def forget(self, r: Req) -> None:
        self._drop(r)

    def _drop(self, r: Req) -> None:
        node, _ = self._node_of.pop(r, (_BEHIND, 0))
        if node is not _BEHIND:
            self._counts[node] -= 1
            if not self._counts[node]:
                del self._counts[node]

    def sort(self, queue: list[Req], processed_tokens: int | None) -> None:
        rank = dfs_node_ranks(self.tree.root, self._counts)
        rank[_BEHIND] = len(rank)
        keys = [(rank[node], -depth) for node, depth in map(self._node_of.__getitem__, queue)]
        order = sorted(range(len(keys)), key=keys.__getitem__)  # stable: queue order in a node
        queue[:] = list(map(queue.__getitem__, order))
