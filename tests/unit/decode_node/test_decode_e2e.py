"""Prefill loop + decode loop end to end: concurrent greedy requests under KV pressure on decode.

Real PrefillScheduler (radix cache, chunked prefill) and DecodeScheduler joined by the
loopback backend; a decode pool small enough that requests get retracted to host memory
and resumed. Every output must equal a single-request greedy run, and both nodes must end
holding no page for any request.
"""

from __future__ import annotations

import pytest

from common import messages as msg
from tests.support.decode_harness import (
    PAGE,
    PD,
    greedy,
    prompt,
)


def _workload():
    shared = prompt(12, 99)  # a prefix some requests share: served from prefill's radix cache
    return [
        ("a", shared + prompt(9, 1), 30, 3),
        ("b", prompt(26, 2), 22, 1),
        ("c", shared + prompt(3, 3), 28, None),
        ("d", prompt(7, 4), 34, 2),
        ("e", prompt(19, 5), 18, 5),
        ("f", shared + prompt(14, 6), 26, 1),
    ]


@pytest.mark.parametrize("policy", ["length", "priority"])
def test_concurrent_requests_with_retraction_match_single_request_greedy(model_dir, ref, policy):
    extra = {"enable_priority_scheduling": True} if policy == "priority" else {}
    h = PD(
        model_dir,
        decode_pages=28,
        num_reserved_decode_tokens=4,
        retraction_policy=policy,
        prefill_cfg={"chunked_prefill_size": 16, "max_prefill_tokens": 32},
        **extra,
    )
    try:
        work = _workload()
        for i, (rid, ids, max_new, priority) in enumerate(work):
            h.submit(rid, 500 + i, ids, max_new_tokens=max_new, priority=priority)
            h.step()  # staggered arrivals
        rids = [w[0] for w in work]
        h.run_until(lambda: h.done(*rids), timeout=60)
        assert h.decode.stats.num_retractions > 0 and h.max_batch >= 3
        for rid, ids, max_new, _ in work:
            end = h.result(rid)
            assert isinstance(end, msg.ReqFinished), (rid, end)
            assert (end.finish_reason, end.num_output_tokens) == ("length", max_new)
            assert h.tokens(rid) == greedy(ref, ids, max_new), rid
        # Decode: nothing used, nothing held, no host copy, no receiver left.
        h.decode.check_integrity()
        assert h.runner.pool.allocator.num_used_pages == 0
        assert h.decode.stats.num_held_pages() == 0 and len(h.decode.retracted_queue.host) == 0
        assert not h.dkv.receivers
        # Prefill: no request holds a page; what is used is the radix cache's.
        h.prefill.check_integrity()
        assert not h.prefill.states and h.prefill.stats.num_held_pages() == 0
        assert h.prefill_runner.pool.allocator.num_used_pages == h.prefill.tree.total_size() // PAGE
        assert not h.pkv.senders
    finally:
        h.close()
