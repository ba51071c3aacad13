"""Decode admission: SGLang's KV budget, head-of-line blocking, priority order, resume order."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common.node.scheduling import IllegalTransition
from decode_node.prealloc_queue import (
    BudgetReq,
    DecodeBudget,
    DecodePreallocQueue,
    admit_preallocated,
    resume_retracted,
)
from decode_node.req import DecodeState
from tests.support.decode_harness import bare_req
from transfer.kv_poll import KVPoll

PAGE = 4


def budget(free_pages, active=0, running=(), retracted=(), reserved=8, slots=None):
    return DecodeBudget(
        page_size=PAGE,
        num_free_pages=free_pages,
        num_reserved_decode_tokens=reserved,
        num_active_reqs=active,
        running=running,
        retracted=retracted,
        num_free_slots=slots,
    )


def test_a_pool_shared_with_the_prefill_half_keeps_room_to_compute_the_prompts():
    """Colocated: each admitted prompt is computed in the same pool before it is handed
    over. Before, the decode half preallocated the whole pool and the prefill half had no
    page left to compute those prompts into: nothing moved."""
    cands = [BudgetReq(7, 0, 1)] * 6  # 2 pages each, 8 tokens to finish, no reserve
    plain = DecodeBudget(page_size=PAGE, num_free_pages=12, num_reserved_decode_tokens=0,
                         num_active_reqs=0)  # fmt: skip
    assert admit_preallocated(cands, plain) == [0, 1, 2, 3, 4, 5]  # all 12 pages
    shared = DecodeBudget(page_size=PAGE, num_free_pages=12, num_reserved_decode_tokens=0,
                          num_active_reqs=0, shares_pool_with_prefill=True)  # fmt: skip
    assert admit_preallocated(cands, shared) == [0, 1, 2]  # 6 pages theirs, 6 to compute
    # Two already in transfer: their 4 pages of prompt still to compute stay free too.
    busy = DecodeBudget(page_size=PAGE, num_free_pages=8, num_reserved_decode_tokens=0,
                        num_active_reqs=2, shares_pool_with_prefill=True,
                        num_prefill_tokens=4 * PAGE)  # fmt: skip
    assert admit_preallocated(cands, busy) == [0]


def test_admits_in_order_until_the_pool_is_reserved():
    # 100 free pages = 400 tokens; each request takes ceil_page(input) + 8 reserved.
    cands = [BudgetReq(40, 0, 16), BudgetReq(40, 0, 16), BudgetReq(300, 0, 16)]
    assert admit_preallocated(cands, budget(100)) == [0, 1]
    assert admit_preallocated(cands[:2], budget(100)) == [0, 1]
    # 40 + 8 = 48 tokens each: exactly 2 fit into 24 pages (96 tokens), not 3.
    assert admit_preallocated([BudgetReq(40, 0, 8)] * 3, budget(24)) == [0, 1]
    # ... and only one when the second could not also finish alone in what is left.
    assert admit_preallocated([BudgetReq(40, 0, 16)] * 3, budget(24)) == [0]


def test_first_request_that_does_not_fit_blocks_the_ones_behind_it():
    big, small = BudgetReq(200, 0, 16), BudgetReq(8, 0, 16)
    assert admit_preallocated([small, big, small], budget(40)) == [0]  # 160 tokens free
    # A request still handshaking is skipped, not blocking.
    waiting = BudgetReq(200, 0, 16, is_ready=False)
    assert admit_preallocated([waiting, small, small], budget(40)) == [1, 2]


def test_reserved_headroom_per_active_request_is_kept():
    # 3 active requests reserve 3 * 32 = 96 of 128 free tokens: 32 remain.
    assert admit_preallocated([BudgetReq(20, 0, 4)], budget(32, active=3, reserved=32)) == []
    assert admit_preallocated([BudgetReq(20, 0, 4)], budget(32, active=2, reserved=32)) == [0]
    assert admit_preallocated([BudgetReq(20, 0, 4)], budget(32, active=1, reserved=32)) == [0]


def test_single_request_guarantee_uses_retractable_tokens():
    # Running: one request of 20 + 10 tokens that may produce 200: it needs 200 + 20 - 30 = 190
    # tokens beyond what retracting everything frees; that is reserved instead of 8 * 1.
    running = [BudgetReq(20, 10, 200)]
    b = budget(60, active=1, running=running)  # 240 free - 190 = 50 allocatable
    assert b.allocatable_tokens() == 50
    assert admit_preallocated([BudgetReq(44, 0, 8)], b) == []  # 44 + 8 > 50
    assert admit_preallocated([BudgetReq(40, 0, 8)], b) == [0]
    # The candidate itself must be able to finish alone: 36 + 100 - 30 = 106 > 50.
    assert admit_preallocated([BudgetReq(36, 0, 100)], b) == []


def test_retracted_requests_count_against_admission():
    retracted = [BudgetReq(40, 20, 64)]  # 40 + 20 + 8 = 68 tokens owed
    assert budget(30, retracted=retracted).allocatable_tokens() == 120 - 68
    assert admit_preallocated([BudgetReq(40, 0, 8)], budget(30, retracted=retracted)) == [0]
    assert admit_preallocated([BudgetReq(48, 0, 8)], budget(30, retracted=retracted)) == []


def test_request_slots_limit_admissions():
    cands = [BudgetReq(4, 0, 4)] * 5
    assert admit_preallocated(cands, budget(100, slots=2)) == [0, 1]
    assert admit_preallocated(cands, budget(100, slots=0)) == []


def test_idle_node_admits_the_head_when_it_can_finish_alone():
    # Reserved headroom (512) is larger than the pool, but nothing else holds a page.
    head = BudgetReq(40, 0, 20)
    assert admit_preallocated([head, head], budget(16, reserved=512)) == [0]
    assert admit_preallocated([BudgetReq(40, 0, 40)], budget(16, reserved=512)) == []
    assert admit_preallocated([head], budget(16, active=1, reserved=512)) == []


def test_resume_takes_retracted_requests_in_order_while_the_reserve_allows():
    retracted = [BudgetReq(20, 10, 64), BudgetReq(20, 30, 64), BudgetReq(4, 1, 8)]
    # 30 -> ceil 32 + 8 = 40; 50 -> 52 + 8 = 60; then 5 -> 8 + 8 = 16.
    assert resume_retracted(budget(25, retracted=retracted)) == 2  # 100 tokens
    assert resume_retracted(budget(35, retracted=retracted)) == 3
    assert resume_retracted(budget(9, active=1, retracted=retracted)) == 0  # 36 - 8 < 40
    # Nothing else active: the head comes back as soon as its tokens fit.
    assert resume_retracted(budget(8, active=0, retracted=retracted)) == 1


@dataclass
class _Receiver:
    state: KVPoll = KVPoll.WaitingForInput

    def poll(self) -> KVPoll:
        return self.state


def _req(rid, n, priority=None, ready=True):
    r = bare_req(rid, [1] * n, priority)
    r.receiver = _Receiver(KVPoll.WaitingForInput if ready else KVPoll.Bootstrapping)  # type: ignore[assignment]
    return r


def test_queue_is_fifo_with_head_of_line_blocking():
    q = DecodePreallocQueue()
    for r in (_req("a", 8), _req("b", 200), _req("c", 8)):
        q.add(r)
    assert [r.rid for r in q.pop_preallocated(budget(40))] == ["a"]
    assert [r.rid for r in q.queue] == ["b", "c"]


def test_priority_order_and_its_sign():
    reqs = [_req("none", 8), _req("p1", 8, 1), _req("p5", 8, 5), _req("p1b", 8, 1)]
    q = DecodePreallocQueue(enable_priority=True)  # higher values first
    for r in reqs:
        q.add(r)
    assert [r.rid for r in q.pop_preallocated(budget(100))] == ["p5", "p1", "p1b", "none"]
    q = DecodePreallocQueue(enable_priority=True, low_priority_values_first=True)
    for r in reqs:
        q.add(r)
    assert [r.rid for r in q.pop_preallocated(budget(100))] == ["p1", "p1b", "p5", "none"]
    # Without priority scheduling, arrival order.
    q = DecodePreallocQueue()
    for r in reqs:
        q.add(r)
    assert [r.rid for r in q.pop_preallocated(budget(100))] == ["none", "p1", "p5", "p1b"]


def test_failed_handshakes_leave_the_queue():
    q = DecodePreallocQueue()
    ok, bad = _req("ok", 8), _req("bad", 8)
    bad.receiver.state = KVPoll.Failed  # type: ignore[union-attr]
    q.add(ok)
    q.add(bad)
    assert q.pop_failed() == [bad] and q.queue == [ok]


def test_request_lifecycle_moves_only_forward_and_terminal_states_are_final():
    r = _req("x", 4)
    with pytest.raises(IllegalTransition):
        r.advance(DecodeState.RUNNING)  # no KV yet
    for state in ("TRANSFER", "WAITING", "RUNNING", "RETRACTED", "WAITING", "RUNNING", "FINISHED"):
        r.advance(DecodeState[state])
    for state in DecodeState:
        with pytest.raises(IllegalTransition):
            r.advance(state)
    failed = _req("y", 4)
    failed.advance(DecodeState.FAILED)
    assert failed.state.is_terminal
