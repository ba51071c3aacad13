"""In-batch prefix dedup: of the waiting requests that share a prefix the cache lacks,
only the first goes ahead this round, so the shared prefix is computed once.

SGLang rebuilds a token-only radix tree of the queue every round: in queue order, a
request whose cached match is at most ``check_threshold`` tokens is matched against the
tree; a match of at least ``deprioritize_threshold`` (D) tokens deprioritizes it, else
its tokens are inserted. A match of at least D tokens means some inserted request has
the same first D tokens, and whoever shares the first D tokens with an inserted request
is itself never inserted; so, among the low-match requests with at least D tokens, the
deprioritized ones are exactly those that are not the first of their group of equal
D-token prefixes. We keep those groups (keyed by the packed D-token prefix) as matches
change, and per round only pick each multi-member group's leader: no tree, no per-token
work, O(members of shared groups).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import compress

from common.request import TOKEN_BYTES, Req


class InBatchDedup:
    """Groups of low-match waiting requests by their first ``deprioritize_threshold`` tokens."""

    def __init__(self, check_threshold: int, deprioritize_threshold: int) -> None:
        self.check_threshold = check_threshold  # < 0 disables dedup
        self.deprioritize_threshold = deprioritize_threshold
        self._key_bytes = max(0, deprioritize_threshold) * TOKEN_BYTES
        self._group_of: dict[Req, bytes] = {}
        self._groups: dict[bytes, set[Req]] = {}
        self._shared: set[bytes] = set()  # keys of groups with two members or more

    def update(self, changed: Iterable[Req], departed: Iterable[Req]) -> None:
        """Follow new matches (``changed``) and requests that left the queue (``departed``)."""
        for r in departed:
            self._leave(r)
        limit, nbytes = self.check_threshold, self._key_bytes
        for r in changed:
            key = None
            if r.prefix_len <= limit and len(r.key) >= nbytes:
                key = r.key[:nbytes]
            if self._group_of.get(r) != key:
                self._leave(r)
                if key is not None:
                    self._join(r, key)

    def deprioritized(self, queue: list[Req]) -> set[Req]:
        """This round's deprioritized requests: in each shared group all but the first in
        ``queue`` order. One C-level pass over the queue when any group is shared."""
        if self.deprioritize_threshold <= 0:  # every in-queue match reaches the threshold
            return set(compress(queue, map(self._group_of.__contains__, queue)))
        if not self._shared:
            return set()
        groups = self._groups
        members = set().union(*(groups[key] for key in self._shared))
        in_order = list(compress(queue, map(members.__contains__, queue)))
        keys = map(self._group_of.__getitem__, reversed(in_order))
        leaders = dict(zip(keys, reversed(in_order)))  # the first in queue order wins
        out = set(in_order)
        out.difference_update(leaders.values())
        return out

    def _join(self, r: Req, key: bytes) -> None:
        self._group_of[r] = key
        members = self._groups.setdefault(key, set())
        members.add(r)
        if len(members) == 2:
            self._shared.add(key)

    def _leave(self, r: Req) -> None:
        key = self._group_of.pop(r, None)
        if key is None:
            return
        members = self._groups[key]
        members.discard(r)
        if len(members) == 1:
            self._shared.discard(key)
        elif not members:
            del self._groups[key]
