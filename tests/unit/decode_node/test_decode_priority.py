"""Priority on the decode node: preemption of less urgent running requests (retracted to host
memory, resumed unchanged) and --schedule-conservativeness; the loopback P/D harness of
test_decode_scheduler.py."""

from __future__ import annotations

import pytest

from common import messages as msg
from decode_node.req import DecodeState
from tests.support.decode_harness import PD, assert_all_free, greedy, prompt
from transfer.kv_poll import KVPoll


def test_schedule_conservativeness_scales_the_new_token_ratio(model_dir):
    # SGLang's flag on the decode node: init = min(0.7 * conservativeness, 1), reported in
    # the node's load.
    for conservativeness, init in ((1.0, 0.7), (0.5, 0.35), (2.0, 1.0)):
        h = PD(model_dir, schedule_conservativeness=conservativeness)
        try:
            assert h.decode.new_token_ratio.init == pytest.approx(init)
            assert h.decode.load()["new_token_ratio"] == pytest.approx(init)
        finally:
            h.close()


def _fill_with_low_priority(h, ref_runner):
    """Two priority-0 requests that fill the 16-page pool when done; both decoding."""
    lows = {"low1": prompt(17, 61), "low2": prompt(17, 62)}
    for i, (rid, ids) in enumerate(lows.items()):
        h.submit(rid, 300 + i, ids, priority=0, max_new_tokens=12)
    # Counted on the decode node, not at the reply socket: replies can lag the steps on a
    # loaded machine, and the lows had then decoded to their end (CI saw no preemption).
    h.run_until(
        lambda: all(r in h.decode.reqs and len(h.decode.reqs[r].output_ids) >= 4 for r in lows)
    )
    return lows


def test_a_high_priority_request_preempts_low_ones_and_they_resume_unchanged(model_dir, ref):
    h = PD(
        model_dir, decode_pages=16, num_reserved_decode_tokens=4, enable_priority_scheduling=True
    )
    try:
        lows = _fill_with_low_priority(h, ref)
        high = prompt(17, 63)
        # The lows hold their pages while the high's handshake crosses the sockets: on a
        # loaded machine they once decoded to their end first, and nothing needed preempting.
        run_batch = h.decode._run_batch
        h.decode._run_batch = lambda: False  # type: ignore[method-assign]
        h.submit("high", 310, high, priority=100, max_new_tokens=8)
        waited_ready = 0
        while h.state("high") in (None, DecodeState.PREALLOC):
            r = h.decode.reqs.get("high")
            is_ready = (
                r is not None
                and r.receiver is not None
                and (r.receiver.poll() is KVPoll.WaitingForInput)
            )
            h.step()
            if is_ready:
                waited_ready += 1
        h.decode._run_batch = run_batch  # type: ignore[method-assign]
        assert waited_ready <= 1  # admitted in the step that saw it ready for pages
        assert h.decode.stats.num_preemptions >= 1
        h.run_until(lambda: h.done("high", *lows))
        assert h.tokens("high") == greedy(ref, high, 8)
        for rid, ids in lows.items():  # back from host memory, output as if never preempted
            assert h.tokens(rid) == greedy(ref, ids, 12), rid
            assert isinstance(h.result(rid), msg.ReqFinished)
        assert_all_free(h)
    finally:
        h.close()


@pytest.mark.parametrize(
    "extra",
    [{"disable_priority_preemption": True}, {"priority_scheduling_preemption_threshold": 100}],
)
def test_no_preemption_when_disabled_or_below_the_threshold(model_dir, ref, extra):
    h = PD(
        model_dir,
        decode_pages=16,
        num_reserved_decode_tokens=4,
        enable_priority_scheduling=True,
        **extra,
    )
    try:
        lows = _fill_with_low_priority(h, ref)
        h.submit("high", 310, prompt(17, 63), priority=100, max_new_tokens=8)
        h.run_until(lambda: h.done("high", *lows))
        assert h.decode.stats.num_preemptions == 0
        assert_all_free(h)
    finally:
        h.close()
