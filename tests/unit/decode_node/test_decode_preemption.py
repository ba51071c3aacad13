"""Priority preemption decisions on the decode node (pure)."""

from __future__ import annotations

from decode_node.prealloc_queue import BudgetReq, DecodeBudget
from decode_node.preemption import is_more_urgent_by, plan_preemption
from decode_node.retract import RetractCandidate

PAGE = 4


def cand(key: int, priority: int | None, pages: int = 4, outputs: int = 3) -> RetractCandidate:
    return RetractCandidate(key, 13, outputs, 8, pages, priority)


def budget(free_pages: int, running: list[RetractCandidate]) -> DecodeBudget:
    return DecodeBudget(
        PAGE,
        free_pages,
        4,
        len(running),
        running=[
            BudgetReq(c.num_input_tokens, c.num_output_tokens, c.max_new_tokens) for c in running
        ],
    )


HEAD = BudgetReq(13, 0, 8)  # needs 16 + 4 tokens, and 21 to finish alone


def test_urgency_by_threshold_in_both_directions_and_without_a_priority():
    # Strictly more than the threshold, as SGLang's preemption.
    assert is_more_urgent_by(21, 10, 10, False) and not is_more_urgent_by(20, 10, 10, False)
    assert is_more_urgent_by(-1, 10, 10, True) and not is_more_urgent_by(0, 10, 10, True)
    assert is_more_urgent_by(-5, None, 10, False)  # no priority: the least urgent
    assert not is_more_urgent_by(None, -100, 0, False)  # and it preempts no one


def test_nothing_is_retracted_when_the_request_fits():
    running = [cand(0, 0)]
    assert plan_preemption(HEAD, 50, running, budget(20, running), 10) == []


def test_least_urgent_eligible_first_and_only_as_many_as_needed():
    running = [cand(0, 30), cand(1, 0), cand(2, None), cand(3, 45)]
    # 2 free pages. One victim: 6 pages = 24 tokens less the reserve of the 3 left (4 each)
    # is 12 < the 20 the head needs; two victims: 40 - 8 = 32 >= 20.
    plan = plan_preemption(HEAD, 50, running, budget(2, running), 10)
    assert plan == [2, 1]  # no priority first, then priority 0; 30 and 45 are kept
    # With threshold 19 (gaps > 19) the one without a priority and priority 0 still qualify.
    assert plan_preemption(HEAD, 50, running, budget(2, running), 19) == [2, 1]


def test_none_when_every_eligible_victim_together_is_not_enough():
    running = [cand(0, 45), cand(1, 48)]  # within the threshold of 50: not preemptible
    assert plan_preemption(HEAD, 50, running, budget(0, running), 10) is None
    assert plan_preemption(HEAD, None, [cand(0, 0)], budget(0, [cand(0, 0)]), 0) is None
