"""Radix cache: page-granular match/insert/split, LRU eviction, locks, touch, versions, and
incremental matching of waiting requests (PrefixMatcher)."""

from __future__ import annotations

import random

import pytest

from common.kv_pool import PageAllocator
from common.radix_cache import RadixCache, StaleMatchError
from prefill_node.dfs_weight import dfs_weight_order
from prefill_node.prefix_matcher import PrefixMatcher
from prefill_node.request import Req

PAGE = 2


def make_tree(num_pages: int = 64) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return RadixCache(PAGE, alloc), alloc


def cache(tree: RadixCache, alloc: PageAllocator, tokens: list[int]) -> list[int]:
    """Insert tokens as a finished request would: reuse the match, allocate the rest,
    free duplicates and the trailing partial page. Returns the sequence's cached pages."""
    match = tree.match_prefix(tokens)
    own = len(match.page_ids)
    pages = match.page_ids + alloc.allocate(-(-len(tokens) // PAGE) - own)
    present = tree.insert(tokens, pages) // PAGE
    alloc.free(pages[own:present] + pages[len(tokens) // PAGE :])
    return pages[: len(tokens) // PAGE]


def test_empty_tree_matches_nothing_and_names_the_next_page():
    tree, _ = make_tree()
    m = tree.match_prefix([1, 2, 3])
    assert (m.page_ids, m.num_tokens, m.last_node) == ([], 0, tree.root)
    assert m.extend_key is not None and not m.is_partial
    assert tree.match_prefix([1]).extend_key is None  # less than a page: nothing to extend


def test_insert_then_match_whole_pages_only():
    tree, alloc = make_tree()
    pages = cache(tree, alloc, [1, 2, 3, 4, 5])  # 2 whole pages, the 5th token is not cached
    assert len(pages) == 2 and tree.num_pages == 2 and alloc.num_used_pages == 2
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).page_ids == pages
    assert tree.match_prefix([1, 2, 3, 9]).num_tokens == 2  # diverges inside page 2
    assert tree.match_prefix([1, 2, 3]).num_tokens == 2
    assert tree.match_prefix([9, 2]).num_tokens == 0
    tree.check_integrity()


def test_insert_reports_cached_tokens_and_caller_frees_its_duplicates():
    tree, alloc = make_tree()
    first = alloc.allocate(3)
    assert tree.insert([1, 2, 3, 4, 5, 6], first) == 0  # tree owns all 3 pages now
    dup = alloc.allocate(4)
    assert tree.insert([1, 2, 3, 4, 7, 8, 9, 10], dup) == 4  # 2 pages were cached already
    alloc.free(dup[:2])  # the duplicates of the cached part
    assert tree.num_pages == 5 and alloc.num_used_pages == 5
    assert tree.match_prefix([1, 2, 3, 4, 7, 8, 9, 10]).page_ids == first[:2] + dup[2:]
    with pytest.raises(ValueError):
        tree.insert([1, 2, 3, 4], [0])  # fewer page ids than whole pages
    tree.check_integrity()
    alloc.check_integrity()


def test_split_keeps_pages_and_both_branches_match():
    tree, alloc = make_tree()
    a = cache(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])
    b = cache(tree, alloc, [1, 2, 3, 4, 9, 9])
    assert b[:2] == a[:2]
    assert len(tree.root.children) == 1
    upper = next(iter(tree.root.children.values()))
    assert upper.value == a[:2] and len(upper.children) == 2
    assert tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).page_ids == a
    assert tree.match_prefix([1, 2, 3, 4, 9, 9]).page_ids == b
    # Inserting a prefix that ends inside a node adds nothing and splits nothing.
    version = tree.version
    assert cache(tree, alloc, [1, 2, 3, 4, 5, 6]) == a[:3]
    assert tree.version == version
    tree.check_integrity()


def test_evict_frees_least_recently_used_leaves_first():
    tree, alloc = make_tree()
    a = cache(tree, alloc, [1, 1, 1, 1])
    b = cache(tree, alloc, [2, 2, 2, 2])
    c = cache(tree, alloc, [3, 3, 3, 3])
    free_before = alloc.num_free_pages
    assert tree.evict(1) == 2  # whole node: both pages of a, the oldest
    assert alloc.num_free_pages == free_before + 2
    assert tree.match_prefix([1, 1, 1, 1]).num_tokens == 0
    assert tree.match_prefix([2, 2, 2, 2]).page_ids == b
    assert tree.evict(3) == 4  # b then c
    assert tree.num_pages == 0 and alloc.num_used_pages == 0
    assert sorted(alloc.allocate(6)) == sorted(a + b + c)  # all back in the free list
    tree.check_integrity()


def test_touch_changes_eviction_order():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 1])
    cache(tree, alloc, [2, 2])
    tree.touch([1, 1])  # by tokens
    tree.evict(1)
    assert tree.match_prefix([1, 1]).num_tokens == 2
    assert tree.match_prefix([2, 2]).num_tokens == 0
    cache(tree, alloc, [3, 3])
    tree.touch(tree.match_prefix([1, 1]).last_node)  # by node
    tree.evict(1)
    assert tree.match_prefix([3, 3]).num_tokens == 0


