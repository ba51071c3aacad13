"""Schedule policy: every order, SGLang's scenarios, dedup, touch, fallback, metrics, and the
incremental policy against naive rematching + SGLang's temporary tree on random workloads."""

from __future__ import annotations

import random
from collections import Counter
from os.path import commonprefix

import pytest

from common import metrics
from common.config import PrefillConfig
from common.kv_pool import PageAllocator
from common.request import Req, token_key
from prefill_node.cache_aware_orders import HrrnOrder
from prefill_node.radix_cache import RadixCache
from prefill_node.schedule_policy import (
    CacheAgnosticPolicy,
    CacheAwarePolicy,
    SchedulePolicy,
    prefill_work,
)

PAGE = 2
INF = float("inf")
CACHE_AWARE = ["lpm", "dfs-weight", "hrrn", "shortest-prefill-first"]


def req(rid: str, tokens: list[int] | None = None, **kw) -> Req:
    tokens = tokens if tokens is not None else [10 + len(rid)]
    kw.setdefault("max_new_tokens", 16)
    return Req(rid, 0, tokens, **kw)


def rids(queue: list[Req]) -> list[str]:
    return [r.rid for r in queue]


def make_tree(num_pages: int = 4096) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages)
    return RadixCache(PAGE, alloc), alloc


