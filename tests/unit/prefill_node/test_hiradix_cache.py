"""HiRadixCache: the host tier under the radix cache. Write policies, eviction to the host
and from it, load-back, revival by an insert, and the incremental matcher over both tiers.

Pages hold a stand-in for KV: the packed tokens of the whole prefix up to the page's end
(what a page's KV depends on), so a test can check every page of either tier holds the KV
of the tokens its node says."""

from __future__ import annotations

import random

import pytest

from common.kv_pool import PageAllocator
from common.radix_node import TreeNode
from common.token_keys import TOKEN_BYTES, token_key
from prefill_node.hiradix_cache import WRITE_POLICIES, HiRadixCache, WritePolicy
from prefill_node.prefix_matcher import PrefixMatcher
from prefill_node.request import Req

PAGE = 2


class FakeHost:
    """Host pages as a dict of contents; copies to and from ``device`` (the device pages)."""

    def __init__(self, num_pages: int, device: dict[int, bytes]) -> None:
        self.allocator = PageAllocator(num_pages)
        self.device = device
        self.pages: dict[int, bytes] = {}
        self.num_loaded = 0

    def backup(self, device_pages: list[int], host_pages: list[int]) -> None:
        for d, h in zip(device_pages, host_pages, strict=True):
            self.pages[h] = self.device[d]

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        for h, d in zip(host_pages, device_pages, strict=True):
            self.device[d] = self.pages[h]
        self.num_loaded += len(host_pages)


