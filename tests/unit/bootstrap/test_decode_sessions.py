"""The gateway's record of which decode node caches which conversation."""

from __future__ import annotations

import random

import pytest

from bootstrap.decode_sessions import DecodeSessions, cached_sequence_hash
from bootstrap.router import DecodeCandidate, PrefillLoads, Router
from common import page_hash

PAGE = 16


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 5000) for _ in range(n)]


def test_a_next_turn_finds_the_node_that_served_the_last_one_despite_a_shared_opening() -> None:
    rng = random.Random(0)
    system = _tokens(rng, 70)  # every conversation starts with the same long system prompt
    sessions = DecodeSessions()
    chats = {}
    for i, node in enumerate(["d0", "d1", "d2", "d1"]):
        prompt = system + _tokens(rng, 20 + i)
        answer = _tokens(rng, 9)
        h = cached_sequence_hash(prompt, answer, PAGE, None)
        assert h is not None
        sessions.record(h, node)
        chats[i] = (prompt + answer + _tokens(rng, 12), node)
    live = {"d0", "d1", "d2"}
    for next_prompt, node in chats.values():
        hashes = page_hash.prompt_hashes(next_prompt, PAGE).tolist()
        assert sessions.find(hashes, live) == node
    # The shared system prompt alone names nobody; a node gone is not named.
    assert sessions.find(page_hash.prompt_hashes(system + [1] * 40, PAGE).tolist(), live) is None
    next_prompt, node = chats[0]
    hashes = page_hash.prompt_hashes(next_prompt, PAGE).tolist()
    assert sessions.find(hashes, live - {node}) is None
    # Another cache salt is another namespace.
    salted = page_hash.prompt_hashes(next_prompt, PAGE, "tenant-b").tolist()
    assert sessions.find(salted, live) is None


def test_the_longest_recorded_prefix_wins_and_the_record_is_bounded() -> None:
    rng = random.Random(1)
    base = _tokens(rng, 40)
    sessions = DecodeSessions(capacity=2)
    short = cached_sequence_hash(base[:20], [7], PAGE, None)  # 20 tokens: 1 whole page
    long = cached_sequence_hash(base, [7, 8], PAGE, None)  # 41 tokens: 2 whole pages
    assert short is not None and long is not None
    sessions.record(short, "d0")
    sessions.record(long, "d1")
    hashes = page_hash.prompt_hashes(base + [7, 8, 9], PAGE).tolist()
    assert sessions.find(hashes, {"d0", "d1"}) == "d1"
    assert sessions.find(hashes, {"d0"}) == "d0"
    sessions.record(12345, "d2")  # the least recently used record goes
    sessions.record(67890, "d2")
    assert len(sessions) == 2 and sessions.find(hashes, {"d0", "d1"}) is None
    assert cached_sequence_hash([1] * 10, [2] * 6, PAGE, None) is None  # KV of 15 tokens
    with pytest.raises(ValueError):
        DecodeSessions(capacity=0)


def test_the_router_sends_a_conversation_to_its_session_node_within_its_load_bound() -> None:
    router = Router()
    cands = [
        DecodeCandidate(d, n, 100, 50, caches_prefixes=True) for d, n in [("d0", 0), ("d1", 1)]
    ]
    ids = list(range(100, 140))
    loads = PrefillLoads(["p0"])
    ring_choice = router.route(ids, None, loads, cands).decode_id
    other = "d1" if ring_choice == "d0" else "d0"
    assert router.route(ids, None, loads, cands, session_node=other).decode_id == other
    # Past its bounded load (or full) the session node is passed over for the ring's choice.
    busy = [c._replace(num_inflight=40) if c.node_id == other else c for c in cands]
    assert router.route(ids, None, loads, busy, session_node=other).decode_id != other
    full = [c._replace(free_pages=0) if c.node_id == other else c for c in cands]
    assert router.route(ids, None, loads, full, session_node=other).decode_id != other
