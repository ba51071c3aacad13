"""Retraction decisions: victim orders (length, priority), how many go, new_token_ratio."""

from __future__ import annotations

import pytest

from decode_node.retract import (
    NewTokenRatio,
    RetractCandidate,
    pages_to_run,
    plan_retraction,
    retract_new_token_ratio,
    retraction_order,
)

PAGE = 4


def cand(key, n_in, n_out, max_new=64, pages=None, priority=None):
    kv_len = n_in + max(n_out - 1, 0)
    return RetractCandidate(
        key, n_in, n_out, max_new, pages if pages is not None else -(-kv_len // PAGE), priority
    )


def keys(cands):
    return [c.key for c in cands]


def test_length_order_fewest_outputs_first_then_longest_input():
    cands = [cand(0, 10, 5), cand(1, 30, 2), cand(2, 10, 2), cand(3, 50, 9), cand(4, 20, 2)]
    assert keys(retraction_order(cands, "length")) == [1, 4, 2, 0, 3]


def test_length_order_ties_pop_from_the_tail_like_sglang():
    cands = [cand(0, 10, 3), cand(1, 10, 3), cand(2, 10, 3)]
    # SGLang: sorted(reverse=True) is stable (0, 1, 2), then pop() takes 2 first.
    assert keys(retraction_order(cands, "length")) == [2, 1, 0]


def test_priority_order_least_urgent_first_then_length():
    cands = [
        cand(0, 10, 5, priority=1),
        cand(1, 10, 2, priority=5),
        cand(2, 10, 9, priority=None),
        cand(3, 40, 5, priority=1),
        cand(4, 10, 1, priority=5),
    ]
    # Higher values are more urgent (default): no priority, then 1s, then 5s.
    assert keys(retraction_order(cands, "priority")) == [2, 3, 0, 4, 1]
    # Low values first: 5 is the least urgent; no priority still goes first.
    assert keys(retraction_order(cands, "priority", low_priority_values_first=True)) == [
        2,
        4,
        1,
        3,
        0,
    ]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="retraction policy"):
        retraction_order([], "random")


def test_no_retraction_when_the_next_step_fits():
    cands = [cand(0, 8, 1), cand(1, 8, 1)]  # kv 8 in 2 pages each: the next token needs a page
    assert pages_to_run(cands, PAGE, 1) == 2
    plan = plan_retraction(cands, 2, PAGE, "length")
    assert plan.victims == [] and plan.can_run and plan.new_token_ratio is None


def test_retract_until_the_rest_can_run_twenty_steps():
    # Four requests, each kv 8 tokens (2 pages); 20 more steps need 5 more pages each.
    cands = [
        cand(0, 8, 1, max_new=40),
        cand(1, 7, 2, max_new=40),
        cand(2, 6, 3, max_new=40),
        cand(3, 5, 4, max_new=40),
    ]
    plan = plan_retraction(cands, 1, PAGE, "length")
    # Free 1 + 2 per victim; the remaining need 5 pages each: 3 victims leave 7 >= 5.
    assert plan.victims == [0, 1, 2] and plan.can_run
    assert plan.new_token_ratio == pytest.approx(min(1.0, (4 + 20) / (40 + 1)))
    # With 5 steps of headroom each survivor needs 2 more pages: two victims leave 7 >= 4.
    plan = plan_retraction(cands, 3, PAGE, "length", steps=5)
    assert plan.victims == [0, 1] and plan.can_run


def test_a_victim_frees_only_its_own_pages_not_a_shared_cached_prefix():
    """Decode prefix cache: each request reads 1 shared cached page and owns 1. Counting
    the shared page as freed, one victim would seem to make room and the step would then
    run out of pages; counted right, two go."""
    shared = [RetractCandidate(k, 8, 1, 40, 2, None, num_own_pages=1) for k in range(4)]
    plan = plan_retraction(shared, 1, PAGE, "length", steps=1)
    # Each survivor needs 1 page; free 1 + 1 per victim (equal lengths: from the tail).
    assert plan.victims == [3, 2] and plan.can_run
    counted_whole = [RetractCandidate(k, 8, 1, 40, 2, None) for k in range(4)]
    assert plan_retraction(counted_whole, 1, PAGE, "length", steps=1).victims == [3]


def test_always_keeps_one_request():
    cands = [cand(0, 8, 1), cand(1, 8, 2, pages=3)]
    plan = plan_retraction(cands, 0, PAGE, "length")
    assert plan.victims == [0] and plan.can_run  # 2 pages freed; the survivor needs 0 now
    alone = [cand(0, 8, 1)]
    plan = plan_retraction(alone, 0, PAGE, "length")
    assert plan.victims == [] and not plan.can_run


def test_new_token_ratio_estimate_is_capped():
    assert retract_new_token_ratio([cand(0, 4, 10, max_new=20)]) == 1.0
    assert retract_new_token_ratio(
        [cand(0, 4, 10, max_new=200), cand(1, 4, 0, max_new=199)]
    ) == pytest.approx((10 + 40) / 400)


def test_new_token_ratio_decays_jumps_and_resets():
    ratio = NewTokenRatio(schedule_conservativeness=1.0)
    assert ratio.init == pytest.approx(0.7) and ratio.min == pytest.approx(0.7 * 0.14)
    assert ratio.decay == pytest.approx((0.7 - 0.098) / 600)
    ratio.on_decode_step()
    assert ratio.value == pytest.approx(0.7 - ratio.decay)
    for _ in range(1000):
        ratio.on_decode_step()
    assert ratio.value == pytest.approx(ratio.min)
    ratio.on_retract(0.9)
    assert ratio.value == 0.9
    ratio.on_idle()
    assert ratio.value == ratio.init
    assert NewTokenRatio(schedule_conservativeness=2.0).init == 1.0