class Tiers:
    def __init__(self, policy: str, device_pages: int = 64, host_pages: int = 64) -> None:
        self.alloc = PageAllocator(device_pages)
        self.device: dict[int, bytes] = {}
        self.host = FakeHost(host_pages, self.device)
        self.tree = HiRadixCache(PAGE, self.alloc, self.host, policy)

    def cache(self, tokens: list[int]) -> None:
        """What a prefill does: reuse the device match, compute (write) the rest, insert,
        free the duplicates and the trailing partial page."""
        match = self.tree.match_prefix(tokens)
        own = len(match.page_ids)
        pages = match.page_ids + self.alloc.allocate(-(-len(tokens) // PAGE) - own)
        key = token_key(tokens)
        for i in range(own, len(pages)):
            self.device[pages[i]] = key[: (i + 1) * PAGE * TOKEN_BYTES]
        present = self.tree.insert(tokens, pages) // PAGE
        self.alloc.free(pages[own:present] + pages[len(tokens) // PAGE :])

    def load(self, tokens: list[int], num_pages: int | None = None) -> int:
        match = self.tree.match_prefix(tokens)
        want = len(match.host_pages) if num_pages is None else num_pages
        pages = self.alloc.allocate(min(want, self.alloc.num_free_pages))
        new, unused = self.tree.load_back(tokens, None, pages)
        self.alloc.free(unused)
        return new.num_tokens

    def check(self) -> None:
        """Every invariant, and every page on either tier holds its node's tokens."""
        self.tree.check_integrity()
        assert self.alloc.num_used_pages == self.tree.num_pages
        stack: list[tuple[TreeNode, bytes]] = [(self.tree.root, b"")]
        pb = PAGE * TOKEN_BYTES
        while stack:
            node, above = stack.pop()
            path = above + node.key
            for i, p in enumerate(node.value):
                assert self.device[p] == path[: len(above) + (i + 1) * pb]
            for i, p in enumerate(node.host_value or ()):
                assert self.host.pages[p] == path[: len(above) + (i + 1) * pb]
            stack.extend((c, path) for c in node.children.values())


A = [1, 2, 3, 4, 5, 6, 7, 8]


def test_write_through_keeps_evicted_pages_on_the_host_and_loads_them_back():
    t = Tiers("write_through")
    t.cache(A)
    assert t.tree.num_host_pages == 4  # copied as soon as cached
    assert t.tree.evict(100) == 4 and t.alloc.num_used_pages == 0
    match = t.tree.match_prefix(A)
    assert (match.num_tokens, match.host_tokens, match.total_tokens) == (0, 8, 8)
    assert match.last_node is t.tree.root and match.first_host is match.host_node
    t.check()
    assert t.load(A) == 8 and t.host.num_loaded == 4
    match = t.tree.match_prefix(A)
    assert (match.num_tokens, match.host_tokens) == (8, 0)
    t.check()  # the loaded pages hold A's KV
    assert t.tree.num_host_pages == 4  # the copy stays: evicting again costs no copy


def test_write_back_copies_only_when_the_device_evicts():
    t = Tiers("write_back")
    t.cache(A)
    assert t.tree.num_host_pages == 0
    t.tree.evict(100)
    assert t.tree.num_host_pages == 4 and t.tree.match_prefix(A).host_tokens == 8
    t.check()


def test_write_through_selective_copies_a_node_once_two_requests_started_from_it():
    t = Tiers("write_through_selective")
    t.cache(A)
    t.cache(A)  # computing it again is no hit
    t.tree.record_hit(t.tree.match_prefix(A).last_node)
    assert t.tree.num_host_pages == 0  # one hit
    t.tree.record_hit(t.tree.match_prefix(A).last_node)
    assert t.tree.num_host_pages == 4
    t.tree.evict(100)
    assert t.tree.match_prefix(A).host_tokens == 8
    t.check()


def test_the_host_tier_evicts_its_least_recently_used_leaves():
    t = Tiers("write_back", host_pages=4)
    x, y, z = [1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3]
    for tokens in (x, y, z):
        t.cache(tokens)
    t.tree.evict(100)  # x and y copied; z's copy makes room by dropping x, the oldest
    assert t.tree.num_host_evicted_pages == 2
    assert [t.tree.match_prefix(s).host_tokens for s in (x, y, z)] == [0, 4, 4]
    t.check()


def test_a_node_without_a_host_copy_leaves_with_the_host_only_nodes_below_it():
    t = Tiers("write_through", host_pages=2)
    t.cache([1, 1, 2, 2, 3, 3, 4, 4])  # one 4-page node: too large for the host tier
    t.cache([1, 1, 2, 2, 5, 5, 6, 6])  # splits it; the new 2-page leaf gets the copy
    assert t.tree.num_host_pages == 2
    t.tree.evict(2)  # the old branch: no copy, gone
    t.tree.evict(2)  # the new one: host-only
    assert t.tree.match_prefix([1, 1, 2, 2, 5, 5, 6, 6]).host_tokens == 4
    t.check()
    t.tree.evict(2)  # the shared part: no copy, so its host-only child goes with it
    assert t.tree.num_host_pages == 0 and not t.tree.root.children
    assert t.host.allocator.num_free_pages == 2
    t.check()


def test_a_prefill_that_computed_a_host_only_prefix_again_gives_it_device_pages():
    t = Tiers("write_through")
    t.cache(A)
    t.tree.evict(100)
    before = t.alloc.num_used_pages
    t.cache(A + [9, 9])  # computed from scratch: its pages become the tree's
    match = t.tree.match_prefix(A + [9, 9])
    assert (match.num_tokens, match.host_tokens) == (10, 0)
    assert t.alloc.num_used_pages == before + 5 and t.tree.num_pages == 5
    t.check()


def test_a_partial_load_splits_the_host_node():
    t = Tiers("write_through")
    t.cache(A)
    t.tree.evict(100)
    assert t.load(A, num_pages=1) == 2
    match = t.tree.match_prefix(A)
    assert (match.num_tokens, match.host_tokens) == (2, 6)
    t.check()


def test_load_back_returns_the_pages_the_host_part_no_longer_needs():
    t = Tiers("write_through")
    t.cache([1, 1, 2, 2])
    t.tree.evict(100)
    pages = t.alloc.allocate(5)
    match, unused = t.tree.load_back([1, 1, 2, 2, 3, 3], None, pages)
    assert match.num_tokens == 4 and unused == pages[2:]
    t.alloc.free(unused)
    t.check()


def test_write_policies_are_the_config_choices():
    from common.config import HICACHE_WRITE_POLICIES

    assert WRITE_POLICIES == HICACHE_WRITE_POLICIES
    with pytest.raises(ValueError):
        WritePolicy("write_around")


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_random_operations_keep_both_tiers_and_every_tracked_match_exact(policy: str):
    """Inserts, device and host evictions, load-backs and locks in random order on small
    tiers: after each, every invariant holds, every page holds its tokens' KV, and the
    incremental matcher's match of each waiting request equals a fresh one."""
    rng = random.Random(policy)
    t = Tiers(policy, device_pages=24, host_pages=16)
    seqs = [[rng.randrange(3) for _ in range(rng.randrange(2, 14))] for _ in range(40)]
    queue = [Req(str(i), i, s, 8) for i, s in enumerate(seqs[:12])]
    matcher = PrefixMatcher(t.tree)
    locked: list[TreeNode] = []
    for _ in range(700):
        op = rng.random()
        seq = rng.choice(seqs)
        if op < 0.35:
            need = -(-len(seq) // PAGE)
            if t.alloc.num_free_pages < need:
                t.tree.evict(need - t.alloc.num_free_pages)
            if t.alloc.num_free_pages >= need:
                t.cache(seq)
        elif op < 0.5:
            t.tree.evict(rng.randrange(1, 5))
        elif op < 0.6:
            t.tree.evict_host(rng.randrange(1, 4))
        elif op < 0.75:
            t.load(seq)
        elif op < 0.87:
            m = t.tree.match_prefix(seq)
            t.tree.inc_lock_ref(m.last_node)
            t.tree.record_hit(m.last_node)
            locked.append(m.last_node)
        elif locked:
            t.tree.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        t.check()
        matcher.refresh(queue)
        for r in queue:
            fresh = t.tree.match_prefix(r.key)
            assert r.match is not None
            assert r.match[:3] == fresh[:3] and r.match[7:] == fresh[7:], r.rid
    for node in locked:
        t.tree.dec_lock_ref(node)
    t.tree.evict(10**6)
    t.tree.evict_host(10**6)
    assert t.tree.num_pages == 0 and t.alloc.num_used_pages == 0
    assert t.tree.num_host_pages == 0 and t.host.allocator.num_used_pages == 0
