"""Router: prefix affinity by consistent hashing with bounded loads, least-loaded decode, rooms."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from bootstrap.router import (
    DecodeCandidate,
    HashRing,
    PrefillLoads,
    RoomAllocator,
    Router,
    affinity_key,
    bounded_load_capacity,
    choose_decode,
    choose_prefill,
)

SYSTEM = list(range(1000, 1040))  # a 40-token shared system prompt
NODES = ["p0", "p1", "p2", "p3"]


def idle(nodes: list[str] = NODES) -> PrefillLoads:
    return PrefillLoads(nodes)


DECODES = [DecodeCandidate("d0", 0)]


def test_affinity_key_uses_whole_leading_pages() -> None:
    a = SYSTEM + [1, 2, 3]
    b = SYSTEM + [7, 8, 9, 10, 11]
    assert affinity_key(a, None) == affinity_key(b, None)  # first 32 tokens are shared
    # 20 tokens: one whole page (16) is hashed, so prompts differing after token 16 match.
    assert affinity_key(SYSTEM[:16] + [5, 5, 5, 5], None) == affinity_key(
        SYSTEM[:16] + [6, 6], None
    )
    assert affinity_key(SYSTEM[:15] + [5], None) != affinity_key(SYSTEM[:15] + [6], None)
    assert affinity_key([1, 2], None) != affinity_key([1, 3], None)  # short prompts: all of it
    assert affinity_key(a, "tenant") == affinity_key([9], "tenant") != affinity_key(a, None)


def test_ring_walk_visits_every_node_once_and_is_stable() -> None:
    ring = HashRing(NODES, virtual_nodes=16)
    for key in (0, 1 << 40, (1 << 64) - 1):
        order = list(ring.walk(key))
        assert sorted(order) == NODES
        assert order == list(HashRing(list(reversed(NODES)), virtual_nodes=16).walk(key))


def test_consistent_hashing_moves_few_keys_when_a_node_joins() -> None:
    keys = [random.Random(i).getrandbits(64) for i in range(2000)]
    before = HashRing(NODES)
    after = HashRing([*NODES, "p4"])
    moved = [k for k in keys if next(before.walk(k)) != next(after.walk(k))]
    assert all(next(after.walk(k)) == "p4" for k in moved)  # only to the new node
    assert 0.1 < len(moved) / len(keys) < 0.35  # about 1/5 of the keys


def test_keys_spread_over_nodes() -> None:
    ring = HashRing(NODES)
    homes = Counter(next(ring.walk(random.Random(i).getrandbits(64))) for i in range(4000))
    assert set(homes) == set(NODES)
    assert max(homes.values()) / min(homes.values()) < 1.6


def test_same_system_prompt_goes_to_the_same_prefill() -> None:
    router = Router()
    picks = {
        router.route(
            SYSTEM + [random.Random(i).randrange(50000)] * 5, None, idle(), DECODES
        ).prefill_id
        for i in range(20)
    }
    assert len(picks) == 1


def test_affinity_hit_counts_repeat_placements() -> None:
    router = Router()
    first = router.route(SYSTEM, None, idle(), DECODES)
    second = router.route(SYSTEM + [1], None, idle(), DECODES)
    assert not first.is_affinity_hit and second.is_affinity_hit
    assert not first.is_spilled and not first.is_routing_key


def test_routing_key_overrides_the_prompt() -> None:
    router = Router()
    by_key = {router.route([i, i + 1], "tenant-7", idle(), DECODES).prefill_id for i in range(30)}
    assert len(by_key) == 1
    by_prompt = {router.route([i] * 40, None, idle(), DECODES).prefill_id for i in range(30)}
    assert len(by_prompt) > 1
    assert router.route([1], "tenant-7", idle(), DECODES).is_routing_key


def test_bounded_load_capacity() -> None:
    assert bounded_load_capacity(0, 4, 0.25) == 1
    assert bounded_load_capacity(7, 4, 0.25) == 3  # ceil(1.25 * 8 / 4)
    assert bounded_load_capacity(99, 1, 0.25) == 125


def test_hot_prefix_spills_to_the_next_node_on_the_ring() -> None:
    ring = HashRing(NODES)
    key = affinity_key(SYSTEM, None)
    order = list(ring.walk(key))
    home, second = order[0], order[1]
    loads = {n: 0 for n in NODES}
    loads[home] = 2  # capacity with 2 pending over 4 nodes: ceil(1.25 * 3 / 4) = 1
    choice = choose_prefill(ring, key, PrefillLoads(NODES, loads), 0.25)
    assert (choice.node_id, choice.home_id, choice.is_spilled) == (second, home, True)


def test_bounded_load_spreads_a_burst_of_one_prefix() -> None:
    router = Router(epsilon=0.25)
    pending = Counter[str]()
    for _ in range(40):  # nothing finishes prefill during the burst
        d = router.route(SYSTEM, None, PrefillLoads(NODES, pending), DECODES)
        pending[d.prefill_id] += 1
    assert set(pending) == set(NODES)
    # No node above (1 + eps) x average (+1 for rounding).
    assert max(pending.values()) <= 1.25 * 40 / 4 + 1
    home = next(HashRing(NODES).walk(affinity_key(SYSTEM, None)))
    assert pending[home] == max(pending.values())  # the home node still takes the most


def test_ring_follows_node_changes() -> None:
    router = Router()
    only = router.route(SYSTEM, None, idle(["p9"]), DECODES)
    assert only.prefill_id == "p9"
    assert router.route(SYSTEM, None, idle(), DECODES).prefill_id in NODES


def test_least_loaded_decode() -> None:
    assert (
        choose_decode(
            [DecodeCandidate("d0", 3), DecodeCandidate("d1", 1), DecodeCandidate("d2", 2)]
        )
        == "d1"
    )
    # Equal requests: more free pages (as a fraction of the pool) wins.
    assert (
        choose_decode([DecodeCandidate("d0", 1, 100, 10), DecodeCandidate("d1", 1, 1000, 500)])
        == "d1"
    )
    # A full pool is skipped while another has room, even with more requests there.
    assert (
        choose_decode([DecodeCandidate("d0", 0, 100, 0), DecodeCandidate("d1", 5, 100, 1)]) == "d1"
    )
    assert (
        choose_decode([DecodeCandidate("d0", 0, 100, 0), DecodeCandidate("d1", 5, 100, 0)]) == "d0"
    )
    with pytest.raises(ValueError):
        choose_decode([])


def test_rooms_are_unique_63_bit_and_never_zero() -> None:
    rooms = RoomAllocator(seed=1)
    got = [rooms.allocate() for _ in range(10_000)]
    assert len(set(got)) == len(got)
    assert all(0 < r < 2**63 for r in got)
    wrap = RoomAllocator(seed=1)
    wrap._next = 2**63 - 2
    assert [wrap.allocate() for _ in range(3)] == [2**63 - 2, 2**63 - 1, 1]
    assert RoomAllocator().allocate() != RoomAllocator().allocate()


def test_a_cache_salt_is_part_of_the_affinity_key():
    from bootstrap.router import affinity_key

    ids = list(range(64))
    assert affinity_key(ids, None) == affinity_key(ids, None, cache_salt=None)
    assert affinity_key(ids, None, cache_salt="a") == affinity_key(ids, None, cache_salt="a")
    keys = {affinity_key(ids, None, cache_salt=s) for s in (None, "a", "b")}
    keys |= {affinity_key(ids, "rk", cache_salt=s) for s in (None, "a", "b")}
    assert len(keys) == 6


def test_first_of_is_the_first_wanted_node_the_walk_meets():
    import random

    from bootstrap.router import HashRing

    nodes = [f"n{i}" for i in range(40)]
    ring = HashRing(nodes, virtual_nodes=8)
    rng = random.Random(5)
    for _ in range(500):
        key = rng.getrandbits(64)
        wanted = set(rng.sample(nodes, rng.randrange(1, 6)))
        assert ring.first_of(key, wanted) == next(n for n in ring.walk(key) if n in wanted)
    assert ring.first_of(7, {"not-a-node"}) is None
    assert ring.first_of(2**64 - 1, {"n3"}) == "n3"  # past the last point: wraps around


def _caching(loads: dict[str, int], full: frozenset[str] = frozenset()) -> list[DecodeCandidate]:
    return [
        DecodeCandidate(d, n, 100, 0 if d in full else 50, caches_prefixes=True)
        for d, n in loads.items()
    ]


def test_decode_nodes_with_a_prefix_cache_keep_each_conversation_on_one_node() -> None:
    router = Router()
    convs = [[i] * 20 + list(range(200, 230)) for i in range(40)]
    loads = {"d0": 0, "d1": 0, "d2": 0}
    first = {}
    for turn in range(3):
        for i, conv in enumerate(convs):
            ids = conv + [turn] * (5 * turn)  # a later turn extends the conversation
            d = router.route(ids, None, idle(), _caching(loads)).decode_id
            assert first.setdefault(i, d) == d, (i, turn)
    assert set(first.values()) == {"d0", "d1", "d2"}  # conversations spread over the nodes
    # Without a prefix cache the least loaded node wins, whatever the conversation.
    plain = [DecodeCandidate("d0", 3), DecodeCandidate("d1", 0), DecodeCandidate("d2", 5)]
    assert {router.route(c, None, idle(), plain).decode_id for c in convs} == {"d1"}


def test_a_conversation_moves_only_when_its_decode_node_is_gone_full_or_overloaded() -> None:
    router = Router()
    convs = [[i] * 20 for i in range(60)]
    loads = {"d0": 0, "d1": 0, "d2": 0}
    home = {
        i: router.route(c, None, idle(), _caching(loads)).decode_id for i, c in enumerate(convs)
    }
    # d1 is gone: its conversations move, nobody else's does.
    without = {d: n for d, n in loads.items() if d != "d1"}
    for i, c in enumerate(convs):
        d = router.route(c, None, idle(), _caching(without)).decode_id
        assert d != "d1" and (home[i] == "d1" or d == home[i])
    # d0 is full, then d0 holds far more requests than the bound allows: its go elsewhere.
    for cands in (
        _caching(loads, full=frozenset({"d0"})),
        _caching({"d0": 50, "d1": 0, "d2": 0}),
    ):
        for i, c in enumerate(convs):
            d = router.route(c, None, idle(), cands).decode_id
            assert d != "d0" and (home[i] == "d0" or d == home[i])
    # A routing key is the session: prompts that share nothing still meet on one node.
    keyed = {router.route([j] * 20, "chat-7", idle(), _caching(loads)).decode_id for j in range(9)}
    assert len(keyed) == 1
