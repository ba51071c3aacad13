"""The gateway's global index of cached KV pages: page hash -> the prefill nodes holding it.

Built from the nodes' KV events (prefill_node/kv_events.py): each node's batches carry
a sequence number, and the index keeps, per node and process instance, the last one it
applied. A batch that follows it is applied; a batch that skips ahead (lost batches, or
a subscriber that joined late) is applied too but the node is marked stale until a
snapshot comes (``needs_snapshot``, which the subscriber asks for); a new instance of a
node (it restarted, its cache is empty) starts over; a snapshot replaces the node's set.

Expected pages: a request routed to a node will leave its prompt's pages there when its
prefill ends, but the node's events say so only then, a whole prefill later. Until they
do, the gateway's own dispatch (``expect``) counts them as held: without it, every
request of a prefix that its holders are too busy for starts one more copy on another
node (none of them shows up in the index before its prefill ends), and at high load the
copies evict other prefixes, whose requests copy them again (the collapse
bench/routing_sim.py reproduces). The node's queue report has the same blind spot: it
counts a request waiting behind the copy as computing the whole prompt, as its cache
does not hold it yet; the index takes those lent tokens off the report (report_load),
or the node that takes a prefix's requests looks the busiest and the copies start over.
An expectation ends when the node's events show its last page (the prefill inserted it)
or the node is dropped; one never confirmed (the request failed, or its pages were
evicted before a batch went out) stays until newer ones push it past the node's pool
size, the most a node can hold: a request that follows it computes the pages and
confirms them.

Memory: one dict entry per distinct page hash (a bit mask of the nodes holding it) and
one set entry per (node, page). A node's set is capped at the pool size it registered
with (a node cannot hold more pages than its pool): stores beyond it are not indexed
and counted, and the node is asked for a snapshot, so the index stays within the sum
of the nodes' pools even when a node misreports; its expected pages are capped the
same way. A lost node is dropped at once.

Tiers: a node with a host tier under its cache says which of its pages are on the host
alone (``stored_host``); they count as held, and ``host_pages`` says how many of a node's
leading pages they are, for the router to price their load back.

Scoring (``overlaps``): the number of leading prompt pages each node holds or expects. A
radix cache holds a page's whole prefix whenever it holds the page, so the nodes holding
page i+1 are among those holding page i: the masks shrink along the prompt, and each
place where one shrinks is found by bisection over the pages (~log2(pages) lookups per
distinct depth, not per node).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from common.page_hash import HashArray


@dataclass(eq=False)
class Expectation:
    """A request routed to a node whose prompt pages the node's events have not stored yet."""

    start: int  # leading prompt pages the node held when it was routed: ``pages`` follow
    pages: list[int]
    page_size: int
    # Routed as holding ``depth`` pages, those past ``start`` because an earlier request
    # here (``lender``) stores them first: while that one is under way, the node counts
    # them in its queue as this request's to compute.
    depth: int = 0
    lender: Expectation | None = None
    is_live: bool = True

    def lent_tokens(self, held: set[int]) -> int:
        """Tokens the node counts for it that the lender will have stored first."""
        if self.lender is None or not self.lender.is_live:
            return 0
        at, pages = self.depth - 1 - self.start, self.pages
        if pages[at] in held:
            return 0
        first = self.start + _depth(pages, held.__contains__, 0)  # held now
        return (self.depth - first) * self.page_size


@dataclass
class NodeCache:
    """What the index believes one node holds."""

    slot: int
    instance_id: str
    max_pages: int
    seq: int = -1  # last batch applied; -1: none yet
    hashes: set[int] = field(default_factory=set)
    needs_snapshot: bool = True
    # As last reported, less the tokens lent to the requests waiting there (see expect).
    queued_tokens: int = 0
    num_over_cap: int = 0
    # Pages routed here whose store has not been seen yet: page hash -> requests expecting
    # it, and those requests, oldest first.
    expected: dict[int, int] = field(default_factory=dict)
    expectations: deque[Expectation] = field(default_factory=deque)
    # Of hashes, the pages the node holds on its host tier alone, and what loading one
    # back costs there as a fraction of computing it (its events say both).
    host: set[int] = field(default_factory=set)
    host_load_cost: float = 0.0


class KVIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # page hash -> bit mask of node slots
        self._expecting: dict[int, int] = {}  # page hash -> bit mask of nodes expecting it
        self._host: dict[int, int] = {}  # page hash -> bit mask of nodes holding it on host alone
        self._nodes: dict[str, NodeCache] = {}
        self._slot_owner: list[str | None] = []
        self._free_slots: list[int] = []
        # node id -> its queued tokens as precise routing counts them: the last report (less
        # lent tokens) plus what the gateway sent it since (``sent``); kept as they change,
        # so a routing decision reads it, not a pass over every node.
        self._loads: dict[str, int] = {}
        self.num_gaps = 0
        self.num_over_cap = 0

    # ---- events --------------------------------------------------------------------------

    def apply(
        self,
        node_id: str,
        instance_id: str,
        seq: int,
        *,
        stored: HashArray,
        removed: HashArray,
        is_snapshot: bool,
        queued_tokens: int,
        max_pages: int,
        stored_host: HashArray | None = None,
        host_load_cost: float = 0.0,
    ) -> NodeCache:
        """One batch of node ``node_id``'s events; returns its state (see needs_snapshot).
        ``stored_host``: pages now held on the node's host tier alone (``stored``: on its
        device, again)."""
        node = self._nodes.get(node_id)
        if node is not None and node.instance_id != instance_id:
            self.drop_node(node_id)  # a new process: the old one's cache is gone
            node = None
        if node is None:
            node = self._add_node(node_id, instance_id, max_pages)
        node.max_pages = max_pages
        node.host_load_cost = host_load_cost
        on_host = stored_host.tolist() if stored_host is not None else []
        if is_snapshot:
            self._replace(node, stored, on_host)
            node.seq, node.needs_snapshot = seq, False
            self._confirm(node)
        elif seq > node.seq:  # else a repeat, or a keepalive that carries the last seq
            if node.seq < 0:
                node.needs_snapshot = True  # joined mid-stream: what came before is unknown
            elif seq != node.seq + 1:
                self.num_gaps += 1
                node.needs_snapshot = True
            node.seq = seq
            self._remove(node, removed.tolist())
            if len(stored):
                self._store(node, stored.tolist())
                self._set_host(node, stored.tolist(), False)
                self._confirm(node)
            if on_host:
                self._store(node, on_host)
                self._set_host(node, on_host, True)
        self.report_load(node_id, queued_tokens)
        return node

    def report_load(self, node_id: str, queued_tokens: int) -> None:
        """The node's queued tokens, less what it counts of the requests waiting behind a
        request that stores their prefix first (it knows only what its cache holds now)."""
        node = self._nodes.get(node_id)
        if node is not None:
            lent = sum(e.lent_tokens(node.hashes) for e in node.expectations if e.lender)
            node.queued_tokens = max(0, queued_tokens - lent)
        # The report counts what reached the node before it was sent.
        self._loads[node_id] = node.queued_tokens if node is not None else 0

    def sent(self, node_id: str, tokens: int) -> None:
        """The gateway sent ``node_id`` a request it expects to compute ``tokens``: they
        count in its queue until its next report (which has them)."""
        self._loads[node_id] = self._loads.get(node_id, 0) + tokens

    def expect(self, node_id: str, hashes: Sequence[int], page_size: int) -> None:
        """A request with these prompt page hashes was routed to ``node_id``: count its
        pages as held there until the node's events store them (see the module's doc).
        Pages it was routed as holding because an earlier request here stores them
        first are lent: until that one's pages are stored the node counts them in its
        queue, and the index takes them off (report_load)."""
        node = self._nodes.get(node_id)
        if node is None or not hashes or len(hashes) > node.max_pages:
            return  # a node the index has not heard from: nothing to add to
        mine, expected, n = node.hashes, node.expected, len(hashes)
        if hashes[n - 1] in mine:
            return  # held already: nothing new will be stored
        start = _depth(hashes, mine.__contains__, 0)
        held = _depth(hashes, lambda h: h in mine or h in expected, start)
        lender = None
        if held > start:  # the oldest request here that stores page held - 1
            last, at = hashes[held - 1], held - 1
            lender = next(
                (
                    e
                    for e in node.expectations
                    if 0 <= at - e.start < len(e.pages) and e.pages[at - e.start] == last
                ),
                None,
            )
        pages = list(hashes[start:])
        bit, expecting = 1 << node.slot, self._expecting
        for h in pages:
            count = expected.get(h, 0)
            expected[h] = count + 1
            if not count:
                expecting[h] = expecting.get(h, 0) | bit
        node.expectations.append(Expectation(start, pages, page_size, held, lender))
        while len(expected) > node.max_pages:
            self._forget(node, node.expectations.popleft())

    def drop_node(self, node_id: str) -> None:
        """Forget everything about a node (it is lost, or restarted)."""
        self._loads.pop(node_id, None)
        node = self._nodes.pop(node_id, None)
        if node is None:
            return
        self._remove(node, list(node.hashes))
        while node.expectations:
            self._forget(node, node.expectations.popleft())
        self._slot_owner[node.slot] = None
        self._free_slots.append(node.slot)

    def _add_node(self, node_id: str, instance_id: str, max_pages: int) -> NodeCache:
        if self._free_slots:
            slot = self._free_slots.pop()
            self._slot_owner[slot] = node_id
        else:
            slot = len(self._slot_owner)
            self._slot_owner.append(node_id)
        node = self._nodes[node_id] = NodeCache(slot, instance_id, max_pages)
        return node

    def _store(self, node: NodeCache, hashes: Iterable[int]) -> None:
        bit, holders, mine = 1 << node.slot, self._holders, node.hashes
        for h in hashes:
            if h in mine:
                continue
            if len(mine) >= node.max_pages:
                node.num_over_cap += 1
                self.num_over_cap += 1
                node.needs_snapshot = True
                continue
            mine.add(h)
            holders[h] = holders.get(h, 0) | bit

    def _remove(self, node: NodeCache, hashes: Iterable[int]) -> None:
        bit, holders, mine = 1 << node.slot, self._holders, node.hashes
        hashes = list(hashes)
        if node.host:
            self._set_host(node, hashes, False)
        for h in hashes:
            if h not in mine:
                continue
            mine.discard(h)
            _clear_bit(holders, h, bit)

    def _set_host(self, node: NodeCache, hashes: Iterable[int], on_host: bool) -> None:
        """Mark the node's pages among ``hashes`` as held on its host tier alone, or not."""
        bit, host, mine = 1 << node.slot, self._host, node.host
        for h in hashes:
            if on_host and h in node.hashes and h not in mine:
                mine.add(h)
                host[h] = host.get(h, 0) | bit
            elif not on_host and h in mine:
                mine.discard(h)
                _clear_bit(host, h, bit)

    def _replace(self, node: NodeCache, hashes: HashArray, on_host: list[int]) -> None:
        new = set(hashes.tolist())
        new.update(on_host)
        self._remove(node, list(node.hashes - new))
        self._store(node, new - node.hashes)
        self._set_host(node, list(node.host.difference(on_host)), False)
        self._set_host(node, on_host, True)

    def _confirm(self, node: NodeCache) -> None:
        """End the expectations whose last page the node's events have now stored."""
        mine = node.hashes
        if not any(e.pages[-1] in mine for e in node.expectations):
            return
        kept: deque[Expectation] = deque()
        for e in node.expectations:
            if e.pages[-1] in mine:
                self._forget(node, e)
            else:
                kept.append(e)
        node.expectations = kept

    def _forget(self, node: NodeCache, e: Expectation) -> None:
        e.is_live, e.lender = False, None  # no chain of ended ones stays reachable
        expected, bit, expecting = node.expected, 1 << node.slot, self._expecting
        for h in e.pages:
            count = expected[h] - 1
            if count:
                expected[h] = count
                continue
            del expected[h]
            _clear_bit(expecting, h, bit)

    # ---- queries -------------------------------------------------------------------------

    def overlaps(self, hashes: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]:
        """Leading pages of ``hashes`` each of ``node_ids`` holds or expects (only nodes
        with >= 1).

        The nodes holding page i+1 are among those holding page i (a radix cache holds
        every page before one it holds), so walking down the prompt the set of holders
        only shrinks; each place it shrinks is found by bisection, and the nodes that
        leave there hold that many pages. (If an index out of step with a node had a
        hole, the depth found would be a page the node holds, not necessarily the first
        gap.)"""
        n = len(hashes)
        if not n:
            return {}
        holders, expecting = self._holders, self._expecting
        h = hashes[0]
        live = holders.get(h, 0) | expecting.get(h, 0)  # the nodes holding pages [0, lo)
        if not live:
            return {}
        h = hashes[n - 1]
        whole = holders.get(h, 0) | expecting.get(h, 0)
        depths: list[tuple[int, int]] = []  # (nodes, the pages they hold)
        lo = 1
        while live & whole != live:
            a, b = lo, n - 1  # the first page some of them lack is in [lo, n - 1]
            while a < b:
                mid = (a + b) // 2
                h = hashes[mid]
                if (holders.get(h, 0) | expecting.get(h, 0)) & live == live:
                    a = mid + 1
                else:
                    b = mid
            h = hashes[a]
            kept = (holders.get(h, 0) | expecting.get(h, 0)) & live
            depths.append((live & ~kept, a))
            live, lo = kept, a + 1
        depths.append((live, n))
        wanted = node_ids if isinstance(node_ids, (set, frozenset, dict)) else set(node_ids)
        owner, out = self._slot_owner, {}
        for mask, depth in depths:
            for slot in _bits(mask):
                node_id = owner[slot]  # never None: a freed slot's bits are cleared
                if node_id is not None and node_id in wanted:
                    out[node_id] = depth
        return out

    def host_pages(self, hashes: Sequence[int], depths: Mapping[str, int]) -> dict[str, int]:
        """Of the ``depths[n]`` leading pages of ``hashes`` each node holds (overlaps), those
        on its host tier alone (only nodes with >= 1). A node's device pages come first (its
        device tier is prefix-closed), so the host part starts where bisection finds it."""
        host, out = self._host, dict[str, int]()
        if not host:
            return out
        for node_id, depth in depths.items():
            node = self._nodes.get(node_id)
            if node is None or not node.host or depth <= 0:
                continue
            bit = 1 << node.slot
            if not host.get(hashes[depth - 1], 0) & bit:
                continue  # the last page it holds is on its device: all of them are
            a, b = 0, depth - 1  # the first page on the host alone is in [0, depth - 1]
            while a < b:
                mid = (a + b) // 2
                if host.get(hashes[mid], 0) & bit:
                    b = mid
                else:
                    a = mid + 1
            out[node_id] = depth - a
        return out

    def host_load_cost(self, node_id: str) -> float:
        """What loading a page back costs on the node, as a fraction of computing it."""
        node = self._nodes.get(node_id)
        return node.host_load_cost if node is not None else 0.0

    @property
    def loads(self) -> Mapping[str, int]:
        """Each node's queued tokens: its last report plus what was sent to it after (see
        ``sent``); a node neither reported nor sent to is missing (0). Read in place."""
        return self._loads

    def node(self, node_id: str) -> NodeCache | None:
        return self._nodes.get(node_id)

    def node_ids(self) -> list[str]:
        return list(self._nodes)

    @property
    def num_pages(self) -> int:
        """Distinct page hashes indexed."""
        return len(self._holders)

    @property
    def num_entries(self) -> int:
        """(node, page) pairs indexed."""
        return sum(len(n.hashes) for n in self._nodes.values())

    @property
    def num_expected(self) -> int:
        """(node, page) pairs expected from requests routed and not yet stored."""
        return sum(len(n.expected) for n in self._nodes.values())

    def memory_bytes(self) -> int:
        """The index's size: its dicts and sets and the ints they hold (sys.getsizeof)."""
        total = 0
        for table in (self._holders, self._expecting):
            total += sys.getsizeof(table)
            total += sum(sys.getsizeof(h) + sys.getsizeof(m) for h, m in table.items())
        for node in self._nodes.values():
            total += sys.getsizeof(node.hashes) + sum(map(sys.getsizeof, node.hashes))
            total += sys.getsizeof(node.expected) + sum(map(sys.getsizeof, node.expected))
        return total


def _depth(hashes: Sequence[int], holds: Callable[[int], bool], lo: int) -> int:
    """Leading pages of ``hashes`` that ``holds`` when its first ``lo`` are (bisection)."""
    hi = len(hashes)
    while lo < hi:
        mid = (lo + hi) // 2
        if holds(hashes[mid]):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _clear_bit(masks: dict[int, int], h: int, bit: int) -> None:
    """Take ``bit`` out of page ``h``'s mask (the page leaves the dict with its last bit)."""
    mask = masks[h] & ~bit
    if mask:
        masks[h] = mask
    else:
        del masks[h]


def _bits(mask: int) -> list[int]:
    """The positions of the set bits of ``mask``, lowest first."""
    return [i for i, bit in enumerate(bin(mask)[:1:-1]) if bit == "1"]