def test_touch_paths_makes_the_first_path_the_most_recent():
    tree, alloc = make_tree()
    seqs = [[i, i, 7, 7] for i in range(4)]
    for s in seqs:
        cache(tree, alloc, s)
    nodes = [tree.match_prefix(s).last_node for s in seqs]
    tree.touch_paths(nodes)  # head first: seqs[3] becomes the least recent
    evicted = []
    for _ in range(4):
        tree.evict(1)
        evicted.append(
            next(
                i
                for i, s in enumerate(seqs)
                if i not in evicted and tree.match_prefix(s).num_tokens == 0
            )
        )
    assert evicted == [3, 2, 1, 0]


def test_eviction_cascades_to_a_parent_that_becomes_a_leaf():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 2, 3, 4])
    cache(tree, alloc, [1, 2, 5, 6])
    assert tree.num_pages == 3
    assert tree.evict(3) == 3
    assert tree.num_pages == 0 and not tree.root.children
    tree.check_integrity()


def test_locks_protect_the_path_to_the_root():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 2, 3, 4])
    cache(tree, alloc, [1, 2, 5, 6])
    cache(tree, alloc, [8, 8])
    node = tree.match_prefix([1, 2, 3, 4]).last_node
    tree.inc_lock_ref(node)
    assert tree.num_protected_pages == 2 and tree.protected_size() == 4
    assert tree.num_evictable_pages == 2 and tree.evictable_size() == 4
    assert tree.evict(100) == 2  # only [5, 6] and [8, 8]
    assert tree.match_prefix([1, 2, 3, 4]).num_tokens == 4
    tree.check_integrity()
    tree.inc_lock_ref(node)
    tree.dec_lock_ref(node)
    tree.dec_lock_ref(node)
    assert tree.num_protected_pages == 0 and tree.num_evictable_pages == 2
    with pytest.raises(ValueError):
        tree.dec_lock_ref(node)
    assert tree.evict(100) == 2
    with pytest.raises(StaleMatchError):
        tree.inc_lock_ref(node)  # a stale match's node
    tree.check_integrity()


def test_split_of_a_locked_node_keeps_both_halves_locked():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 2, 3, 4, 5, 6])
    node = tree.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    tree.inc_lock_ref(node)
    cache(tree, alloc, [1, 2, 3, 4, 9, 9])  # splits the locked node
    assert tree.num_protected_pages == 3 and tree.num_evictable_pages == 1
    tree.check_integrity()
    tree.dec_lock_ref(node)
    assert tree.num_protected_pages == 0
    tree.check_integrity()


def test_cut_gives_the_node_ending_at_a_depth_splitting_the_one_spanning_it():
    from common.token_keys import salt_key

    tree, alloc = make_tree(16)
    cache(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8])  # one node of 4 pages
    cache(tree, alloc, [1, 2, 3, 4, 5, 6, 7, 8, 9, 9])  # and a child of 1
    deep = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 9]).last_node
    whole = tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).last_node
    assert tree.cut(deep, 5) is deep and tree.cut(deep, 4) is whole  # ends there: no split
    upper = tree.cut(deep, 1)  # inside the 4-page node: split after its first page
    assert upper.parent is tree.root and len(upper.value) == 1 and upper.children
    assert tree.match_prefix([1, 2, 9]).last_node is upper
    tree.inc_lock_ref(upper)  # a lock on the 1 page only: the 4 below stay evictable
    assert tree.num_protected_pages == 1 and tree.num_evictable_pages == 4
    assert tree.evict(4) == 4
    tree.dec_lock_ref(upper)
    tree.check_integrity()
    assert tree.cut(upper, 0) is tree.root
    salted = salt_key("s")
    tree.insert([5, 5, 6, 6], alloc.allocate(2), salted)
    node = tree.match_prefix([5, 5, 6, 6], salted).last_node
    salt_root = node.parent
    assert tree.cut(node, 0) is salt_root  # never above a salt's root
    assert len(tree.cut(node, 1).value) == 1
    tree.check_integrity()


