"""In-batch prefix dedup: of the waiting requests that share a prefix the cache lacks,
only the first goes ahead this round, so the shared prefix is computed once.

SGLang rebuilds a token-only radix tree of the queue every round: in queue order, a
request whose cached match is at most ``check_threshold`` tokens is matched against the
tree; a match of at least ``deprioritize_threshold`` (D) tokens deprioritizes it, else
its tokens are inserted. A match of at least D tokens means some inserted request has
the same first D tokens, and whoever shares the first D tokens with an inserted request
is itself never inserted; so, among the low-match requests with at least D tokens, the
deprioritized ones are exactly those that are not the first (the leader) of their group
of equal D-token prefixes. We keep those groups (keyed by the packed D-token prefix) as
matches change, with their leaders: a leader stays first while the queue only loses
requests and gains arrivals at its tail and the last sort kept leaders ahead (deprioritized
requests sort last). Only a group whose leader left, or that a request joined from inside
the queue, is looked up again in queue order: no tree, no per-token work.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import compress

from common.token_keys import TOKEN_BYTES
from prefill_node.request import Req

GroupKey = tuple[bytes | None, bytes]


class InBatchDedup:
    """Groups of low-match waiting requests by their first ``deprioritize_threshold`` tokens."""

    def __init__(self, check_threshold: int, deprioritize_threshold: int) -> None:
        self.check_threshold = check_threshold  # < 0 disables dedup
        self.deprioritize_threshold = deprioritize_threshold
        self._key_bytes = max(0, deprioritize_threshold) * TOKEN_BYTES
        # Threshold <= 0: every in-queue match reaches it, so every member is deprioritized.
        self._is_all = deprioritize_threshold <= 0
        # A group: (the salt's namespace, the first deprioritize-threshold tokens' bytes).
        self._group_of: dict[Req, GroupKey] = {}
        self._groups: dict[GroupKey, set[Req]] = {}
        self._leader: dict[GroupKey, Req] = {}  # first in queue order, unless unsure
        self._unsure: set[GroupKey] = set()  # groups whose leader must be looked up again
        self._deprioritized: set[Req] = set()  # the non-leaders of sure groups
        self._moved: set[Req] = set()  # entered or left _deprioritized since the last round

    def update(
        self,
        arrivals: Iterable[Req],
        rematched: Iterable[Req],
        departed: Iterable[Req],
        is_order_kept: bool,
    ) -> None:
        """Follow the queue: ``arrivals`` were appended at its tail, ``rematched`` have a new
        match, ``departed`` left. is_order_kept: apart from that, the queue is in the order
        of the last round's sort, and that sort put every group's leader ahead."""
        if not is_order_kept and not self._is_all:
            self._unsure.update(self._groups)
        for r in departed:
            self._leave(r)
        for r in rematched:
            self._follow(r, is_arrival=False)
        for r in arrivals:  # at the tail only when the order is kept
            self._follow(r, is_arrival=is_order_kept)

    def deprioritized(self, queue: list[Req]) -> tuple[set[Req], set[Req]]:
        """(this round's deprioritized requests, those whose status changed since the last
        call). The first set is live: read it, don't keep or change it."""
        if self._unsure:
            self._find_leaders(queue)
        moved, self._moved = self._moved, set()
        return self._deprioritized, moved

    def _find_leaders(self, queue: list[Req]) -> None:
        keys, self._unsure = self._unsure, set()
        groups = self._groups
        members = set().union(*(groups[key] for key in keys))
        in_order = list(compress(queue, map(members.__contains__, queue)))
        first = dict(zip(map(self._group_of.__getitem__, reversed(in_order)), reversed(in_order)))
        for key in keys:
            leader = self._leader[key] = first[key]
            for r in groups[key]:
                self._flag(r, r is not leader)

    def _follow(self, r: Req, is_arrival: bool) -> None:
        key = None
        # Like SGLang, the check reads the device part of the match: requests that share a
        # prefix on the host tier are deduplicated too, so it is loaded back once.
        if (
            r.reads_cache
            and r.device_prefix_len <= self.check_threshold
            and len(r.key) >= self._key_bytes
        ):
            # Requests of different cache salts share no pages: never one group.
            key = (r.namespace, r.key[: self._key_bytes])
        if self._group_of.get(r) == key:
            return
        self._leave(r)
        if key is None:
            return
        self._group_of[r] = key
        members = self._groups.setdefault(key, set())
        members.add(r)
        if self._is_all:
            self._flag(r, True)
        elif len(members) == 1:
            self._leader[key] = r
        elif key in self._unsure:
            pass
        elif is_arrival:  # behind the leader in queue order
            self._flag(r, True)
        else:
            self._unsure.add(key)

    def _leave(self, r: Req) -> None:
        key = self._group_of.pop(r, None)
        if key is None:
            return
        self._flag(r, False)
        members = self._groups[key]
        members.discard(r)
        if not members:
            del self._groups[key]
            self._leader.pop(key, None)
            self._unsure.discard(key)
        elif not self._is_all and self._leader[key] is r:
            if len(members) == 1:
                (last,) = members
                self._leader[key] = last
                self._flag(last, False)
                self._unsure.discard(key)
            else:
                self._unsure.add(key)

    def _flag(self, r: Req, is_deprioritized: bool) -> None:
        if is_deprioritized == (r in self._deprioritized):
            return
        if is_deprioritized:
            self._deprioritized.add(r)
        else:
            self._deprioritized.discard(r)
        if r in self._moved:  # back where it was at the last round
            self._moved.discard(r)
        else:
            self._moved.add(r)
