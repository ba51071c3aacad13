"""The gateway's global index of cached KV pages: page hash -> the prefill nodes holding it.

Built only from the nodes' KV events (prefill_node/kv_events.py): each node's batches carry
a sequence number, and the index keeps, per node and process instance, the last one it
applied. A batch that follows it is applied; a batch that skips ahead (lost batches, or
a subscriber that joined late) is applied too but the node is marked stale until a
snapshot comes (``needs_snapshot``, which the subscriber asks for); a new instance of a
node (it restarted, its cache is empty) starts over; a snapshot replaces the node's set.

Memory: one dict entry per distinct page hash (a bit mask of the nodes holding it) and
one set entry per (node, page). A node's set is capped at the pool size it registered
with (a node cannot hold more pages than its pool): stores beyond it are not indexed
and counted, and the node is asked for a snapshot, so the index stays within the sum
of the nodes' pools even when a node misreports. A lost node is dropped at once.

Scoring (``overlaps``): the number of leading prompt pages each node holds. A radix cache
holds a page's whole prefix whenever it holds the page, so each node holding the first
page is searched by bisection in its own set: ~log2(pages) lookups per such node.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from common.page_hash import HashArray


@dataclass
class NodeCache:
    """What the index believes one node holds."""

    slot: int
    instance_id: str
    max_pages: int
    seq: int = -1  # last batch applied; -1: none yet
    hashes: set[int] = field(default_factory=set)
    needs_snapshot: bool = True
    queued_tokens: int = 0  # as last reported
    num_over_cap: int = 0


class KVIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}  # page hash -> bit mask of node slots
        self._nodes: dict[str, NodeCache] = {}
        self._slot_owner: dict[int, str] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
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
    ) -> NodeCache:
        """One batch of node ``node_id``'s events; returns its state (see needs_snapshot)."""
        node = self._nodes.get(node_id)
        if node is not None and node.instance_id != instance_id:
            self.drop_node(node_id)  # a new process: the old one's cache is gone
            node = None
        if node is None:
            node = self._add_node(node_id, instance_id, max_pages)
        node.max_pages = max_pages
        node.queued_tokens = queued_tokens
        if is_snapshot:
            self._replace(node, stored)
            node.seq, node.needs_snapshot = seq, False
            return node
        if seq <= node.seq:
            return node  # a repeat, or a keepalive that carries the last seq
        if node.seq < 0:
            node.needs_snapshot = True  # joined mid-stream: what came before is unknown
        elif seq != node.seq + 1:
            self.num_gaps += 1
            node.needs_snapshot = True
        node.seq = seq
        self._remove(node, removed.tolist())
        self._store(node, stored.tolist())
        return node

    def report_load(self, node_id: str, queued_tokens: int) -> None:
        node = self._nodes.get(node_id)
        if node is not None:
            node.queued_tokens = queued_tokens

    def drop_node(self, node_id: str) -> None:
        """Forget everything about a node (it is lost, or restarted)."""
        node = self._nodes.pop(node_id, None)
        if node is None:
            return
        self._remove(node, list(node.hashes))
        del self._slot_owner[node.slot]
        self._free_slots.append(node.slot)

    def _add_node(self, node_id: str, instance_id: str, max_pages: int) -> NodeCache:
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot, self._next_slot = self._next_slot, self._next_slot + 1
        node = self._nodes[node_id] = NodeCache(slot, instance_id, max_pages)
        self._slot_owner[slot] = node_id
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
        for h in hashes:
            if h not in mine:
                continue
            mine.discard(h)
            mask = holders[h] & ~bit
            if mask:
                holders[h] = mask
            else:
                del holders[h]

    def _replace(self, node: NodeCache, hashes: HashArray) -> None:
        new = set(hashes.tolist())
        self._remove(node, list(node.hashes - new))
        self._store(node, new - node.hashes)

    # ---- queries -------------------------------------------------------------------------

    def overlaps(self, hashes: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]:
        """Leading pages of ``hashes`` each of ``node_ids`` holds (only nodes holding >= 1).

        A radix cache holds every page before one it holds, so a node's set is closed
        under prefixes and its depth is found by binary search in it: about log2(pages)
        set lookups per node holding the first page, whatever the prompt's length. (If an
        index out of step with a node had a hole, the depth found would be a page the
        node holds, not necessarily the first gap.)"""
        n = len(hashes)
        mask = self._holders.get(hashes[0], 0) if n else 0
        if not mask:
            return {}
        wanted = node_ids if isinstance(node_ids, (set, frozenset, dict)) else set(node_ids)
        out: dict[str, int] = {}
        while mask:
            low = mask & -mask
            mask ^= low
            node_id = self._slot_owner[low.bit_length() - 1]
            if node_id not in wanted:
                continue
            mine = self._nodes[node_id].hashes
            if hashes[n - 1] in mine:
                out[node_id] = n
                continue
            lo, hi = 1, n - 1  # hashes[lo - 1] is held, hashes[hi] is not
            while lo < hi:
                mid = (lo + hi) // 2
                if hashes[mid] in mine:
                    lo = mid + 1
                else:
                    hi = mid
            out[node_id] = lo
        return out

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

    def memory_bytes(self) -> int:
        """The index's size: its dict and sets and the ints they hold (sys.getsizeof)."""
        total = sys.getsizeof(self._holders)
        total += sum(sys.getsizeof(h) + sys.getsizeof(m) for h, m in self._holders.items())
        for node in self._nodes.values():
            total += sys.getsizeof(node.hashes) + sum(map(sys.getsizeof, node.hashes))
        return total