def test_check_integrity_catches_broken_invariants():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 2, 3, 4])
    tree.check_integrity()
    node = tree.match_prefix([1, 2]).last_node
    node.lock_ref = -1
    with pytest.raises(AssertionError):
        tree.check_integrity()
    node.lock_ref = 0
    node.value.append(node.value[0])  # a page held twice, key and pages disagree
    with pytest.raises(AssertionError):
        tree.check_integrity()


def test_reset_frees_everything_and_refuses_while_locked():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 2, 3, 4])
    m = tree.match_prefix([1, 2, 3, 4])
    tree.inc_lock_ref(m.last_node)
    with pytest.raises(RuntimeError):
        tree.reset()
    tree.dec_lock_ref(m.last_node)
    tree.reset()
    assert tree.num_pages == 0 and alloc.num_used_pages == 0
    assert not tree.is_match_current(m) and tree.events_since(m.version) is None
    tree.check_integrity()


def test_is_match_current_follows_only_changes_that_concern_the_match():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 2, 3, 4])
    m = tree.match_prefix([1, 2, 3, 4, 5, 6])  # full match of the node, next page [5, 6]
    cache(tree, alloc, [7, 7, 7, 7, 7, 7])  # elsewhere
    assert tree.version > m.version and tree.is_match_current(m)
    cache(tree, alloc, [1, 2, 3, 4, 5, 6])  # extends it
    assert not tree.is_match_current(m)
    partial = tree.match_prefix([7, 7, 8, 8])  # ends inside [7, 7, 7, 7, 7, 7] at 2
    deep = tree.match_prefix([7, 7, 7, 7, 8, 8])  # ... at 4
    assert partial.is_partial and tree.is_match_current(partial)
    cache(tree, alloc, [7, 7, 9, 9])  # splits that node after 2 tokens
    assert not tree.is_match_current(partial)  # now ends at the end of the new upper node
    assert tree.is_match_current(deep)  # still inside the lower part: same pages and node
    assert tree.match_prefix([7, 7, 7, 7, 8, 8])[:3] == deep[:3]
    full = tree.match_prefix([1, 2, 3, 4, 5, 6])
    tree.evict(100)
    assert not tree.is_match_current(full)


def test_dfs_weight_order_visits_heavier_subtrees_first():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 1, 2, 2])  # branch A: A, A/x
    cache(tree, alloc, [1, 1, 3, 3])  # A/y
    cache(tree, alloc, [5, 5])  # branch B
    a_x = tree.match_prefix([1, 1, 2, 2]).last_node
    a_y = tree.match_prefix([1, 1, 3, 3]).last_node
    a = a_x.parent
    b = tree.match_prefix([5, 5]).last_node
    root = tree.root
    nodes = [b, a_y, root, a_x, a_y, b, a, b]
    # A's subtree holds 4 requests, B 3: A first; inside A, y (2) before x (1), then A's own.
    assert dfs_weight_order(tree.root, nodes) == [1, 4, 3, 6, 0, 5, 7, 2]


def test_page_size_one_is_a_token_radix_tree():
    alloc = PageAllocator(32)
    tree = RadixCache(1, alloc)
    pages = alloc.allocate(3)
    tree.insert([4, 5, 6], pages)
    assert tree.match_prefix([4, 5, 7]).page_ids == pages[:2]
    tree.check_integrity()


def test_random_operations_keep_every_invariant():
    rng = random.Random(7)
    tree, alloc = make_tree(4096)
    locked = []
    for _ in range(600):
        op = rng.random()
        if op < 0.5:
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 16))]
            cache(tree, alloc, tokens)
        elif op < 0.65:
            tree.evict(rng.randrange(1, 6))
        elif op < 0.8:
            m = tree.match_prefix([rng.randrange(3) for _ in range(10)])
            tree.inc_lock_ref(m.last_node)
            locked.append(m.last_node)
        elif locked:
            tree.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        tree.check_integrity()
        assert alloc.num_used_pages == tree.num_pages
    for node in locked:
        tree.dec_lock_ref(node)
    tree.evict(10**6)
    assert tree.num_pages == 0 and alloc.num_used_pages == 0


