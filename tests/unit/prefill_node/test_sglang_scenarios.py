"""SGLang's unit-test scenarios for its schedule policy, PrefillAdder and priority preemption,
re-expressed against pdserve's API (prefill-node ordering and admission; preemption on the
decode node). Each test names the SGLang test it re-expresses; where pdserve differs on
purpose or in fact, the test asserts pdserve's behaviour and the comment says how."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from common.kv_pool import PageAllocator
from common.radix_cache import RadixCache
from decode_node.prealloc_queue import BudgetReq, DecodeBudget
from decode_node.preemption import is_more_urgent_by, plan_preemption
from decode_node.retract import RetractCandidate
from prefill_node.prefill_adder import AddReqResult, PrefillAdder
from prefill_node.request import Req
from prefill_node.schedule_policy import CacheAgnosticPolicy, CacheAwarePolicy, SchedulePolicy

PAGE = 2


# --- helpers ----------------------------------------------------------------------------------
def mk(rid: str, tokens: list[int] | None = None, **kw) -> Req:
    kw.setdefault("max_new_tokens", 16)
    return Req(rid, 0, tokens if tokens is not None else [7], **kw)


def order(queue: list[Req]) -> list[str]:
    return [r.rid for r in queue]


def flagged(queue: list[Req]) -> list[str]:
    return [r.rid for r in queue if r.is_deprioritized]


def new_tree(page_size: int = PAGE) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(4096)
    return RadixCache(page_size, alloc), alloc


def prefill_into(tree: RadixCache, alloc: PageAllocator, tokens: list[int]) -> None:
    """Cache ``tokens`` as a finished prefill would, freeing what the tree does not keep."""
    page = tree.page_size
    own = tree.match_prefix(tokens).page_ids
    pages = own + alloc.allocate(-(-len(tokens) // page) - len(own))
    num_present = tree.insert(tokens, pages) // page
    alloc.free(pages[len(own) : num_present] + pages[len(tokens) // page :])


def prio_policy(name: str, low_first: bool) -> SchedulePolicy:
    return SchedulePolicy(
        name, None, enable_priority_scheduling=True, schedule_low_priority_values_first=low_first
    )


# --- policy validation and fallback -----------------------------------------------------------
# SGLang test_schedule_policy.py: test_init_with_cache_aware_policy, ..._cache_agnostic_policy,
# test_init_with_unknown_policy, test_init_with_disabled_cache.
def test_policy_validation_and_fallback_without_a_radix_cache():
    tree, _ = new_tree()
    assert SchedulePolicy("lpm", tree).policy is CacheAwarePolicy.LPM
    assert SchedulePolicy("fcfs", tree).policy is CacheAgnosticPolicy.FCFS
    with pytest.raises(ValueError):
        SchedulePolicy("invalid", tree)
    # A disabled radix cache is None here: cache-aware policies run as fcfs ...
    for name in ("lpm", "dfs-weight", "hrrn"):
        assert SchedulePolicy(name, None).policy is CacheAgnosticPolicy.FCFS
    # ... except shortest-prefill-first (pdserve only; SGLang has no such policy).
    with pytest.raises(ValueError):
        SchedulePolicy("shortest-prefill-first", None)


# SGLang test_schedule_policy.py: test_init_with_disabled_cache (the fallback, applied to a queue).
# pdserve's fcfs fallback keeps the queue order, whatever the prompts' cache matches.
def test_lpm_without_a_cache_keeps_queue_order():
    queue = [mk("1", [1, 2]), mk("3", [1, 2, 3]), mk("2", [1])]
    result = SchedulePolicy("lpm", None).calc_priority(queue)
    assert order(queue) == ["1", "3", "2"] and result.policy == "fcfs"


# --- fcfs and lof, with priority in both signs ------------------------------------------------
# SGLang test_schedule_policy.py: test_calc_priority_fcfs.
def test_fcfs_keeps_the_original_order():
    tree, _ = new_tree()
    queue = [mk("1", [1, 2]), mk("3", [1, 2, 3]), mk("2", [1])]
    SchedulePolicy("fcfs", tree).calc_priority(queue)
    assert order(queue) == ["1", "3", "2"]


# SGLang test_schedule_policy.py: test_calc_priority_priority_enabled_fcfs_scheduling and
# test_calc_priority_priority_enabled_fcfs_scheduling_with_low_priority_values_first.
@pytest.mark.parametrize(("low_first", "top"), [(False, 1), (True, -1)])
def test_fcfs_priority_first_then_entry_time(low_first: bool, top: int):
    queue = [
        mk("1", [1, 2], priority=top, wait_queue_entry_time=1.0),
        mk("3", [1, 2, 3], priority=0, wait_queue_entry_time=1.0),
        mk("2", [1], priority=0, wait_queue_entry_time=0.0),
    ]
    prio_policy("fcfs", low_first).calc_priority(queue)
    assert order(queue) == ["1", "2", "3"]


# SGLang test_schedule_policy.py: the priority-enabled fcfs tests, with a request that has no
# priority (SGLang gives it the least urgent default value; pdserve keeps None and sorts it
# after every explicit priority, in entry-time order).
@pytest.mark.parametrize("low_first", [False, True])
def test_fcfs_requests_without_priority_come_after_every_explicit_one(low_first: bool):
    least = 1000 if low_first else -1000  # the least urgent explicit value
    queue = [
        mk("none-first", wait_queue_entry_time=0.0),
        mk("least", priority=least, wait_queue_entry_time=5.0),
        mk("none-second", wait_queue_entry_time=1.0),
        mk("zero", priority=0, wait_queue_entry_time=4.0),
    ]
    prio_policy("fcfs", low_first).calc_priority(queue)
    assert order(queue) == ["zero", "least", "none-first", "none-second"]


# SGLang test_schedule_policy.py: test_calc_priority_longest_output_first_scheduling.
def test_lof_longest_output_first():
    tree, _ = new_tree()
    queue = [
        mk("1", [1, 2], max_new_tokens=1000),
        mk("3", [1, 2, 3], max_new_tokens=10),
        mk("2", [1], max_new_tokens=100),
    ]
    SchedulePolicy("lof", tree).calc_priority(queue)
    assert order(queue) == ["1", "2", "3"]


# SGLang test_schedule_policy.py: test_calc_priority_priority_enabled_longest_output_first_
# scheduling and its _with_low_priority_values_first variant.
@pytest.mark.parametrize(("low_first", "prios"), [(False, (1, 0, 0)), (True, (0, 1, 1))])
def test_lof_priority_first_then_longest_output(low_first: bool, prios: tuple[int, ...]):
    specs = [("1", [1, 2], 1), ("3", [1, 2, 3], 10), ("2", [1], 100)]
    queue = [
        mk(rid, toks, max_new_tokens=m, priority=p)
        for (rid, toks, m), p in zip(specs, prios, strict=True)
    ]
    prio_policy("lof", low_first).calc_priority(queue)
    assert order(queue) == ["1", "2", "3"]


# SGLang test_schedule_policy.py: the priority-enabled lof tests, with a request without a
# priority: after every explicit one, however long its output.
@pytest.mark.parametrize("low_first", [False, True])
def test_lof_requests_without_priority_come_last(low_first: bool):
    queue = [
        mk("none-long", max_new_tokens=5000),
        mk("p-short", priority=3, max_new_tokens=1),
        mk("none-short", max_new_tokens=2),
        mk("p-long", priority=3, max_new_tokens=900),
    ]
    prio_policy("lof", low_first).calc_priority(queue)
    assert order(queue) == ["p-long", "p-short", "none-long", "none-short"]


# --- routing key ------------------------------------------------------------------------------
# SGLang test_schedule_policy.py: test_calc_priority_routing_key_scheduling (by frequency).
def test_routing_key_most_frequent_key_in_the_running_batch_first():
    running = [mk(f"r{i}", routing_key=k) for i, k in enumerate(["key_a", "key_a", "key_b"])]
    queue = [mk(f"w{i + 1}", routing_key=k) for i, k in enumerate(["key_b", "key_a", "key_c"])]
    # A running batch object with .reqs, as SGLang passes its ScheduleBatch.
    SchedulePolicy("routing-key", None).calc_priority(queue, SimpleNamespace(reqs=running))
    assert order(queue) == ["w2", "w1", "w3"]


# SGLang test_schedule_policy.py: test_calc_priority_routing_key_tie_break_by_lexicographic_order.
def test_routing_key_tie_broken_by_key_order():
    running = [mk("r1", routing_key="key_b"), mk("r2", routing_key="key_a")]
    queue = [mk("w1", routing_key="key_b"), mk("w2", routing_key="key_a")]
    SchedulePolicy("routing-key", None).calc_priority(queue, running)
    assert order(queue) == ["w2", "w1"]


# SGLang test_schedule_policy.py: test_calc_priority_routing_key_no_match_deprioritized.
def test_routing_key_unmatched_keys_come_after_matched_ones():
    running = [mk(f"r{i}", routing_key=k) for i, k in enumerate(["key_a", "key_b", "key_c"])]
    queue = [mk(f"w{i + 1}", routing_key=k) for i, k in enumerate(["key_d", "key_e", "key_c"])]
    SchedulePolicy("routing-key", None).calc_priority(queue, running)
    assert order(queue) == ["w3", "w1", "w2"]


# SGLang test_schedule_policy.py: test_calc_priority_routing_key_empty_running_batch.
def test_routing_key_empty_running_batch_keeps_order():
    queue = [mk(f"w{i + 1}", routing_key=k) for i, k in enumerate(["key_c", "key_a", "key_b"])]
    SchedulePolicy("routing-key", None).calc_priority(queue, SimpleNamespace(reqs=[]))
    assert order(queue) == ["w1", "w2", "w3"]


# --- lpm and re-matching ----------------------------------------------------------------------
def _lpm_tree_and_queue() -> tuple[RadixCache, PageAllocator, list[Req]]:
    tree, alloc = new_tree(page_size=1)
    prompts = {f"w{b}": [b] + list(range(100, 100 + 20 * (b + 1))) for b in range(5)}
    for tokens in prompts.values():
        prefill_into(tree, alloc, tokens)
    return tree, alloc, [mk(rid, tokens) for rid, tokens in prompts.items()]


# SGLang test_schedule_policy.py: TestEpochMemoizedMatch.test_calc_priority_identical_on_
# unchanged_tree (same order and match lengths on a second round over an unchanged tree).
def test_lpm_same_order_and_matches_on_an_unchanged_tree():
    tree, _, queue = _lpm_tree_and_queue()
    policy = SchedulePolicy("lpm", tree)
    first = policy.calc_priority(queue)
    assert order(queue) == ["w4", "w3", "w2", "w1", "w0"]
    assert [r.prefix_len for r in queue] == [101, 81, 61, 41, 21]  # whole prompts cached
    assert first.num_new_matches == 5
    again = policy.calc_priority(queue)
    assert order(queue) == ["w4", "w3", "w2", "w1", "w0"]
    assert [r.prefix_len for r in queue] == [101, 81, 61, 41, 21]
    assert (again.num_new_matches, again.num_rematches) == (0, 0)


# SGLang test_schedule_policy.py: TestEpochMemoizedMatch.test_memo_invalidated_after_mutation
# (an insert that extends a waiting request's prefix is seen by the next round).
def test_lpm_request_moves_up_once_its_prefix_gets_cached():
    tree, alloc, queue = _lpm_tree_and_queue()
    late = [9] + list(range(100, 220))  # 121 tokens, nothing cached yet
    queue.append(mk("late", late))
    policy = SchedulePolicy("lpm", tree)
    policy.calc_priority(queue)
    assert order(queue) == ["w4", "w3", "w2", "w1", "w0", "late"]
    prefill_into(tree, alloc, late[:-1])  # another request cached all but its last token
    result = policy.calc_priority(queue)
    assert result.num_rematches == 1
    assert order(queue) == ["late", "w4", "w3", "w2", "w1", "w0"]
    assert queue[0].prefix_len == 120


# SGLang schedule_policy.py's lpm key (no dedicated SGLang test): the match counted is that of
# the prompt less its last token, which is always computed. A fully cached 10-token prompt
# ranks by 9 tokens, behind an 11-token prompt whose first 10 are cached.
def test_lpm_ranks_by_the_prompt_less_its_last_token():
    tree, alloc = new_tree(page_size=1)
    prefill_into(tree, alloc, list(range(10)))
    queue = [mk("whole", list(range(10))), mk("plus-one", list(range(10)) + [77])]
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert order(queue) == ["plus-one", "whole"]
    assert [r.prefix_len for r in queue] == [10, 10]


# --- in-batch prefix dedup --------------------------------------------------------------------
# SGLang schedule_policy.py _compute_prefix_matches (defaults 32/32; no dedicated SGLang unit
# test): of two requests sharing an uncached prefix of at least the deprioritize threshold, the
# second is deprioritized (and sorted last) when its own cached match is at most the check
# threshold. SGLang compares "<= check" and ">= deprioritize"; so does pdserve.
@pytest.mark.parametrize(
    ("num_shared", "expected"),
    [(40, ["b"]), (32, ["b"]), (31, [])],  # longer than, equal to, shorter than 32
)
def test_dedup_flags_the_second_sharer_by_shared_length(num_shared: int, expected: list[str]):
    tree, _ = new_tree()
    shared = list(range(500, 500 + num_shared))
    queue = [mk("a", shared + [1, 1]), mk("b", shared + [2, 2]), mk("c", list(range(9, 19)))]
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert flagged(queue) == expected
    assert order(queue) == (["a", "c", "b"] if expected else ["a", "b", "c"])


@pytest.mark.parametrize(
    ("num_cached", "expected"),
    [(32, ["b"]), (34, [])],  # a cached match at the check threshold is checked; above, not
)
def test_dedup_skips_requests_whose_cached_match_exceeds_the_check_threshold(
    num_cached: int, expected: list[str]
):
    tree, alloc = new_tree()
    shared = list(range(500, 540))  # 40 tokens shared by both requests
    prefill_into(tree, alloc, shared[:num_cached])
    queue = [mk("a", shared + [1, 1]), mk("b", shared + [2, 2])]
    SchedulePolicy("lpm", tree).calc_priority(queue)
    assert [r.prefix_len for r in queue] == [num_cached, num_cached]
    assert flagged(queue) == expected


def test_dedup_thresholds_are_configurable():
    tree, _ = new_tree()
    shared = list(range(500, 512))  # 12 shared tokens: below the default 32
    queue = [mk("a", shared + [1]), mk("b", shared + [2])]
    policy = SchedulePolicy("lpm", tree, in_batch_prefix_caching_deprioritize_threshold=12)
    policy.calc_priority(queue)
    assert flagged(queue) == ["b"]
    cold = [mk("a", list(range(50, 90))), mk("b", list(range(50, 90)))]
    SchedulePolicy("lpm", tree, in_batch_prefix_caching_check_threshold=-1).calc_priority(cold)
    assert flagged(cold) == []  # a negative check threshold disables dedup


# SGLang schedule_policy.py dfs-weight (no dedicated SGLang test): SGLang computes the
# deprioritized set under dfs-weight but its DFS ignores it, so [a1, a2, b] stays as is.
# pdserve by default applies the dedup there too (a2 goes last); dfs_weight_dedup=False
# restores SGLang's order and sets no flags.
def test_dfs_weight_dedup_on_by_default_and_sglang_order_when_off():
    tree, _ = new_tree()
    cold = list(range(800, 840))
    specs = [("a1", cold + [1, 1]), ("a2", cold + [2, 2]), ("b", [5, 6, 7, 8])]
    on = [mk(rid, toks) for rid, toks in specs]
    SchedulePolicy("dfs-weight", tree).calc_priority(on)
    assert order(on) == ["a1", "b", "a2"] and flagged(on) == ["a2"]
    off = [mk(rid, toks) for rid, toks in specs]
    SchedulePolicy("dfs-weight", tree, dfs_weight_dedup=False).calc_priority(off)
    assert order(off) == ["a1", "a2", "b"] and flagged(off) == []


# --- PrefillAdder: mixed-chunk budgets --------------------------------------------------------
def mixed_adder(page_size: int, num_decode: int) -> PrefillAdder:
    # SGLang's adder takes the running batch's decode tokens out of the budgets itself
    # (num_mixed_decode_tokens: one token each off rem_input and rem_chunk, plus each decode
    # request's max_new_tokens=50 into the offset). A pdserve prefill node mixes no decode, so
    # the same budgets are passed in: 200 - n input, 64 - n chunk, n + 50 n reserved.
    return PrefillAdder(
        page_size,
        1000,
        None,
        max_prefill_tokens=200 - num_decode,
        chunked_prefill_size=64 - num_decode,
        running_reserved_tokens=num_decode + 50 * num_decode,
    )


def prompt(rid: str, n: int, max_new: int) -> Req:
    return Req(rid, 0, list(range(n)), max_new_tokens=max_new)


# SGLang test_prefill_adder.py: TestPrefillAdder.test_mixed_chunk_prefill_budgets (page size 1,
# as there): with 8 decode requests a 56-token prompt uses the 56 chunk tokens left, whole.
def test_mixed_chunk_56_tokens_exactly_fill_56_left():
    adder = mixed_adder(1, num_decode=8)
    assert (adder.rem_input_tokens, adder.rem_chunk_tokens) == (192, 56)
    assert adder.rem_total_tokens == 1000 - 408
    assert adder.budget_state() is AddReqResult.CONTINUE
    assert adder.add_one_req(prompt("req1", 56, 64), 0) is AddReqResult.OTHER
    assert [(c.req.rid, c.start, c.end) for c in adder.can_run_list] == [("req1", 0, 56)]
    assert (adder.rem_chunk_tokens, adder.rem_input_tokens) == (0, 136)
    assert adder.new_chunked_req is None
    # pdserve charges one more page per admission than SGLang (56 + 64 + 1, SGLang 56 + 64).
    assert adder.rem_total_tokens == 1000 - 408 - 121


# SGLang test_prefill_adder.py: TestPrefillAdder.test_mixed_chunk_prefill_budgets, second half:
# 5 decode requests leave 59 chunk tokens; the 56-token prompt leaves 3, then a 3-token one
# uses them up.
def test_mixed_chunk_56_tokens_with_59_left_then_3_more():
    adder = mixed_adder(1, num_decode=5)
    assert (adder.rem_input_tokens, adder.rem_chunk_tokens) == (195, 59)
    assert adder.rem_total_tokens == 1000 - 255
    assert adder.add_one_req(prompt("req2", 56, 64), 0) is AddReqResult.CONTINUE
    assert adder.rem_chunk_tokens == 3
    assert adder.add_one_req(prompt("req3", 3, 16), 0) is AddReqResult.OTHER
    assert [c.req.rid for c in adder.can_run_list] == ["req2", "req3"]
    assert adder.rem_chunk_tokens == 0 and adder.new_chunked_req is None


# SGLang test_prefill_adder.py: TestPrefillAdder.test_mixed_chunk_prefill_budgets at a page
# size of 16. Here pdserve differs: SGLang compares the page-rounded extend (64) with the chunk
# budget left (56 or 59), so it chunks the prompt to 56 // 16 * 16 = 48 tokens (it becomes
# new_chunked_req, 8 or 11 chunk tokens left); pdserve compares the raw extend (56), admits it
# whole and takes 56 off the chunk budget (0 or 3 left; the 3 then fit a 3-token prompt).
@pytest.mark.parametrize(
    ("num_decode", "result", "left"), [(8, AddReqResult.OTHER, 0), (5, AddReqResult.CONTINUE, 3)]
)
def test_mixed_chunk_at_page_16_admits_56_tokens_whole(
    num_decode: int, result: AddReqResult, left: int
):
    adder = mixed_adder(16, num_decode)
    assert adder.add_one_req(prompt("req", 56, 64), 0) is result
    assert [(c.start, c.end) for c in adder.can_run_list] == [(0, 56)]
    assert adder.new_chunked_req is None and adder.rem_chunk_tokens == left
    if left:
        assert adder.add_one_req(prompt("tail", 3, 16), 0) is AddReqResult.OTHER
        assert [c.req.rid for c in adder.can_run_list] == ["req", "tail"]


# --- priority preemption (decode node) --------------------------------------------------------
# SGLang's PrefillAdder.preempt_to_schedule runs on its (colocated) prefill path; in pdserve
# the decode node preempts. The SGLang scenario: three running requests holding 50, 75 and 100
# tokens at priorities 0, 1, 2, a full pool, and a newcomer needing 49 tokens. Here each token
# is a page (page size 1), the reserve per request is 0, and the newcomer's 49 tokens are its
# prompt, whose KV arrives from the prefill node.
RUN = [("run1", 0, 50), ("run2", 1, 75), ("run3", 2, 100)]


def running(specs: list[tuple[str, int, int]]) -> list[RetractCandidate]:
    return [RetractCandidate(i, n, 0, 1, n, p) for i, (_, p, n) in enumerate(specs)]


def full_pool(cands: list[RetractCandidate], free: int = 0) -> DecodeBudget:
    reqs = [BudgetReq(c.num_input_tokens, c.num_output_tokens, c.max_new_tokens) for c in cands]
    return DecodeBudget(1, free, 0, len(cands), running=reqs)


def preempt(
    specs: list[tuple[str, int, int]],
    need: int,
    prio: int,
    low_first: bool,
    threshold: int = 0,
    free: int = 0,
) -> list[str] | None:
    """Names of the running requests to retract for a newcomer of ``need`` prompt tokens."""
    cands = running(specs)
    keys = plan_preemption(
        BudgetReq(need, 0, 1), prio, cands, full_pool(cands, free), threshold, low_first
    )
    return None if keys is None else [specs[k][0] for k in keys]


# SGLang's threshold test is strict (priority gap > threshold), and so is pdserve's.
def test_preemption_threshold_is_strict_as_sglangs():
    # Threshold 10: a gap of exactly 10 does not preempt, 11 does.
    assert not is_more_urgent_by(20, 10, 10, low_values_first=False)
    assert is_more_urgent_by(21, 10, 10, low_values_first=False)
    assert not is_more_urgent_by(0, 10, 10, low_values_first=True)
    assert is_more_urgent_by(-1, 10, 10, low_values_first=True)
    assert not is_more_urgent_by(1, 1, 0, low_values_first=False)  # equal never preempts


# SGLang test_prefill_adder.py: TestPrefillAdder.test_preempt_success_high_priority_values_first.
def test_preempt_success_high_priority_values_first():
    assert preempt(RUN, 49, prio=1, low_first=False) == ["run1"]


# SGLang test_prefill_adder.py: TestPrefillAdder.test_preempt_success_low_priority_values_first.
def test_preempt_success_low_priority_values_first():
    assert preempt(RUN, 49, prio=1, low_first=True) == ["run3"]


# SGLang test_prefill_adder.py: TestPrefillAdder.test_preempt_fail_low_priority_values_first.
def test_preempt_fail_low_priority_values_first():
    assert preempt(RUN, 49, prio=2, low_first=True) is None  # no one is less urgent than 2
    assert preempt(RUN, 110, prio=1, low_first=True) is None  # run3's 100 are not enough


# SGLang test_prefill_adder.py: TestPrefillAdder.test_preempt_fail_high_priority_values_first.
def test_preempt_fail_high_priority_values_first():
    assert preempt(RUN, 49, prio=0, low_first=False) is None  # no one is less urgent than 0
    assert preempt(RUN, 110, prio=-1, low_first=False) is None


# SGLang test_prefill_adder.py: TestPrefillAdder.test_preempt_skip_already_preempted_request.
# plan_preemption keeps no state: the caller passes the running requests minus those already
# retracted, and run1's 50 freed pages. Only run1 was less urgent, so nothing is left to take.
def test_preempt_skips_an_already_preempted_request():
    assert preempt(RUN, 49, prio=1, low_first=False) == ["run1"]
    assert preempt(RUN[1:], 76, prio=1, low_first=False, free=50) is None
    assert preempt(RUN[1:], 50, prio=1, low_first=False, free=50) == []  # fits as it is


FIVE = [*RUN, ("run4", 2, 125), ("run5", 2, 125)]


# SGLang test_prefill_adder.py: TestPrefillAdder.test_preempt_success_low_priority_values_first_
# exact_once. Both preempt one request, but not the same one: among equal priorities SGLang
# takes the latest to enter the queue (here all tie, so run3, first in the list); pdserve
# takes them in retraction order (fewest outputs, then the longest prompt, and the later one
# of full ties), so run5, the 125-token twin listed last.
def test_preempt_exactly_one_low_priority_values_first():
    assert preempt(FIVE, 75, prio=1, low_first=True) == ["run5"]


# SGLang test_prefill_adder.py: TestPrefillAdder.test_preempt_success_low_priority_values_first_
# exact_twice. SGLang takes run3 and run4 (100 + 125 >= 200); pdserve run5 and run4 (250).
def test_preempt_exactly_two_low_priority_values_first():
    assert preempt(FIVE, 200, prio=1, low_first=True) == ["run5", "run4"]
