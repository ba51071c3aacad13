"""The prefill loop with the host tier (--enable-hierarchical-cache): a prefix the device
pool evicted is loaded back from host memory instead of computed again, and the KV that
reaches the decode side equals a fresh computation. Tiny Llama, real zmq sockets,
loopback transfer (tests/support/prefill_harness.py)."""

from __future__ import annotations

import pytest

from common import metrics
from prefill_node.hiradix_cache import WRITE_POLICIES, HiRadixCache
from prefill_node.request import Req
from tests.support.prefill_harness import Harness, check_landed, prompt
from transfer.kv_poll import KVPoll

PAGE = 4


def _serve(h: Harness, rid: str, room: int, ids: list[int], check: bool = False) -> None:
    """Prefill ids through the loop; with check, the KV that landed equals a fresh
    computation. The decode side's pages are freed after (its pool is as small)."""
    h.submit(rid, room, ids)
    receiver, pages = h.receive(room, len(ids))
    h.run_until(lambda: receiver.poll() is KVPoll.Success and not h.sched.states)
    h.sched.check_integrity()
    if check:
        check_landed(h, receiver, pages, ids)
    h.dpool.allocator.free(pages)


def _host_hits() -> float:
    return metrics.HOST_CACHE_HIT_TOKENS.labels(role="prefill")._value.get()


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_an_evicted_prefix_is_loaded_back_from_the_host_not_computed(model_dir, policy):
    # 16 device pages (64 tokens): two 40-token prompts evict the 32-token shared prefix.
    h = Harness(
        model_dir,
        num_pages=16,
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        hicache_write_policy=policy,
    )
    try:
        assert isinstance(h.sched.tree, HiRadixCache)
        base = prompt(32, 30)
        first = base + prompt(5, 31)
        _serve(h, "a", 1, first)
        if policy == "write_through_selective":
            _serve(h, "a2", 2, first)  # two requests start from the prefix: copied
            _serve(h, "a3", 3, first)
        _serve(h, "x", 4, prompt(40, 32))
        _serve(h, "y", 5, prompt(40, 33))
        second = base + prompt(9, 34)
        match = h.sched.tree.match_prefix(second)
        assert (match.num_tokens, match.host_tokens) == (0, 32)  # on the host alone
        computed, hits = h.sched.processed_tokens, _host_hits()
        _serve(h, "b", 6, second, check=True)  # the loaded KV equals a fresh computation
        assert h.sched.processed_tokens - computed == len(second) - 32
        assert _host_hits() - hits == 32
        assert h.sched.stats.num_held_pages() == 0
    finally:
        h.close()


def test_without_the_host_tier_the_evicted_prefix_is_computed_again(model_dir):
    h = Harness(model_dir, num_pages=16)
    try:
        base = prompt(32, 30)
        _serve(h, "a", 1, base + prompt(5, 31))
        _serve(h, "x", 4, prompt(40, 32))
        _serve(h, "y", 5, prompt(40, 33))
        second = base + prompt(9, 34)
        computed = h.sched.processed_tokens
        _serve(h, "b", 6, second)
        assert h.sched.processed_tokens - computed == len(second)
    finally:
        h.close()


def test_the_waiting_queue_sorts_on_host_hits_too(model_dir):
    """lpm sees the host tier's tokens as cached (the seeds: num_matched_prefix_tokens
    counts host hits)."""
    h = Harness(
        model_dir,
        num_pages=16,
        enable_hierarchical_cache=True,
        schedule_policy="lpm",
    )
    try:
        base = prompt(32, 40)
        _serve(h, "a", 1, base + [7])
        _serve(h, "x", 2, prompt(40, 41))
        _serve(h, "y", 3, prompt(40, 42))
        cold, warm = prompt(36, 43), base + prompt(4, 44)
        assert h.sched.tree.match_prefix(warm).host_tokens == 32
        queue = [Req("cold", 0, cold, 1), Req("warm", 1, warm, 1)]
        h.sched.policy.calc_priority(queue, None, 0)
        assert [r.rid for r in queue] == ["warm", "cold"]
    finally:
        h.close()


def test_a_host_hit_is_computed_when_a_page_loads_slower_than_it_computes(model_dir):
    h = Harness(model_dir, num_pages=16, enable_hierarchical_cache=True)
    try:
        base = prompt(32, 50)
        _serve(h, "a", 1, base + [5])
        _serve(h, "x", 2, prompt(40, 51))
        _serve(h, "y", 3, prompt(40, 52))
        cost = h.sched.cache.load_cost
        assert cost.load_s_per_page is None  # nothing loaded yet
        cost.load_s_per_page, cost.compute_s_per_token = 1.0, 1e-6  # a slow tier
        second = base + prompt(9, 53)
        computed, hits = h.sched.processed_tokens, _host_hits()
        _serve(h, "b", 4, second, check=True)
        assert h.sched.processed_tokens - computed == len(second)  # all of it computed
        assert _host_hits() == hits
    finally:
        h.close()


def test_load_back_cost_loads_until_measured_then_only_while_cheaper():
    from prefill_node.load_back_cost import LoadBackCost

    cost = LoadBackCost(page_size=16, weight=0.5)
    assert cost.is_worth_loading()
    cost.observe_load(4, 4e-4)  # 100 us a page
    assert cost.is_worth_loading()  # compute not measured yet
    cost.observe_compute(100, 1e-3)  # 10 us a token: 160 us a page
    assert cost.is_worth_loading()
    cost.observe_load(1, 5e-4)  # the average moves to 300 us a page
    assert cost.load_s_per_page == pytest.approx(3e-4) and not cost.is_worth_loading()
    cost.observe_load(0, 1.0)  # nothing loaded: ignored
    assert cost.load_s_per_page == pytest.approx(3e-4)
