"""Precise prefill routing (bootstrap/router.py): cached prefix vs queued work; the baselines."""

from __future__ import annotations

from collections import Counter

import pytest

from bootstrap.router import (
    DecodeCandidate,
    HashRing,
    PrefillCandidate,
    Router,
    choose_prefill_by_cache,
    prefill_candidates,
)

NODES = ["p0", "p1", "p2", "p3"]
DECODES = [DecodeCandidate("d0", 0)]
PROMPT = list(range(1000, 1000 + 640))  # 40 pages of 16


def cands(queued: dict[str, int] | None = None) -> list[PrefillCandidate]:
    return [PrefillCandidate(n, 0, (queued or {}).get(n, 0)) for n in NODES]


def test_the_node_holding_the_longest_prefix_wins_when_loads_are_equal():
    ring = HashRing(NODES)
    choice = choose_prefill_by_cache({"p1": 10, "p2": 30}, cands(), 640, 16, ring, 7)
    assert choice is not None and choice.node_id == "p2" and choice.cached_pages == 30


def test_queued_work_outweighs_a_cached_prefix_worth_less():
    ring = HashRing(NODES)
    # p2 saves 480 tokens but has 2000 queued: p0 (nothing cached, idle) finishes first.
    choice = choose_prefill_by_cache({"p2": 30}, cands({"p2": 2000}), 640, 16, ring, 7)
    assert choice is not None and choice.node_id != "p2"
    # With 300 queued, the 480 cached tokens still win.
    choice = choose_prefill_by_cache({"p2": 30}, cands({"p2": 300}), 640, 16, ring, 7)
    assert choice is not None and choice.node_id == "p2"


def test_no_cached_page_means_no_cache_choice_and_ties_follow_the_ring():
    ring = HashRing(NODES)
    assert choose_prefill_by_cache({}, cands(), 640, 16, ring, 7) is None
    assert choose_prefill_by_cache({"p9": 3}, cands(), 640, 16, ring, 7) is None  # not a candidate
    every = {n: 5 for n in NODES}
    for key in (1, 2**40, 2**63):
        choice = choose_prefill_by_cache(every, cands(), 640, 16, ring, key)
        assert choice is not None and choice.node_id == next(ring.walk(key))


def test_a_fully_cached_prompt_still_costs_its_last_token():
    ring = HashRing(NODES)
    # 40 pages cover the prompt: both nodes cost 1 token plus their queue.
    choice = choose_prefill_by_cache({"p0": 40, "p1": 40}, cands({"p0": 5}), 640, 16, ring, 7)
    assert choice is not None and choice.node_id == "p1"


def test_precise_router_falls_back_to_affinity_without_overlaps():
    precise, affinity = Router(mode="precise"), Router(mode="affinity")
    for i in range(20):
        ids = [i] * 40
        a = precise.route(ids, None, cands(), DECODES, overlaps={})
        b = affinity.route(ids, None, cands(), DECODES)
        assert a.prefill_id == b.prefill_id and a.kind == "affinity"
    d = precise.route(PROMPT, None, cands(), DECODES, overlaps={"p3": 12})
    assert (d.prefill_id, d.kind, d.cached_pages) == ("p3", "cache", 12)
    # A routing key is the client's placement: it wins over the cache.
    keyed = precise.route(PROMPT, "tenant-9", cands(), DECODES, overlaps={"p3": 12})
    assert keyed.kind == "routing_key"
    assert keyed.prefill_id == affinity.route(PROMPT, "tenant-9", cands(), DECODES).prefill_id


def test_round_robin_and_random_baselines_spread_over_every_node():
    rr = Router(mode="round-robin")
    picks = [rr.route(PROMPT, None, cands(), DECODES).prefill_id for _ in range(8)]
    assert Counter(picks) == {n: 2 for n in NODES}
    rnd = Router(mode="random", seed=3)
    assert {rnd.route(PROMPT, None, cands(), DECODES).prefill_id for _ in range(64)} == set(NODES)
    with pytest.raises(ValueError):
        Router(mode="nearest")


def test_fast_candidates_are_the_same_candidates():
    made = prefill_candidates(["a", "b"], {"a": 1, "b": 2}.__getitem__, {"a": 30})
    assert made == [PrefillCandidate("a", 1, 30), PrefillCandidate("b", 2, 0)]
    assert made[1].node_id == "b" and made[1].queued_tokens == 0
