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
from common.radix_cache import RadixCache
from common.token_keys import salt_key

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


def test_overlaps_match_a_per_node_count_whatever_the_depths():
    # Nodes at random depths of one prompt (and of a sibling that shares a prefix), some
    # with pages only expected: each node's answer is its leading run of held pages.
    rng = random.Random(11)
    ids = _ids(30 * PS, 12)
    h = page_hash.prompt_hashes(ids, PS).tolist()
    sibling = page_hash.prompt_hashes(ids[: 9 * PS] + _ids(21 * PS, 13), PS).tolist()
    index, held = KVIndex(), {}
    for i in range(70):
        node, prompt = f"n{i}", rng.choice([h, sibling])
        depth = rng.randrange(len(prompt) + 1)
        _apply(index, node, 1, snapshot=True, stored=prompt[:depth])
        if rng.random() < 0.3:
            index.expect(node, prompt[: rng.randrange(1, len(prompt) + 1)], PS)
        held[node] = set(prompt[:depth]) | index.node(node).expected.keys()

    def leading(node: str) -> int:
        return next((i for i, x in enumerate(h) if x not in held[node]), len(h))

    want = {n: d for n in held if (d := leading(n))}
    assert index.overlaps(h, list(held)) == want
    assert index.overlaps(h, {"n3", "n4"}) == {n: d for n, d in want.items() if n in ("n3", "n4")}


def test_a_routed_prompt_counts_as_held_until_the_node_stores_it():
    index = KVIndex()
    h = page_hash.prompt_hashes(_ids(40, 14), PS).tolist()  # 10 pages
    _apply(index, "p0", 1, snapshot=True, stored=h[:4])
    _apply(index, "p1", 1, snapshot=True)
    index.expect("p1", h, PS)  # a copy is under way on p1
    index.expect("p0", h, PS)  # p0 holds 4 pages: it is expected to add the other 6
    assert index.node("p0").expected.keys() == set(h[4:])
    assert index.overlaps(h, ["p0", "p1"]) == {"p0": 10, "p1": 10}
    index.expect("p9", h, PS)  # a node the index has not heard from: nothing
    assert index.overlaps(h, ["p9"]) == {}
    # p1's prefill ends: its batch stores the pages, which ends the expectation.
    _apply(index, "p1", 2, stored=h)
    assert index.node("p1").expected == {} and index.num_expected == 6
    assert index.overlaps(h, ["p1"]) == {"p1": 10}
    # Evicted afterwards: the index follows the events again.
    _apply(index, "p1", 3, removed=h[5:])
    assert index.overlaps(h, ["p1"]) == {"p1": 5}
    # A lost node takes its expectations with it.
    index.drop_node("p0")
    assert index.num_expected == 0 and index.overlaps(h, ["p0"]) == {}


def test_expectations_share_pages_and_stay_within_the_pool():
    index = KVIndex()
    ids = _ids(40, 15)
    a = page_hash.prompt_hashes(ids, PS).tolist()
    b = page_hash.prompt_hashes(ids[:32] + _ids(8, 16), PS).tolist()  # shares 8 pages
    _apply(index, "p0", 1, snapshot=True, cap=16)
    index.expect("p0", a, PS)
    index.expect("p0", b, PS)
    assert len(index.node("p0").expected) == 12
    _apply(index, "p0", 2, stored=a, cap=16)  # a's prefill ended; b still waits
    assert index.node("p0").expected.keys() == set(b)  # the pages not held when b was sent
    assert index.overlaps(b, ["p0"]) == {"p0": 10}
    # Never confirmed (b failed): newer expectations push it out past the pool's size.
    for seed in range(3):
        index.expect("p0", page_hash.prompt_hashes(_ids(24, 20 + seed), PS).tolist(), PS)
    node = index.node("p0")
    assert len(node.expected) <= 16 and b[-1] not in node.expected
    assert index.overlaps(b, ["p0"]) == {"p0": 8}  # what p0 holds


def test_a_queue_waiting_behind_a_copy_is_counted_as_routed():
    # p1 computes a prompt's 10 pages (the copy); two more requests of it follow it there.
    # Until the copy's pages are stored, p1 counts each follower's whole prompt in its
    # queue; the index takes off what they were routed as holding.
    index = KVIndex()
    h = page_hash.prompt_hashes(_ids(48, 17), PS).tolist()  # 12 pages
    _apply(index, "p1", 1, snapshot=True)
    index.expect("p1", h[:10], PS)  # the copy
    index.expect("p1", h[:11], PS)  # follows it: routed as holding 10 pages
    index.expect("p1", h, PS)  # follows both: routed as holding 11
    assert index.overlaps(h, ["p1"]) == {"p1": 12}
    _apply(index, "p1", 2, queued=40 + 44 + 48)  # the node counts every page as uncached
    assert index.node("p1").queued_tokens == 40 + 4 + 4
    # The copy's pages are stored: the second follower still waits for the first's page.
    _apply(index, "p1", 3, stored=h[:10], queued=4 + 8)
    assert index.node("p1").queued_tokens == 4 + 4
    # Both followers' pages are stored: nothing is lent, the report stands as it is.
    _apply(index, "p1", 4, stored=h[10:], queued=50)
    assert index.node("p1").queued_tokens == 50 and index.num_expected == 0


def test_loads_are_each_report_plus_what_was_sent_since_and_go_with_the_node():
    index = KVIndex()
    index.sent("p0", 30)  # before the node was heard from: counted all the same
    assert dict(index.loads) == {"p0": 30}
    _apply(index, "p0", 1, snapshot=True, queued=100)  # the report has those 30 and more
    _apply(index, "p1", 1, snapshot=True, queued=7)
    index.sent("p0", 16)
    index.sent("p0", 4)
    assert dict(index.loads) == {"p0": 120, "p1": 7}
    _apply(index, "p0", 2, queued=5)  # a report replaces what was sent before it
    index.report_load("p1", 0)
    assert dict(index.loads) == {"p0": 5, "p1": 0}
    index.drop_node("p0")
    assert dict(index.loads) == {"p1": 0}
