"""The incremental schedule policy against SGLang's rules written naively (fresh matches, its
temporary dedup tree, a fully split tree for dfs-weight) on random workloads."""

from __future__ import annotations

import random
from collections import Counter
from os.path import commonprefix

import pytest

from common.radix_cache import RadixCache
from common.token_keys import token_key
from prefill_node.cache_aware_orders import HrrnOrder
from prefill_node.hiradix_cache import HiRadixCache
from prefill_node.request import Req
from prefill_node.schedule_policy import SchedulePolicy, prefill_work
from tests.support.host_pages import NoCopyHost
from tests.unit.prefill_node.test_schedule_policy import (
    CACHE_AWARE,
    INF,
    PAGE,
    cache,
    lpm_workload,
    make_tree,
    req,
    rids,
)


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
        if r.device_prefix_len <= check:
            best = max((len(commonprefix([r.origin_input_ids, s])) for s in inserted), default=0)
            if best >= deprioritize:
                out.add(r.rid)
            else:
                inserted.append(r.origin_input_ids)
    return out


def _matched(r: Req) -> int:
    """SGLang's num_matched_prefix_tokens: the match capped at the prompt less its last
    token (always computed), in tokens."""
    return min(r.prefix_len, len(r.origin_input_ids) - 1)


def _hrrn_key(r: Req, deprio: set[str], now: int) -> tuple[float, str]:
    if r.rid in deprio:
        return (INF, r.rid)
    uncached = len(r.origin_input_ids) - _matched(r)  # >= 1
    return (-max(0, now - r.arrival_processed_tokens) / uncached, r.rid)


def _sglang_dfs_weight(reqs: list[Req], tree: RadixCache) -> list[Req]:
    """SGLang's dfs-weight on a tree split at every request's (whole) match end, naively: a trie
    with one node per page (fully split), children heaviest first, ties in the order the
    real tree got them; a node's own requests after its children's, in queue order."""
    path = {  # the device part: a host hit hangs on its last device node
        r: tuple(
            tuple(r.origin_input_ids[i : i + PAGE]) for i in range(0, r.device_prefix_len, PAGE)
        )
        for r in reqs
    }
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
        return sorted(before, key=lambda r: INF if r.rid in deprio else -_matched(r))
    if name == "shortest-prefill-first":
        return sorted(
            before, key=lambda r: (r.rid in deprio, prefill_work(r), r.wait_queue_entry_time)
        )
    if name == "hrrn":
        return sorted(before, key=lambda r: _hrrn_key(r, deprio, now))
    if name == "dfs-weight":
        ahead = _sglang_dfs_weight(ahead, tree)
    return ahead + behind  # fcfs with in-batch dedup


@pytest.mark.parametrize("tiers", ["device", "host"])
@pytest.mark.parametrize("name", [*CACHE_AWARE, "fcfs", "lpm+fallback", "hrrn+numpy"])
def test_incremental_policy_equals_naive_rematching_on_random_workloads(
    name: str, tiers: str, monkeypatch
):
    """tiers "host": a write-through host tier under the tree (small enough that it drops
    copies too), so evictions leave host-only nodes that matches continue into."""
    rng = random.Random(name + tiers)
    if name == "hrrn+numpy":  # the vectorized sort, used from 256 waiting requests
        monkeypatch.setattr(HrrnOrder, "VECTOR_MIN", 0)
    tree, alloc = make_tree(1 << 15)
    if tiers == "host":
        tree = HiRadixCache(PAGE, alloc, NoCopyHost(48), "write_through")
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
    num_host_hits = 0
    for _ in range(80):
        before = list(queue)
        processed += rng.randrange(0, 50)
        result = policy.calc_priority(queue, None, processed)
        for r in queue:  # every cached match equals a fresh one
            fresh = tree.match_prefix(r.origin_input_ids)
            assert (r.prefix_indices, r.device_prefix_len, r.last_node) == fresh[:3]
            assert r.prefix_len == fresh.total_tokens
            num_host_hits += r.prefix_len > r.device_prefix_len
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
    assert (num_host_hits > 0) == (tiers == "host")


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