def cache(tree: RadixCache, alloc: PageAllocator, tokens: list[int]) -> None:
    """Insert tokens the way a finished prefill does (see RadixCache.insert)."""
    own = len(tree.match_prefix(tokens).page_ids)
    pages = tree.match_prefix(tokens).page_ids + alloc.allocate(-(-len(tokens) // PAGE) - own)
    present = tree.insert(tokens, pages) // PAGE
    alloc.free(pages[own:present] + pages[len(tokens) // PAGE :])


# --- validation (SGLang: test_init_with_*) --------------------------------------------------
def test_policy_validation():
    tree, _ = make_tree()
    assert SchedulePolicy("lpm", tree).policy is CacheAwarePolicy.LPM
    assert SchedulePolicy("fcfs", tree).policy is CacheAgnosticPolicy.FCFS
    with pytest.raises(ValueError, match="Unknown schedule_policy"):
        SchedulePolicy("invalid", tree)
    for name in ("lpm", "dfs-weight", "hrrn"):  # radix cache disabled: fcfs
        assert SchedulePolicy(name, None).policy is CacheAgnosticPolicy.FCFS
    with pytest.raises(ValueError, match="radix cache"):
        SchedulePolicy("shortest-prefill-first", None)
    config = PrefillConfig(schedule_policy="lpm", disable_radix_cache=True)
    assert SchedulePolicy.from_config(config, tree).policy is CacheAgnosticPolicy.FCFS
    assert SchedulePolicy.from_config(PrefillConfig(), tree).policy is CacheAgnosticPolicy.FCFS


# --- cache-agnostic policies (SGLang's scenarios) -------------------------------------------
def sort_with_priority(name: str, queue: list[Req], low_first: bool) -> None:
    SchedulePolicy(
        name, None, enable_priority_scheduling=True, schedule_low_priority_values_first=low_first
    ).calc_priority(queue)


def test_fcfs_keeps_input_order():
    tree, _ = make_tree()
    queue = [req("1", [1, 2]), req("3", [1, 2, 3]), req("2", [1])]
    result = SchedulePolicy("fcfs", tree).calc_priority(queue)
    assert rids(queue) == ["1", "3", "2"] and result.policy == "fcfs"


@pytest.mark.parametrize("low_first", [False, True])
def test_fcfs_with_priority(low_first: bool):
    top = -1 if low_first else 1
    specs = zip("132", (top, 0, 0), (1.0, 1.0, 0.0), strict=True)
    queue = [req(rid, priority=p, wait_queue_entry_time=t) for rid, p, t in specs]
    sort_with_priority("fcfs", queue, low_first)
    assert rids(queue) == ["1", "2", "3"]


@pytest.mark.parametrize("low_first", [False, True])
def test_requests_without_priority_sort_after_every_explicit_one(low_first: bool):
    queue = [
        req("none-early", wait_queue_entry_time=0.0),
        req("worst", priority=100 if low_first else -100, wait_queue_entry_time=3.0),
        req("best", priority=-5 if low_first else 5, wait_queue_entry_time=2.0),
        req("none-late", wait_queue_entry_time=1.0),
    ]
    sort_with_priority("fcfs", queue, low_first)
    assert rids(queue) == ["best", "worst", "none-early", "none-late"]


def test_priority_is_ignored_when_priority_scheduling_is_off():
    queue = [req("a", priority=0), req("b", priority=9)]
    SchedulePolicy("fcfs", None).calc_priority(queue)
    assert rids(queue) == ["a", "b"]


def test_lof():
    queue = [req(rid, max_new_tokens=m) for rid, m in [("1", 1000), ("3", 10), ("2", 100)]]
    SchedulePolicy("lof", None).calc_priority(queue)
    assert rids(queue) == ["1", "2", "3"]


@pytest.mark.parametrize(("low_first", "priorities"), [(False, (1, 0, 0)), (True, (0, 1, 1))])
def test_lof_with_priority(low_first: bool, priorities: tuple[int, int, int]):
    specs = zip("132", priorities, (1, 10, 100), strict=True)
    queue = [req(rid, priority=p, max_new_tokens=m) for rid, p, m in specs]
    sort_with_priority("lof", queue, low_first)
    assert rids(queue) == ["1", "2", "3"]


def test_random_shuffles_with_a_seed():
    queue = [req(str(i)) for i in range(20)]
    a, b = list(queue), list(queue)
    SchedulePolicy("random", None, random_seed=3).calc_priority(a)
    SchedulePolicy("random", None, random_seed=3).calc_priority(b)
    assert rids(a) == rids(b) != rids(queue) and sorted(rids(a)) == sorted(rids(queue))


@pytest.mark.parametrize(
    ("running", "waiting", "expected"),
    [
        (["a", "a", "b"], ["b", "a", "c"], ["w2", "w1", "w3"]),  # by count
        (["b", "a"], ["b", "a"], ["w2", "w1"]),  # tie: key order
        (["a", "b", "c"], ["d", "e", "c"], ["w3", "w1", "w2"]),  # match first, then by key
        ([], ["b", "a"], ["w1", "w2"]),  # empty running batch: unchanged
    ],
)
def test_routing_key(running: list[str], waiting: list[str], expected: list[str]):
    batch = [req(f"r{i}", routing_key=k) for i, k in enumerate(running)]
    queue = [req(f"w{i + 1}", routing_key=k) for i, k in enumerate(waiting)]
    SchedulePolicy("routing-key", None).calc_priority(queue, batch)
    assert rids(queue) == expected


# --- in-batch prefix dedup ------------------------------------------------------------------
def test_cache_agnostic_in_batch_dedup_defers_sharers():
    tree, _ = make_tree()
    shared = list(range(100, 164))  # 64 tokens
    queue = [req(rid, shared + [int(rid)]) for rid in "124"]
    queue.insert(2, req("3", list(range(500, 570))))
    policy = SchedulePolicy("fcfs", tree, enable_cache_agnostic_in_batch_prefix_caching=True)
    result = policy.calc_priority(queue)
    assert rids(queue) == ["1", "3", "2", "4"]
    assert [r.is_deprioritized for r in queue] == [False, False, True, True]
    assert result.num_deprioritized == 2
    again = [req(r.rid, r.origin_input_ids) for r in sorted(queue, key=lambda r: r.rid)]
    SchedulePolicy("fcfs", tree).calc_priority(again)  # off by default for fcfs
    assert rids(again) == ["1", "2", "3", "4"] and not any(r.is_deprioritized for r in again)


@pytest.mark.parametrize("name", CACHE_AWARE)
def test_cold_shared_prefix_is_computed_once(name: str):
    tree, alloc = make_tree()
    warm = list(range(1000, 1040))
    cache(tree, alloc, warm)
    cold_a, cold_b = list(range(2000, 2040)), list(range(3000, 3040))
    queue = [
        req("a1", cold_a + [1, 1]),
        req("w1", warm + [5, 5]),
        req("a2", cold_a + [2, 2]),
        req("b1", cold_b + [1, 1]),
        req("u1", list(range(4000, 4020))),
        req("a3", cold_a + [3, 3]),
        req("b2", cold_b + [2, 2]),
    ]
    policy = SchedulePolicy(name, tree)
    policy.calc_priority(queue, None, processed_tokens=1000)
    followers = {"a2", "a3", "b2"}
    assert set(rids(queue)[-3:]) == followers  # after everything else
    assert {r.rid for r in queue if r.is_deprioritized} == followers
    # The leader runs; its prefix lands in the cache; the followers now match it.
    leader = queue.index(next(r for r in queue if r.rid == "a1"))
    cache(tree, alloc, queue.pop(leader).origin_input_ids)
    result = policy.calc_priority(queue, None, processed_tokens=2000)
    assert {r.rid for r in queue if r.is_deprioritized} == {"b2"}
    assert result.num_rematches == 2  # a2 and a3: the insert extended exactly their match
    assert next(r for r in queue if r.rid == "a2").prefix_len == 40


def test_dedup_thresholds():
    tree, alloc = make_tree()
    shared = list(range(100, 140))
    cache(tree, alloc, shared[:34])  # a 34-token cached match is above the check threshold
    queue = [req("1", shared + [1]), req("2", shared + [2])]
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert not any(r.is_deprioritized for r in queue)
    short = [req("1", list(range(9, 30)) + [1]), req("2", list(range(9, 30)) + [2])]
    SchedulePolicy("lpm", tree).calc_priority(short)  # shares 21 < 32 tokens
    assert not any(r.is_deprioritized for r in short)
    cold = [req("1", list(range(50, 90))), req("2", list(range(50, 90)))]
    SchedulePolicy("lpm", tree, in_batch_prefix_caching_check_threshold=-1).calc_priority(cold)
    assert not any(r.is_deprioritized for r in cold)  # -1 disables the check
    at_8 = SchedulePolicy("lpm", tree, in_batch_prefix_caching_deprioritize_threshold=8)
    at_8.calc_priority(short)
    assert [r.is_deprioritized for r in short] == [False, True]


# --- cache-aware policies -------------------------------------------------------------------
def lpm_workload() -> tuple[RadixCache, list[Req]]:
    tree, alloc = make_tree()
    cache(tree, alloc, list(range(10)))
    cache(tree, alloc, list(range(10)) + list(range(50, 60)))
    queue = [
        req("none", [99, 98, 97, 96]),
        req("short", list(range(4)) + [7, 7]),
        req("long", list(range(10)) + list(range(50, 58)) + [1]),
        req("mid", list(range(10)) + [1, 1]),
        req("none2", [95, 94]),
    ]
    return tree, queue


def test_lpm_longest_match_first_stable_on_ties():
    tree, queue = lpm_workload()
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert rids(queue) == ["long", "mid", "short", "none", "none2"]
    assert [r.prefix_len for r in queue] == [18, 10, 4, 0, 0]


def test_dfs_weight_groups_requests_by_branch():
    tree, alloc = make_tree()
    cache(tree, alloc, [1, 1, 2, 2])
    cache(tree, alloc, [1, 1, 3, 3])
    cache(tree, alloc, [5, 5])
    queue = [
        req("b1", [5, 5, 0, 0]),
        req("y1", [1, 1, 3, 3, 0]),
        req("root", [8, 8]),
        req("x1", [1, 1, 2, 2, 9]),
        req("y2", [1, 1, 3, 3, 7]),
        req("b2", [5, 5, 1, 1]),
        req("a1", [1, 1, 9, 9]),
        req("b3", [5, 5, 2, 2]),
    ]
    SchedulePolicy("dfs-weight", tree).calc_priority(queue)
    assert rids(queue) == ["y1", "y2", "x1", "a1", "b1", "b2", "b3", "root"]


def test_hrrn_ratio_with_the_last_token_always_computed_and_deprioritized_last():
    tree, alloc = make_tree()
    cache(tree, alloc, list(range(8)))
    cold = list(range(200, 240))
    queue = [
        req("old-long", list(range(100, 140)), arrival_processed_tokens=0),  # 1000/40 = 25
        req("new-short", list(range(300, 304)), arrival_processed_tokens=900),  # 100/4 = 25
        req("cold-1", cold + [1, 1], arrival_processed_tokens=500),  # 500/42 = 11.9
        req("cold-2", cold + [2, 2], arrival_processed_tokens=0),  # deprioritized
        # Fully cached, but SGLang matches the prompt less its last token: the usable
        # prefix is 4 tokens (one page of 4), so 4 are uncached: 10/4 = 2.5. (pdserve used
        # to count 0 uncached and drain it first; SGLang does not.)
        req("cached", list(range(8)), arrival_processed_tokens=990),
        req("mid", list(range(8)) + [1] * 10, arrival_processed_tokens=800),  # 200/10 = 20
    ]
    SchedulePolicy("hrrn", tree).calc_priority(queue, None, processed_tokens=1000)
    # Equal ratios (25) break by rid.
    assert rids(queue) == ["new-short", "old-long", "mid", "cold-1", "cached", "cold-2"]
    SchedulePolicy("hrrn", tree).calc_priority(queue)  # no counter: rid order per class
    assert rids(queue) == ["cached", "cold-1", "mid", "new-short", "old-long", "cold-2"]


def test_hrrn_ages_long_requests():
    tree, _ = make_tree()
    queue = [
        req("long", list(range(100)), arrival_processed_tokens=0),
        req("short", list(range(200, 210)), arrival_processed_tokens=900),
    ]
    policy = SchedulePolicy("hrrn", tree)
    policy.calc_priority(queue, None, processed_tokens=1000)  # 10 vs 10: rid order
    assert rids(queue) == ["long", "short"]
    policy.calc_priority(queue, None, processed_tokens=1100)  # 11 vs 20
    assert rids(queue) == ["short", "long"]
    queue.append(req("tiny", [7, 7], arrival_processed_tokens=1090))
    policy.calc_priority(queue, None, processed_tokens=1200)  # 12, 30, 55
    assert rids(queue) == ["tiny", "short", "long"]


def test_shortest_prefill_first_order():
    tree, alloc = make_tree()
    cache(tree, alloc, list(range(20)))
    cold = list(range(500, 540))
    queue = [
        req("big", list(range(100, 200)), wait_queue_entry_time=0.0),
        req("cold-1", cold + [1], wait_queue_entry_time=1.0),
        req("cold-2", cold + [2], wait_queue_entry_time=2.0),
        req("hit", list(range(20)) + [1, 2, 3], wait_queue_entry_time=3.0),  # 3 uncached
        req("tie-late", [7, 8, 9], wait_queue_entry_time=5.0),
        req("tie-early", [6, 8, 9], wait_queue_entry_time=4.0),
    ]
    SchedulePolicy("shortest-prefill-first", tree).calc_priority(queue)
    assert rids(queue) == ["hit", "tie-early", "tie-late", "cold-1", "big", "cold-2"]
    assert [prefill_work(r) for r in queue[:3]] == [3, 3, 3]


def test_shortest_prefill_chunk_limit():
    tree, _ = make_tree()
    spf = SchedulePolicy("shortest-prefill-first", tree)
    queue = [req("a", [1] * 5), req("b", [2] * 30), req("c", [3] * 100)]
    spf.calc_priority(queue)
    page = 16
    # a: 5 -> 16 reserved; b: 30 -> 32 reserved; c (100) is not shorter than 90 remaining.
    assert spf.shortest_prefill_chunk_limit(90, queue, budget=256, page_size=page) == 208
    # The reservation stops before passing budget - page.
    assert spf.shortest_prefill_chunk_limit(90, queue, budget=48, page_size=page) == 32
    assert spf.shortest_prefill_chunk_limit(4, queue, budget=256, page_size=page) is None
    assert spf.shortest_prefill_chunk_limit(90, queue, budget=31, page_size=page) is None
    assert spf.is_shortest_prefill_first
    lpm = SchedulePolicy("lpm", tree)
    assert lpm.shortest_prefill_chunk_limit(90, queue, 256, page) is None
    assert not lpm.is_shortest_prefill_first


# --- fallback, metrics ------------------------------------------------------------------------
def _sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, {"role": metrics.ROLE, **labels}) or 0.0


def test_no_fallback_by_default_and_fallback_when_asked():
    tree, _ = make_tree()
    queue = [req(str(i), [i, i, i]) for i in range(300)]
    assert SchedulePolicy("lpm", tree).calc_priority(queue).policy == "lpm"
    fallbacks = _sample("pdserve_policy_fallbacks_total")
    sorts = _sample("pdserve_calc_priority_seconds_count", policy="fcfs")
    policy = SchedulePolicy("hrrn", tree, cache_aware_fallback_threshold=128)
    result = policy.calc_priority(queue, None, 10)
    assert (result.policy, result.is_fallback) == ("fcfs", True)
    assert _sample("pdserve_policy_fallbacks_total") == fallbacks + 1
    assert _sample("pdserve_calc_priority_seconds_count", policy="fcfs") == sorts + 1
    result = policy.calc_priority(queue[:100], None, 10)
    assert (result.policy, result.is_fallback) == ("hrrn", False)
    dfs = SchedulePolicy("dfs-weight", tree, cache_aware_fallback_threshold=128)
    assert dfs.calc_priority(queue).policy == "dfs-weight"  # as SGLang: lpm and hrrn only


# --- waiting-prefix touch ---------------------------------------------------------------------
def test_waiting_prefix_touch_every_32_rounds_spares_the_head():
    tree, alloc = make_tree()
    prefixes = [[i] * 4 for i in range(1, 5)]
    for p in prefixes:
        cache(tree, alloc, p)
    queue = [req(f"r{i}", p + [0, 0]) for i, p in enumerate(prefixes)]
    policy = SchedulePolicy("fcfs", tree)

    def evicted_first() -> str:
        saved = {n: n.last_access for n in tree._nodes()}
        victim = min(saved, key=lambda n: (n.last_access, n.serial))
        return next(r.rid for r in queue if r.last_node is victim)

    policy.calc_priority(queue)  # round 0 touches, the tail least recently
    assert evicted_first() == "r3"
    tree.touch(queue[3].last_node)
    for _ in range(31):
        policy.calc_priority(queue)  # rounds 1-31 touch nothing
    assert evicted_first() == "r2"
    policy.calc_priority(queue)  # round 32
    assert evicted_first() == "r3"
    tree.evict(2)
    assert queue[0].prefix_len == 4 and tree.match_prefix(prefixes[3]).num_tokens == 0


# --- incremental matching ---------------------------------------------------------------------
def test_two_lpm_rounds_on_an_unchanged_tree_agree():
    tree, queue = lpm_workload()
    policy = SchedulePolicy("lpm", tree)
    policy.calc_priority(queue)
    order, lengths, matches = rids(queue), [r.prefix_len for r in queue], [r.match for r in queue]
    assert policy.calc_priority(queue).num_rematches == 0
    assert rids(queue) == order and [r.prefix_len for r in queue] == lengths
    assert all(r.match is m for r, m in zip(queue, matches, strict=True))


def _sglang_dedup(queue: list[Req], check: int, deprioritize: int) -> set[str]:
    """SGLang's waiting_queue_radix_tree, naively: a list of the inserted sequences."""
    inserted: list[list[int]] = []
    out = set()
    for r in queue:
        if r.prefix_len <= check:
            best = max((len(commonprefix([r.origin_input_ids, s])) for s in inserted), default=0)
            if best >= deprioritize:
                out.add(r.rid)
            else:
                inserted.append(r.origin_input_ids)
    return out


def _usable(r: Req) -> int:
    """SGLang matches the prompt less its last token (that one is always computed)."""
    return min(r.prefix_len, (len(r.origin_input_ids) - 1) // PAGE * PAGE)


def _hrrn_key(r: Req, deprio: set[str], now: int) -> tuple[float, str]:
    if r.rid in deprio:
        return (INF, r.rid)
    uncached = len(r.origin_input_ids) - _usable(r)  # >= 1
    return (-max(0, now - r.arrival_processed_tokens) / uncached, r.rid)


def _sglang_dfs_weight(reqs: list[Req], tree: RadixCache) -> list[Req]:
    """SGLang's dfs-weight on a tree split at every request's match end, naively: a trie
    with one node per page (fully split), children heaviest first, ties in the order the
    real tree got them; a node's own requests after its children's, in queue order."""
    path = {r: tuple(tuple(r.origin_input_ids[i : i + PAGE]) for i in range(0, _usable(r), PAGE))
            for r in reqs}
    weight: Counter[tuple] = Counter()
    for p in path.values():
        for k in range(len(p) + 1):
            weight[p[:k]] += 1

    def serial(p: tuple) -> int:  # the real node holding the last page of p
        node, pos = tree.root, 0
        while True:
            node = node.children[bytes(token_key(list(p[pos])))]
            pos += len(node.value)
            if pos >= len(p):
                return node.serial

    out: list[Req] = []

    def visit(p: tuple) -> None:
        kids = [k for k in weight if len(k) == len(p) + 1 and k[: len(p)] == p]
        for kid in sorted(kids, key=lambda k: (-weight[k], serial(k))):
            visit(kid)
        out.extend(r for r in reqs if path[r] == p)

    visit(())
    return out


def _reference_order(name: str, before: list[Req], tree: RadixCache, deprio: set[str], now: int):
    """SGLang's sorts on freshly matched requests, written naively."""
    ahead, behind = (
        [r for r in before if r.rid not in deprio],
        [r for r in before if r.rid in deprio],
    )
    if name == "lpm":
        return sorted(before, key=lambda r: INF if r.rid in deprio else -_usable(r))
    if name == "shortest-prefill-first":
        return sorted(
            before, key=lambda r: (r.rid in deprio, prefill_work(r), r.wait_queue_entry_time)
        )
    if name == "hrrn":
        return sorted(before, key=lambda r: _hrrn_key(r, deprio, now))
    if name == "dfs-weight":
        ahead = _sglang_dfs_weight(ahead, tree)
    return ahead + behind  # fcfs with in-batch dedup


@pytest.mark.parametrize("name", [*CACHE_AWARE, "fcfs", "lpm+fallback", "hrrn+numpy"])
def test_incremental_policy_equals_naive_rematching_on_random_workloads(name: str, monkeypatch):
    rng = random.Random(name)
    if name == "hrrn+numpy":  # the vectorized sort, used from 256 waiting requests
        monkeypatch.setattr(HrrnOrder, "VECTOR_MIN", 0)
    tree, alloc = make_tree(1 << 15)
    check, deprioritize = rng.choice([(4, 4), (8, 6), (-1, 4), (6, 0), (32, 32)])
    is_fallback_case = name == "lpm+fallback"
    name = name.split("+")[0]
    policy = SchedulePolicy(
        name,
        tree,
        in_batch_prefix_caching_check_threshold=check,
        in_batch_prefix_caching_deprioritize_threshold=deprioritize,
        enable_cache_agnostic_in_batch_prefix_caching=True,
        # Above 40 waiting requests: fcfs by priority, which reorders dedup groups.
        cache_aware_fallback_threshold=40 if is_fallback_case else None,
        enable_priority_scheduling=is_fallback_case,
    )
    stems = [[rng.randrange(4) for _ in range(rng.randrange(2, 12))] for _ in range(6)]

    def new_req(i: int) -> Req:
        tokens = rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randrange(0, 14))]
        return req(
            f"r{i:04d}",
            tokens or [1],
            arrival_processed_tokens=8 * i,
            wait_queue_entry_time=float(i),
            priority=rng.choice([None, 0, 1, 2]),
        )

    queue = [new_req(i) for i in range(40)]
    num_reqs, locked, processed = 40, [], 400
    for _ in range(80):
        before = list(queue)
        processed += rng.randrange(0, 50)
        result = policy.calc_priority(queue, None, processed)
        for r in queue:  # every cached match equals a fresh one
            fresh = tree.match_prefix(r.origin_input_ids)
            assert (r.prefix_indices, r.prefix_len, r.last_node) == fresh[:3]
        if result.is_fallback:
            assert not any(r.is_deprioritized for r in queue)
            # SGLang's fallback fcfs keeps the queue's order even with priorities on:
            # its priority sort runs only when the configured policy is fcfs.
            assert rids(queue) == rids(before)
        else:
            deprio = _sglang_dedup(before, check, deprioritize)
            assert {r.rid for r in queue if r.is_deprioritized} == deprio
            expected = _reference_order(name, before, tree, deprio, processed)
            assert rids(queue) == rids(expected)
        # The adder: admit a few, lock them, prefill, cache; sometimes evict, unlock, abort.
        for r in queue[: rng.randrange(0, 4)]:
            m = policy.match_prefix_for_req(r)
            tree.inc_lock_ref(m.last_node)
            locked.append(m.last_node)
            cache(tree, alloc, r.origin_input_ids)
            queue.remove(r)
        if rng.random() < 0.4:
            tree.evict(rng.randrange(1, 20))
        if locked and rng.random() < 0.5:
            tree.dec_lock_ref(locked.pop(0))
        if queue and rng.random() < 0.1:
            queue.pop(rng.randrange(len(queue)))  # aborted in the middle of the queue
        for _ in range(rng.randrange(0, 5 + 2 * is_fallback_case)):
            queue.append(new_req(num_reqs))
            num_reqs += 1
        tree.check_integrity()
    assert policy._matcher is not None
    assert policy._matcher.num_tracked <= len(queue) + 4


@pytest.mark.parametrize("name", ["fcfs", "lof", "random", "routing-key", *CACHE_AWARE])
def test_every_policy_handles_empty_and_draining_queues(name: str):
    tree, _ = make_tree()
    policy = SchedulePolicy(name, tree)
    queue = [req("a", [1, 2, 3]), req("b", [1, 2, 4])]
    policy.calc_priority(queue, [req("r", routing_key="k")], 10)
    assert sorted(rids(queue)) == ["a", "b"]
    queue.clear()
    result = policy.calc_priority(queue, None, 20)
    assert queue == [] and result.num_deprioritized == 0
    assert policy._matcher is not None and policy._matcher.num_tracked == 0


# --- SGLang's exact orders on the smallest cases where pdserve used to differ ------------


def _page1_tree(*cached: list[int]) -> RadixCache:
    alloc = PageAllocator(64)
    tree = RadixCache(1, alloc)
    for tokens in cached:
        tree.insert(tokens, alloc.allocate(len(tokens)))
    return tree


def test_lpm_sorts_on_the_prompt_less_its_last_token():
    # Cache [[5, 6]]: y=[5, 6] is fully cached, but its last token is computed anyway, so
    # SGLang matches y[:-1] = [5] (1 token), as for x=[5, 7]: a tie, queue order x, y.
    # (pdserve used to sort y first on its uncapped match of 2.)
    queue = [req("x", [5, 7]), req("y", [5, 6])]
    SchedulePolicy("lpm", _page1_tree([5, 6])).calc_priority(queue)
    assert rids(queue) == ["x", "y"]


def test_hrrn_counts_a_fully_cached_prompt_as_one_uncached_token():
    # Cache [[637]], processed 0: both have waited 0 tokens, ratio 0 for both (r1 has 1
    # uncached token, not 0), so rid order: r0, r1. (pdserve drained r1 first.)
    queue = [req("r1", [637]), req("r0", [345])]
    SchedulePolicy("hrrn", _page1_tree([637])).calc_priority(queue, None, processed_tokens=0)
    assert rids(queue) == ["r0", "r1"]


def test_dfs_weight_orders_as_if_the_node_were_split_at_each_match_end():
    # Cache [[79, 743]]: b=[79, 743] matches [79] (less its last token), ending inside the
    # node; SGLang splits it and b hangs on the new [79] node, a child of the root where
    # a=[79] (match of nothing) hangs: children first, so b, a.
    queue = [req("a", [79]), req("b", [79, 743])]
    SchedulePolicy("dfs-weight", _page1_tree([79, 743])).calc_priority(queue)
    assert rids(queue) == ["b", "a"]
    # Deeper ends inside one node come first; the node's children before all of them.
    tree = _page1_tree([1, 2, 3, 4], [1, 2, 3, 4, 5, 6])
    queue = [
        req("one", [1, 2, 9]),  # ends after 2 tokens of node [1, 2, 3, 4]
        req("child", [1, 2, 3, 4, 5, 6, 7]),  # in the child node [5, 6]
        req("three", [1, 2, 3, 9]),  # ends after 3 tokens
        req("whole", [1, 2, 3, 4, 8]),  # ends at the node's end
    ]
    SchedulePolicy("dfs-weight", tree).calc_priority(queue)
    assert rids(queue) == ["child", "whole", "three", "one"]


def test_dfs_weight_dedup_off_is_sglangs_unused_dedup_set():
    tree = _page1_tree([1])
    shared = [1, *range(100, 140)]  # 1 cached token, then 40 shared that are not

    def queue() -> list[Req]:
        return [req("plain", [7, 8]), req("lead", shared + [1]), req("mate", shared + [2])]

    on = queue()
    SchedulePolicy("dfs-weight", tree).calc_priority(on)
    # pdserve: the mate would compute the lead's 40 tokens again; it goes last.
    assert rids(on) == ["lead", "plain", "mate"] and on[2].is_deprioritized
    off = queue()
    SchedulePolicy("dfs-weight", tree, dfs_weight_dedup=False).calc_priority(off)
    # SGLang 0.5.23: the dedup set is not used; both hang on the [1] node, before the root.
    assert rids(off) == ["lead", "mate", "plain"]
    assert not any(r.is_deprioritized for r in off)


def test_dfs_weight_dedup_flag_reaches_the_policy():
    config = PrefillConfig(schedule_policy="dfs-weight", dfs_weight_dedup="off")
    policy = SchedulePolicy.from_config(config, _page1_tree([1]))
    assert policy._dedup is None
    assert SchedulePolicy.from_config(PrefillConfig(schedule_policy="dfs-weight"),
                                      _page1_tree([1]))._dedup is not None


# --- cache salts ---------------------------------------------------------------------------


def test_salted_requests_match_only_their_salts_pages_and_are_never_deduped_together():
    from common.request import salt_key

    tree, alloc = make_tree()
    prompt = list(range(50, 90))  # 40 tokens: far past the dedup thresholds
    queue = [req("a1", prompt, cache_salt="a"), req("b1", prompt, cache_salt="b"),
             req("plain", prompt)]
    policy = SchedulePolicy("lpm", tree)
    policy.calc_priority(queue)
    # Three salts (none is one): three groups, nobody deprioritized.
    assert not any(r.is_deprioritized for r in queue)
    pages = alloc.allocate(len(prompt) // PAGE)
    tree.insert(prompt, pages, salt_key("a"))  # a1's prefill finished
    policy.calc_priority(queue)
    by_rid = {r.rid: r for r in queue}
    assert by_rid["a1"].prefix_len == len(prompt)  # rematched when salt a's subtree appeared
    assert by_rid["b1"].prefix_len == 0 and by_rid["plain"].prefix_len == 0
    assert rids(queue)[0] == "a1"
    # Same salt: shared, and deduped as usual.
    mates = [req("a2", prompt + [1], cache_salt="a"), req("a3", prompt + [2], cache_salt="a")]
    policy.calc_priority(mates)
    assert [r.prefix_len for r in mates] == [len(prompt), len(prompt)]
