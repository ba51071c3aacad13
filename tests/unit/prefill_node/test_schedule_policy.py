"""Schedule policy: every order, SGLang's scenarios, dedup, touch, fallback, metrics. Against
naive rematching: test_policy_vs_naive.py; SGLang's smallest cases: test_policy_sglang_cases.py."""

from __future__ import annotations

import pytest

from common import metrics
from common.config import PrefillConfig
from common.kv_pool import PageAllocator
from common.radix_cache import RadixCache
from prefill_node.request import Req
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