# --- incremental matching -------------------------------------------------------------------
def test_matches_are_recomputed_only_when_the_tree_changes_under_them():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 1, 2, 2])
    a, b = Req("a", 0, [1, 1, 2, 2, 3, 3, 4], 8), Req("b", 0, [7, 7, 8, 8], 8)
    queue = [a, b]
    matcher = PrefixMatcher(tree)
    first = matcher.refresh(queue)
    assert (len(first.arrivals), first.num_rematched) == (2, 0)
    memo = a.match
    assert matcher.match_req(a) is memo  # memoized: the same object
    cache(tree, alloc, [9, 9, 9, 9])  # elsewhere: nobody's match can change
    cache(tree, alloc, [1, 1, 5, 5])  # splits a's node above its end; a sibling of its next page
    num_matches = matcher.num_matches
    assert matcher.refresh(queue).num_rematched == 0 and matcher.num_matches == num_matches
    assert a.match is memo and a.match_version < tree.version
    assert (a.prefix_len, b.prefix_len) == (4, 0)
    cache(tree, alloc, [1, 1, 2, 2, 3, 3])  # extends a's match
    assert matcher.refresh(queue).num_rematched == 1 and matcher.num_matches == num_matches + 1
    assert a.prefix_len == 6 and a.match is not memo
    # Evicting part of a's match: the match drops the freed page, never keeps it.
    stale = a.match
    tree.touch([9, 9, 9, 9])
    tree.touch([1, 1, 5, 5])
    assert tree.evict(1) == 1  # the LRU leaf: [3, 3], a's last node
    fresh = matcher.match_req(a)  # what the adder calls before locking
    assert fresh is not stale and fresh.num_tokens == 4
    assert not set(stale.page_ids) <= set(fresh.page_ids)
    with pytest.raises(StaleMatchError):
        tree.inc_lock_ref(stale.last_node)
    tree.inc_lock_ref(fresh.last_node)
    assert matcher.refresh(queue).num_rematched == 0  # already refreshed by match_req
    # The same seen by refresh itself: evict the rest of a's match.
    tree.dec_lock_ref(fresh.last_node)
    tree.evict(100)
    assert matcher.refresh(queue).num_rematched == 1
    assert a.prefix_len == 0 and a.last_node is tree.root
    assert matcher.refresh(queue).num_rematched == 0


def test_matcher_tracks_arrivals_and_departures():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 1])
    reqs = [Req(str(i), 0, [1, 1, i, i], 8) for i in range(6)]
    matcher = PrefixMatcher(tree)
    queue = reqs[:4]
    matcher.refresh(queue)
    matcher.remember_order(queue)
    queue = reqs[2:6]  # the head admitted, two arrivals appended: the fast path
    result = matcher.refresh(queue)
    assert result.is_order_kept and result.departed == reqs[:2] and result.arrivals == reqs[4:]
    matcher.remember_order(queue)
    queue = [reqs[3], reqs[2], reqs[5]]  # reordered, one aborted: the general path
    result = matcher.refresh(queue)
    assert not result.is_order_kept and result.departed == [reqs[4]] and result.arrivals == []
    assert matcher.num_tracked == 3
    tree.reset()
    assert matcher.refresh(queue).num_rematched == 3  # a reset invalidates every match
    assert all(r.prefix_len == 0 for r in queue)


# --- cache salts: one namespace per salt -----------------------------------------------------


def test_a_salt_shares_pages_only_with_its_own_salt():
    from common.token_keys import salt_key

    alloc = PageAllocator(64)
    tree = RadixCache(2, alloc)
    a, b = salt_key("tenant-a"), salt_key("tenant-b")
    tokens = [1, 2, 3, 4, 5, 6]
    tree.insert(tokens, alloc.allocate(3), a)
    assert tree.match_prefix(tokens, a).num_tokens == 6
    assert tree.match_prefix(tokens).num_tokens == 0  # unsalted: nothing cached
    miss = tree.match_prefix(tokens, b)
    assert miss.num_tokens == 0 and miss.last_node is tree.root and miss.extend_key == b
    # The same tokens unsalted are cached apart, with pages of their own.
    assert tree.insert(tokens, alloc.allocate(3)) == 0
    assert set(tree.match_prefix(tokens).page_ids).isdisjoint(tree.match_prefix(tokens, a).page_ids)
    tree.check_integrity()
    # A salt's subtree goes with its last page; its namespace node with it.
    assert tree.evict(6) == 6 and tree.num_pages == 0
    assert tree.match_prefix(tokens, a).last_node is tree.root
    tree.check_integrity()
    assert alloc.num_free_pages == 64


def test_a_locked_salted_match_survives_eviction_of_the_rest():
    from common.token_keys import salt_key

    alloc = PageAllocator(64)
    tree = RadixCache(2, alloc)
    a = salt_key("a")
    tree.insert([1, 2, 3, 4], alloc.allocate(2), a)
    tree.insert([1, 2, 9, 9], alloc.allocate(2))
    m = tree.match_prefix([1, 2, 3, 4], a)
    tree.inc_lock_ref(m.last_node)
    assert tree.evict(100) == 2  # only the unsalted pages were evictable
    assert tree.match_prefix([1, 2, 3, 4], a).page_ids == m.page_ids
    tree.dec_lock_ref(m.last_node)
    tree.check_integrity()
