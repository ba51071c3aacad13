"""KV events end to end in one process: the radix cache's page hashes, the gateway's index, scoring.

The hashes a prefill node's cache publishes must be the ones the gateway computes from
the prompt alone (common/page_hash.py), whatever the tree's shape (splits, salts); the
index must follow stores, evictions, gaps, snapshots, restarts and lost nodes.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from bootstrap.kv_index import KVIndex
from common import page_hash
from common.token_keys import salt_key
from prefill_node.radix_cache import RadixCache

PS = 4


class Recorder:
    """A CacheEvents sink that keeps the set of pages the cache holds."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.num_cleared = 0

    def stored(self, hashes):
        new = set(hashes.tolist())
        assert not new & self.held, "a page stored twice"
        self.held |= new

    def removed(self, hashes):
        gone = set(hashes.tolist())
        assert gone <= self.held, "a page removed that was never stored"
        self.held -= gone

    def cleared(self):
        self.held.clear()
        self.num_cleared += 1


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def test_hashes_match_a_plain_reference_and_chain_across_pages():
    ids = _ids(41, 1)
    hashes = page_hash.prompt_hashes(ids, PS)
    assert len(hashes) == 10  # whole pages only
    # Continuing from page 3's hash gives the rest.
    assert page_hash.chain(ids[16:], PS, int(hashes[3])).tolist() == hashes[4:].tolist()
    # A page's hash depends on everything before it and on the salt.
    other = page_hash.prompt_hashes([ids[0] + 1] + ids[1:], PS)
    assert not set(other.tolist()) & set(hashes.tolist())
    salted = page_hash.prompt_hashes(ids, PS, "tenant-a")
    assert not set(salted.tolist()) & set(hashes.tolist())
    assert page_hash.unpack(page_hash.pack(hashes)).tolist() == hashes.tolist()
    with pytest.raises(ValueError):
        page_hash.unpack(b"123")


def test_the_cache_publishes_the_hashes_the_gateway_computes_through_splits_and_salts():
    events = Recorder()
    cache = RadixCache(PS, events=events)
    a = _ids(32, 2)
    b = a[:12] + _ids(20, 3)  # shares 3 pages, then splits a's node
    c = _ids(16, 4)
    cache.insert(a, list(range(8)))
    cache.insert(b, list(range(100, 108)))
    cache.insert(c, list(range(200, 204)), salt_key("s1"))
    want = (
        set(page_hash.prompt_hashes(a, PS).tolist())
        | set(page_hash.prompt_hashes(b, PS).tolist())
        | set(page_hash.prompt_hashes(c, PS, "s1").tolist())
    )
    assert events.held == want
    assert set(cache.page_hashes().tolist()) == want
    cache.evict(cache.num_pages)
    assert events.held == set() and len(cache.page_hashes()) == 0
    cache.insert(a, list(range(8)))
    cache.reset()
    assert events.num_cleared == 1 and events.held == set()


def _apply(
    index, node, seq, stored=(), removed=(), snapshot=False, instance="i1", cap=1000, queued=0
):
    return index.apply(
        node,
        instance,
        seq,
        stored=np.array(stored, dtype=np.uint64),
        removed=np.array(removed, dtype=np.uint64),
        is_snapshot=snapshot,
        queued_tokens=queued,
        max_pages=cap,
    )


def test_overlap_counts_leading_pages_per_node():
    index = KVIndex()
    h = page_hash.prompt_hashes(_ids(40, 5), PS).tolist()
    _apply(index, "p0", 1, snapshot=True, stored=h[:6])
    _apply(index, "p1", 1, snapshot=True, stored=h[:2])
    _apply(index, "p2", 1, snapshot=True, stored=[12345])
    _apply(index, "p3", 1, snapshot=True, stored=h)  # the whole prompt
    assert index.overlaps(h, ["p0", "p1", "p2", "p3", "p9"]) == {"p0": 6, "p1": 2, "p3": 10}
    assert index.overlaps(h, ["p1"]) == {"p1": 2}
    assert index.overlaps(h[:1], ["p0", "p1"]) == {"p0": 1, "p1": 1}
    assert index.overlaps([], ["p0"]) == {}


def test_bisection_finds_every_depth_a_radix_cache_can_hold():
    index = KVIndex()
    h = page_hash.prompt_hashes(_ids(16 * PS, 8), PS).tolist()
    for depth in range(len(h) + 1):  # every prefix of the prompt, as a node could hold it
        _apply(index, f"n{depth}", 1, snapshot=True, stored=h[:depth] + [10**9 + depth])
    got = index.overlaps(h, [f"n{d}" for d in range(len(h) + 1)])
    assert got == {f"n{d}": d for d in range(1, len(h) + 1)}


def test_batches_in_order_gaps_snapshots_restarts_and_loss():
    index = KVIndex()
    h = page_hash.prompt_hashes(_ids(40, 6), PS).tolist()
    node = _apply(index, "p0", 5, stored=h[:3])  # joined mid-stream
    assert node.needs_snapshot
    node = _apply(index, "p0", 6, snapshot=True, stored=h[:4])
    assert not node.needs_snapshot and index.overlaps(h, ["p0"]) == {"p0": 4}
    _apply(index, "p0", 7, removed=h[3:4])  # the leaf page evicted
    assert index.overlaps(h, ["p0"]) == {"p0": 3}
    assert _apply(index, "p0", 7, stored=h[3:]).seq == 7  # a repeat changes nothing
    assert index.overlaps(h, ["p0"]) == {"p0": 3}
    node = _apply(index, "p0", 9, stored=h[3:4])  # batch 8 was lost
    assert node.needs_snapshot and index.num_gaps == 1
    _apply(index, "p0", 10, snapshot=True, stored=h[:2])
    assert index.overlaps(h, ["p0"]) == {"p0": 2} and index.num_pages == 2
    # A restarted process: its old pages are gone with it.
    node = _apply(index, "p0", 1, stored=h[:1], instance="i2")
    assert node.instance_id == "i2" and index.overlaps(h, ["p0"]) == {"p0": 1}
    index.drop_node("p0")
    assert index.overlaps(h, ["p0"]) == {} and index.num_pages == 0 and index.num_entries == 0


def test_a_node_cannot_hold_more_than_its_pool_in_the_index():
    index = KVIndex()
    node = _apply(index, "p0", 1, snapshot=True, stored=list(range(1, 11)), cap=4)
    assert len(node.hashes) == 4 and index.num_over_cap == 6
    node = _apply(index, "p0", 2, stored=[11], cap=4)  # more than its pool: removals missed
    assert len(node.hashes) == 4 and node.needs_snapshot
    # Slots of lost nodes are reused without leaking bits into the next node's pages.
    _apply(index, "p1", 1, snapshot=True, stored=[1, 2])
    index.drop_node("p0")
    _apply(index, "p2", 1, snapshot=True, stored=[7])
    assert index.overlaps([1, 2], ["p1", "p2"]) == {"p1": 2}
    assert index.overlaps([7], ["p1", "p2"]) == {"p2": 1}
    assert index.memory_bytes() > 0
