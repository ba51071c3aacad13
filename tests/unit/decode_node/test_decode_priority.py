"""Priority on the decode node: preemption of less urgent running requests (retracted to host
memory, resumed unchanged) and --schedule-conservativeness; the loopback P/D harness of
test_decode_scheduler.py."""

from __future__ import annotations

import pytest

from common import messages as msg
from decode_node.req import DecodeState
from tests.support.decode_harness import PD, assert_all_free, greedy, prompt, spy_transfer_requests
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


def test_a_high_priority_request_preempts_samples_of_one_group_and_they_resume_unchanged(
    model_dir, ref
):
    """Three priority-0 samples of one prompt (n = 3: the later two copied the first one's
    last page and share its whole pages) fill the pool; a priority-100 request preempts
    them: each moves only the pages it owns to host memory and resumes as if never
    preempted (seeded samples equal ungrouped runs of their seeds); every page is free after."""
    h = PD(
        model_dir, decode_pages=16, num_reserved_decode_tokens=4, enable_priority_scheduling=True
    )
    try:
        sent = spy_transfer_requests(h)
        ids = prompt(17, 64)  # 5 pages: 4 shared, the 5th copied per sample
        group = {"sample_group": "g", "num_group_samples": 3}
        seeded = {"temperature": 0.9, "max_new_tokens": 14}
        for i in range(3):
            h.submit(f"s{i}", 320 + i, ids, priority=0, seed=40 + i, **seeded, **group)
        h.run_until(
            lambda: all(
                f"s{i}" in h.decode.reqs and len(h.decode.reqs[f"s{i}"].output_ids) >= 4
                for i in range(3)
            )
        )
        # s1 waited for s0's transfer (the preemption check once admitted it anyway: it
        # received all 5 pages), then s1 and s2 copied the last page.
        assert sorted((held, dst) for _, held, dst in sent) == [(0, 5), (5, 0), (5, 0)]
        run_batch = h.decode._run_batch
        h.decode._run_batch = lambda: False  # type: ignore[method-assign]
        h.submit("high", 330, prompt(17, 65), priority=100, max_new_tokens=8)
        while h.state("high") in (None, DecodeState.PREALLOC):
            h.step()
        h.decode._run_batch = run_batch  # type: ignore[method-assign]
        assert h.decode.stats.num_preemptions >= 1
        samples = [f"s{i}" for i in range(3)]
        h.run_until(lambda: h.done("high", *samples), timeout=60)
        assert h.tokens("high") == greedy(ref, prompt(17, 65), 8)
        for i in range(3):
            h.submit(f"u{i}", 340 + i, ids, seed=40 + i, **seeded)
            h.run_until(lambda i=i: h.done(f"u{i}"), timeout=60)
            assert isinstance(h.result(f"s{i}"), msg.ReqFinished), i
            assert h.tokens(f"s{i}") == h.tokens(f"u{i}"), i
        assert_all_free(h)
    finally:
        h.close()
