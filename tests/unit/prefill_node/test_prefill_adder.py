"""PrefillAdder budgets and results, with a lock-counting stand-in for the radix cache."""

from __future__ import annotations

from prefill_node.prefill_adder import AddReqResult, PrefillAdder
from prefill_node.request import Req

PAGE = 16


class Cache:
    def __init__(self, evictable: int = 0) -> None:
        self.evictable = evictable
        self.locks: dict[str, int] = {}

    def cut(self, node: str, num_pages: int) -> str:
        return node

    def inc_lock_ref(self, node: str) -> None:
        self.locks[node] = self.locks.get(node, 0) + 1
        self.evictable -= 32  # each stand-in node holds two pages

    def dec_lock_ref(self, node: str) -> None:
        self.locks[node] -= 1
        self.evictable += 32

    def evictable_size(self) -> int:
        return self.evictable


def req(n: int, rid: str = "r", max_new: int = 1) -> Req:
    return Req(rid=rid, room=0, origin_input_ids=list(range(n)), max_new_tokens=max_new)


def adder(free=10_000, cache=None, **kw):
    kw.setdefault("max_prefill_tokens", 16384)
    kw.setdefault("chunked_prefill_size", 8192)
    return PrefillAdder(PAGE, free, cache, **kw)


def test_admits_until_memory_runs_out_then_no_token():
    a = adder(free=3 * (64 + 1 + PAGE))  # room for exactly three 64-token prompts
    results = [a.add_one_req(req(64, f"r{i}"), 0) for i in range(4)]
    assert results[:2] == [AddReqResult.CONTINUE] * 2
    assert results[2] == AddReqResult.NO_TOKEN  # admitted, but nothing is left afterwards
    assert results[3] == AddReqResult.NO_TOKEN
    assert [c.req.rid for c in a.can_run_list] == ["r0", "r1", "r2"]


def test_prefill_max_requests_gives_other():
    a = adder(prefill_max_requests=2)
    assert a.add_one_req(req(10, "a"), 0) == AddReqResult.CONTINUE
    assert a.add_one_req(req(10, "b"), 0) == AddReqResult.CONTINUE
    assert a.add_one_req(req(10, "c"), 0) == AddReqResult.OTHER
    assert len(a.can_run_list) == 2


def test_long_prompt_is_chunked_at_an_absolute_page_boundary_and_continued_first():
    a = adder(chunked_prefill_size=100)
    r = req(300)
    assert a.add_one_req(r, prefix_len=20) == AddReqResult.OTHER  # chunk budget used up
    chunk = a.can_run_list[0]
    assert (chunk.start, chunk.end) == (20, 112) and a.new_chunked_req is r  # 112 = 7 pages
    nxt = adder(chunked_prefill_size=100)
    assert nxt.add_chunked_req(r, 112) is r
    assert (nxt.can_run_list[0].start, nxt.can_run_list[0].end) == (112, 208)
    last = adder(chunked_prefill_size=100)
    assert last.add_chunked_req(r, 208) is None and last.can_run_list[0].end == 300
    assert last.can_run_list[0].is_last


def test_without_chunking_the_first_request_may_exceed_the_input_cap_but_not_the_second():
    a = adder(chunked_prefill_size=None, max_prefill_tokens=100)
    assert a.add_one_req(req(500, "big"), 0) == AddReqResult.OTHER  # admitted; cap spent
    assert a.can_run_list[0].end == 500
    b = adder(chunked_prefill_size=None, max_prefill_tokens=100)
    assert b.add_one_req(req(50, "small"), 0) == AddReqResult.CONTINUE
    assert b.add_one_req(req(60, "next"), 0) == AddReqResult.OTHER
    assert [c.req.rid for c in b.can_run_list] == ["small"]


def test_admitted_prefix_stays_locked_and_a_refused_one_is_unlocked():
    cache = Cache(evictable=64)
    a = adder(free=64 + 1 + PAGE, cache=cache)
    # free 81 + evictable 32 after locking n1's two pages: room for one 64-token extend
    assert a.add_one_req(req(96, "hit"), prefix_len=32, last_node="n1") == AddReqResult.CONTINUE
    assert cache.locks == {"n1": 1}
    assert a.add_one_req(req(96, "miss"), prefix_len=32, last_node="n2") == AddReqResult.NO_TOKEN
    assert cache.locks == {"n1": 1, "n2": 0}
    assert a.can_run_list[0].locked_node == "n1"


def test_evictable_cache_counts_as_room():
    cache = Cache(evictable=200)
    a = adder(free=0, cache=cache)
    assert a.add_one_req(req(64), 0) == AddReqResult.CONTINUE
    assert len(a.can_run_list) == 1


def test_chunk_limit_caps_a_new_request():
    a = adder()
    a.add_one_req(req(1000), 0, chunk_limit=256)
    assert a.can_run_list[0].end == 256 and a.new_chunked_req is not None


def test_beside_an_unfinished_chunked_request_new_ones_are_admitted_only_whole():
    a = adder(chunked_prefill_size=64)
    a.can_start_chunk = False  # an earlier chunked request is still unfinished this round
    assert a.add_one_req(req(32, "fits"), 0) is AddReqResult.CONTINUE
    assert a.add_one_req(req(64, "would-chunk"), 0) is AddReqResult.OTHER
    assert [c.req.rid for c in a.can_run_list] == ["fits"] and a.new_chunked_req is None


def test_the_prefill_token_cap_holds_with_chunking_on():
    # SGLang's rule: past --max-prefill-tokens only the round's first request may go; the
    # second waits, chunking or not (pdserve used to admit it with chunking on: cap -10).
    a = adder(max_prefill_tokens=100, chunked_prefill_size=1000)
    assert a.add_one_req(req(50, "first"), 0) is AddReqResult.CONTINUE
    assert a.add_one_req(req(60, "second"), 0) is AddReqResult.OTHER
    assert [c.req.rid for c in a.can_run_list] == ["first"] and a.rem_input_tokens == 50
    alone = adder(max_prefill_tokens=100, chunked_prefill_size=1000)
    assert alone.add_one_req(req(160, "big"), 0) is AddReqResult.OTHER  # first: admitted
    assert [c.req.rid for c in alone.can_run_list] == ["big"]
