"""Incremental prefix matching: each waiting request is matched once, then again only
when the radix tree changed in a way that can change its match.

SGLang rematches every waiting request every round (~23 us each) and so turns lpm/hrrn
into fcfs above 128 waiting requests. Here a request's ``MatchResult`` is kept and two
indexes say which tree changes concern it:

- ``by_node[n]``: requests whose match ends in node ``n``. Evicting ``n`` drops pages of
  those matches; splitting ``n`` moves to the new upper node the end of those that end
  inside it at or above the cut (the split event carries the cut's depth).
- ``by_extend[(n, page)]``: requests whose match ends exactly at the end of ``n`` and
  whose next page is ``page``. Only a child added to ``n`` under that page can lengthen
  such a match (children are keyed by their first page).

With a host tier (HiRadixCache) a match may go on through host-only nodes; it is also
filed under the first of them and the deepest. A node that changes tier (``EV_TIER``:
its device pages evicted, or loaded back) concerns the matches filed under it: a node
goes to the host only as a device leaf, so the matches through it end there, and comes
back only below a device node, so it is the first host-only node of every match through
it. A split of a node concerns every match with a host part filed under it.

No other change can alter a match: a split above ``n`` keeps its pages and node, an
evicted node is always a leaf of its tier (so never above a live match), locks and LRU
touches don't change the tree's shape. Each round reads the tree's event log since the last round
(O(changes)), rematches the requests it names, and finds arrivals and departures with a
few C-level passes over the queue. A request therefore never uses a match that misses an
insert or keeps an evicted page, and costs nothing while the tree doesn't change under it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import filterfalse

from common.radix_cache import RadixCache
from common.radix_node import EV_ADD, EV_SPLIT, MatchResult, TreeNode
from prefill_node.request import Req


@dataclass(frozen=True, slots=True)
class RefreshResult:
    """What one ``PrefixMatcher.refresh`` did."""

    arrivals: list[Req]  # matched for the first time, in queue order
    rematched: list[Req]  # tracked requests with a new match since the last refresh
    departed: list[Req]  # tracked last round, no longer in the queue
    # The queue is last round's remembered order minus some head plus appended arrivals.
    is_order_kept: bool
    num_rematched: int  # matches recomputed this call because the tree changed under them

    @property
    def changed(self) -> list[Req]:
        return self.arrivals + self.rematched


class PrefixMatcher:
    """Keeps ``req.match`` current for the requests of a waiting queue."""

    def __init__(self, tree: RadixCache) -> None:
        self.tree = tree
        self._tracked: dict[Req, None] = {}
        self._by_node: dict[TreeNode, set[Req]] = {}
        self._by_extend: dict[tuple[TreeNode, bytes], set[Req]] = {}
        self._dirty: set[Req] = set()
        # Rematched by match_req since the last refresh: reported as changed by the next one.
        self._matched_between: set[Req] = set()
        # The queue as the policy left it last round (see remember_order).
        self._order: list[Req] = []
        self._cursor = tree.version
        self._generation = tree.generation
        self.num_matches = 0  # every match_prefix call made, for tests and benchmarks

    @property
    def num_tracked(self) -> int:
        return len(self._tracked)

    def refresh(self, queue: list[Req]) -> RefreshResult:
        """Bring every request of ``queue`` up to date; forget those no longer in it."""
        self._sync()
        arrivals, departed, is_order_kept = self._diff(queue)
        for r in departed:
            self.forget(r)
        stale = list(self._dirty)
        self._dirty.clear()
        for r in arrivals:
            self._tracked[r] = None
        for r in arrivals:
            self._rematch(r)
        for r in stale:
            self._rematch(r)
        if arrivals or stale:
            touched = [r.match.end_node for r in (*arrivals, *stale)]  # type: ignore[union-attr]
            self.tree.touch_paths(touched, is_ordered=False)
        rematched = stale
        if self._matched_between:  # the departed were forgotten above: the rest are waiting
            rematched = stale + list(self._matched_between.difference(stale))
            self._matched_between.clear()
        return RefreshResult(arrivals, rematched, departed, is_order_kept, len(stale))

    def remember_order(self, queue: list[Req]) -> None:
        """Note the queue's order after this round's sort. Next round, a queue that is this
        one minus a head plus appended arrivals (the usual case) is diffed without a scan."""
        self._order = queue[:]

    def _diff(self, queue: list[Req]) -> tuple[list[Req], list[Req], bool]:
        """(arrivals in queue order, departed, is_order_kept) since the last refresh."""
        tracked, last = self._tracked, self._order
        self._order = []
        if last and queue:
            try:
                head = last.index(queue[0])
            except ValueError:
                head = -1
            kept = len(last) - head
            # Requests compare by identity, so this is a C-level pointer scan.
            if head >= 0 and queue[:kept] == last[head:] and len(tracked) == len(last):
                arrivals = queue[kept:]
                if not any(map(tracked.__contains__, arrivals)):
                    return arrivals, last[:head], True
        arrivals = list(filterfalse(tracked.__contains__, queue))
        if len(queue) - len(arrivals) == len(tracked):
            return arrivals, [], False
        waiting = set(queue)
        return arrivals, list(filterfalse(waiting.__contains__, tracked)), False

    def match_req(self, req: Req) -> MatchResult:
        """The current match of one request, memoized: the same object while the tree did
        not change under it. Call before locking a request's prefix (e.g. after evicting)."""
        self._sync()
        if req in self._tracked and req not in self._dirty:
            return req.match  # type: ignore[return-value]
        self._dirty.discard(req)
        if req not in self._tracked:
            self._tracked[req] = None
            self._order = []  # tracked no longer mirrors the last queue
        self._rematch(req)
        self._matched_between.add(req)
        return req.match  # type: ignore[return-value]

    def forget(self, req: Req) -> None:
        """Stop tracking a request (it left the queue); refresh also does this itself."""
        if self._tracked.pop(req, 0) is None:
            self._order = []
            self._unregister(req)
            self._dirty.discard(req)
            self._matched_between.discard(req)

    def _sync(self) -> None:
        """Mark dirty the tracked requests that the tree's changes since last time concern."""
        tree = self.tree
        if tree.version == self._cursor:
            return
        events = tree.events_since(self._cursor) if tree.generation == self._generation else None
        self._cursor, self._generation = tree.version, tree.generation
        if events is None:  # reset, or too far behind: match everyone again
            self._by_node.clear()
            self._by_extend.clear()
            self._dirty.update(self._tracked)
            return
        dirty, by_node, by_extend = self._dirty, self._by_node, self._by_extend
        for kind, node, key in events:
            if kind == EV_ADD:
                reqs = by_extend.pop((node, key), None)  # type: ignore[arg-type]
                if reqs:
                    dirty |= reqs
            elif kind == EV_SPLIT:  # only matches ending inside the cut-off part move
                reqs = by_node.get(node)
                if reqs:
                    dirty.update(r for r in reqs if _ends_by(r.match, key))  # type: ignore[arg-type]
            else:  # EV_EVICT, EV_TIER
                reqs = by_node.pop(node, None)
                if reqs:
                    dirty |= reqs

    def _rematch(self, req: Req) -> None:
        self._unregister(req)
        m = self.tree.match_prefix(req.key, req.namespace)
        self.num_matches += 1
        req.match = m
        for node in _filed_under(m):
            self._by_node.setdefault(node, set()).add(req)
        if m.extend_key is not None:
            self._by_extend.setdefault((m.end_node, m.extend_key), set()).add(req)

    def _unregister(self, req: Req) -> None:
        m = req.match
        if not isinstance(m, MatchResult):
            return
        for node in _filed_under(m):
            reqs = self._by_node.get(node)
            if reqs is not None:
                reqs.discard(req)
                if not reqs:
                    del self._by_node[node]
        if m.extend_key is not None:
            watch = (m.end_node, m.extend_key)
            reqs = self._by_extend.get(watch)
            if reqs is not None:
                reqs.discard(req)
                if not reqs:
                    del self._by_extend[watch]


def _filed_under(m: MatchResult) -> tuple[TreeNode, ...]:
    """The nodes whose changes concern match m (see the module's doc)."""
    if m.first_host is None:
        return (m.last_node,)
    return (m.last_node, m.first_host, m.end_node)


def _ends_by(match: MatchResult, depth: int) -> bool:
    """Whether a split at depth (tokens) moves the end of match, or its host part."""
    return match.first_host is not None or (match.is_partial and match.num_tokens <= depth)
