"""Precise prefill routing (bootstrap/router.py): cached prefix vs queued work; the baselines."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bootstrap.kv_events import KVEventSubscriber, PrefillSource
from bootstrap.router import (
    DecodeCandidate,
    HashRing,
    HostHits,
    PrefillLoads,
    Router,
    choose_prefill,
    choose_prefill_by_cache,
)
from common import messages as msg
from common import page_hash

NODES = ["p0", "p1", "p2", "p3"]
DECODES = [DecodeCandidate("d0", 0)]
PROMPT = list(range(1000, 1000 + 640))  # 40 pages of 16


def cands(queued: dict[str, int] | None = None) -> PrefillLoads:
    return PrefillLoads(NODES, queued=queued or {})


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


def test_a_prefix_on_a_host_tier_costs_its_load_back_there():
    ring = HashRing(NODES)
    # p1 and p2 hold 30 pages each, p2's last 20 on its host tier alone.
    host = HostHits({"p2": 20}, {"p2": 0.5})
    held = {"p1": 30, "p2": 30}
    choice = choose_prefill_by_cache(held, cands(), 640, 16, ring, 7, host=host)
    assert choice is not None and choice.node_id == "p1"
    # Loading is free there (or p1's queue costs more than the load): p2 is as good, or better.
    queued = cands({"p1": 161})  # 2 * 161 > 2 * 320 * 0.25 = 160 tokens of load
    cheap = HostHits({"p2": 20}, {"p2": 0.25})
    choice = choose_prefill_by_cache(held, queued, 640, 16, ring, 7, host=cheap)
    assert choice is not None and choice.node_id == "p2"
    # A deeper host hit beats a shallower device one when loading is cheap enough.
    deeper = {"p1": 10, "p2": 30}
    choice = choose_prefill_by_cache(deeper, cands(), 640, 16, ring, 7, host=cheap)
    assert choice is not None and choice.node_id == "p2"
    dear = HostHits({"p2": 30}, {"p2": 0.9})  # 480 * 0.9 = 432 > 320 more to compute on p1
    choice = choose_prefill_by_cache(deeper, cands(), 640, 16, ring, 7, host=dear)
    assert choice is not None and choice.node_id == "p1"


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


def test_non_holders_of_equal_queue_tie_on_the_ring_and_a_holder_wins_an_equal_cost():
    ring = HashRing(NODES)
    busy = {"p0": 9000, "p1": 9000, "p2": 9000, "p3": 9000}
    # p3 holds a page but is far busier: the least queued of the others wins, and when
    # several are equally least queued, the first of them clockwise from the key.
    for key in (1, 2**40, 2**63):
        loads = {**busy, "p3": 50_000}
        for n in NODES[:3]:
            loads[n] = 10
        choice = choose_prefill_by_cache({"p3": 1}, cands(loads), 640, 16, ring, key)
        expected = next(n for n in ring.walk(key) if n != "p3")
        assert choice is not None and (choice.node_id, choice.cached_pages) == (expected, 0)
        loads["p1"] = 9  # one least queued: it, wherever the key is
        choice = choose_prefill_by_cache({"p3": 1}, cands(loads), 640, 16, ring, key)
        assert choice is not None and choice.node_id == "p1"
    # p3 holds one page (16 tokens, twice over: 32 in cost) and has 32 more queued than
    # p0: equal cost, the longer cached prefix wins.
    loads = {**busy, "p0": 100, "p3": 132}
    choice = choose_prefill_by_cache({"p3": 1}, cands(loads), 640, 16, ring, 7)
    assert choice is not None and (choice.node_id, choice.cached_pages) == ("p3", 1)
    loads["p3"] = 133
    choice = choose_prefill_by_cache({"p3": 1}, cands(loads), 640, 16, ring, 7)
    assert choice is not None and choice.node_id == "p0"


def test_the_loads_are_read_in_place_and_a_missing_node_counts_zero():
    loads = PrefillLoads(["a", "b"], {"a": 1}, {"a": 30})
    assert loads.members == {"a", "b"}
    choice = choose_prefill_by_cache({"a": 1}, loads, 640, 16, HashRing(["a", "b"]), 7)
    assert choice is not None and choice.node_id == "a"  # saves 16 tokens, 30 queued: 32 > 30
    ring = HashRing(["a", "b"])
    for key in range(0, 2**64, 2**60):
        # capacity ceil(1.25 * 2 / 2) = 2: neither is full, the home node takes it
        assert choose_prefill(ring, key, loads, 0.25).node_id == next(ring.walk(key))


def test_a_busy_prefix_is_copied_once_not_once_per_request():
    # p0 holds a 39-page context and has a long queue. Requests of that context arrive
    # faster than a copy's prefill ends (no event comes from any node meanwhile): the
    # first starts a copy on an idle node, the next ones queue behind that copy, where
    # the context will be, instead of each starting one more copy (the collapse
    # bench/routing_sim.py showed at 32 nodes: copies evicted other tenants' contexts).
    nodes = [f"p{i}" for i in range(8)]
    sub = KVEventSubscriber("gw")  # not started: its batches are handed to it here
    sub.sync(PrefillSource(n, "i1", f"inproc://{n}", f"inproc://{n}-req", 400) for n in nodes)
    context = PROMPT[: 39 * 16]

    def report(node: str, seq: int, queued: int, stored: Sequence[int] = ()) -> None:
        batch = msg.KVEvents(
            node_id=node,
            instance_id="i1",
            seq=seq,
            stored=page_hash.pack(np.array(stored, dtype=np.uint64)),
            removed=b"",
            is_snapshot=seq == 1,
            queued_tokens=queued,
            num_pages=400,
        )
        sub._apply([batch], push=None)  # type: ignore[arg-type]  # no snapshot is asked

    for node in nodes:
        held = page_hash.prompt_hashes(context, 16).tolist() if node == "p0" else []
        report(node, 1, 5000 if node == "p0" else 0, held)
    router, placed = Router(mode="precise"), []

    def admit(i: int) -> str:  # as bootstrap/service.py does
        prompt = context + [7000 + i] * 16
        hashes = page_hash.prompt_hashes(prompt, 16).tolist()
        overlaps = sub.overlaps(hashes, nodes)
        queued = sub.queued_tokens()
        d = router.route(prompt, None, PrefillLoads(nodes, queued=queued), DECODES, None, overlaps)
        sub.note_dispatched(d.prefill_id, max(1, len(prompt) - d.cached_pages * 16), hashes, 16)
        return d.prefill_id

    placed = [admit(i) for i in range(12)]
    copy = placed[0]
    assert copy != "p0" and placed == [copy] * 12, placed  # one copy; p0 is too busy
    # The copy's node reports its queue as it counts it: the context is not cached there
    # yet, so every follower's whole prompt. They were sent to wait for the copy's pages:
    # the gateway counts them as routed, and the next requests still follow the copy.
    report(copy, 2, 12 * 640)
    assert sub.queued_tokens()[copy] == 640 + 11 * 16
    assert [admit(i) for i in range(12, 16)] == [copy] * 4


def _by_cache_reference(overlaps, queued, nodes, prompt, ring, key):
    """The rule as the docs state it, node by node: least cost, then the longer cached
    prefix, then the first clockwise from the key."""
    priced = {}
    for n in nodes:
        cached = min(overlaps.get(n, 0) * 16, prompt)
        priced[n] = (queued.get(n, 0) + 2.0 * max(1, prompt - cached), -cached)
    best = min(priced.values())
    tied = {n for n, p in priced.items() if p == best}
    return next(n for n in ring.walk(key) if n in tied)


@settings(max_examples=300, deadline=None)
@given(
    st.integers(2, 12),
    st.lists(st.integers(0, 5), min_size=12, max_size=12),
    st.lists(st.sampled_from([0, 16, 32, 1000, 1024]), min_size=12, max_size=12),
    st.integers(1, 200),
    st.integers(0, 2**64 - 1),
)
def test_the_cache_choice_equals_the_rule_priced_node_by_node(n, held, queued, prompt, key):
    nodes = [f"p{i}" for i in range(n)]
    overlaps = {node: h for node, h in zip(nodes, held) if h}
    loads = dict(zip(nodes, queued))
    ring = HashRing(nodes)
    choice = choose_prefill_by_cache(
        overlaps, PrefillLoads(nodes, {}, loads), prompt, 16, ring, key
    )
    if not overlaps:
        assert choice is None
        return
    assert choice is not None
    assert choice.node_id == _by_cache_reference(overlaps, loads, nodes, prompt, ring, key)
    assert choice.cached_pages == overlaps.get(choice.node_id, 0)
