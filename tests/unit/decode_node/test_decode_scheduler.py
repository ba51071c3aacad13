"""The decode loop in one process: the real prefill loop, loopback KV transfer, tiny Llama
(the harness: tests/support/decode_harness.py)."""

from __future__ import annotations

import math

from common import messages as msg
from decode_node.req import DecodeState
from tests.support.decode_harness import (
    LEASE_S,
    PD,
    SMALL_CHUNKS,
    FakeTokenizer,
    UnsafeReceiver,
    assert_all_free,
    greedy,
    prompt,
)


def test_one_request_streams_the_prefill_token_then_decodes_greedily(pd, ref):
    ids = prompt(13, 1)
    pd.submit("a", 1, ids, max_new_tokens=10)
    pd.run_until(lambda: pd.done("a"))
    assert pd.tokens("a") == greedy(ref, ids, 10)
    end = pd.result("a")
    assert isinstance(end, msg.ReqFinished) and end.finish_reason == "length"
    assert (end.num_prompt_tokens, end.num_output_tokens, end.matched_stop) == (13, 10, None)
    assert all(len(m.token_ids) == 1 for m in pd.replies["a"] if isinstance(m, msg.TokenChunk))
    assert_all_free(pd)


def test_retracted_requests_resume_from_host_memory_with_identical_output(model_dir, ref):
    # 3 requests of 17 + 24 tokens (at most 11 pages each) in a pool of 20 pages.
    h = PD(model_dir, decode_pages=20, num_reserved_decode_tokens=4)
    try:
        prompts = {f"r{i}": prompt(17, 10 + i) for i in range(3)}
        for i, (rid, ids) in enumerate(prompts.items()):
            h.submit(rid, 100 + i, ids, max_new_tokens=24)
        h.run_until(lambda: h.done(*prompts))
        assert h.decode.stats.num_retractions > 0
        for rid, ids in prompts.items():
            assert h.tokens(rid) == greedy(ref, ids, 24), rid
            assert isinstance(h.result(rid), msg.ReqFinished)
        assert h.max_batch >= 2
        assert_all_free(h)
        assert len(h.decode.retracted_queue.host) == 0
    finally:
        h.close()


def test_abort_in_every_queue_gives_every_page_back(model_dir):
    h = PD(model_dir, decode_pages=24, max_running_requests=1, num_reserved_decode_tokens=4)
    try:
        free_at_start = h.runner.pool.allocator.num_free_pages
        # prealloc: the prefill node never answers the handshake.
        h.is_prefill_paused = True
        h.submit("pre", 1, prompt(9, 1), to_prefill=False)
        h.run_until(lambda: h.state("pre") is DecodeState.PREALLOC)
        h.decode.abort("pre", None, "client went away")
        h.is_prefill_paused = False
        # transfer: pages sent to a prefill node that never got the request, so it never
        # asked for (nor got) a lease grant and cannot write: the pages come back at once.
        h.submit("xfer", 2, prompt(9, 2), to_prefill=False)
        h.run_until(lambda: h.state("xfer") is DecodeState.TRANSFER)
        held = h.decode.stats.num_held_pages()
        h.decode.abort(None, 2, "client went away")  # by room
        h.step()
        assert held > 0 and h.decode.stats.num_held_pages() == 0
        assert h.runner.pool.allocator.num_free_pages == free_at_start
        # running, and waiting behind it (max_running_requests=1).
        h.submit("run", 3, prompt(9, 3), max_new_tokens=40)
        h.run_until(lambda: h.state("run") is DecodeState.RUNNING)
        h.submit("wait", 4, prompt(9, 4), max_new_tokens=40)
        h.run_until(lambda: h.state("wait") is DecodeState.WAITING)
        assert h.state("run") is DecodeState.RUNNING
        h.decode.abort("wait", None, "client went away")
        h.step()
        h.decode.abort("run", None, "client went away")
        # retracted: two requests that outgrow the pool together.
        h.decode.running.max_running_requests = 2
        for i in range(2):
            h.submit(f"big{i}", 10 + i, prompt(20, 10 + i), max_new_tokens=40)
        h.run_until(lambda: h.decode.retracted_queue)
        victim = h.decode.retracted_queue[0].rid
        assert victim in h.decode.retracted_queue.host
        h.decode.abort(victim, None, "client went away")
        assert victim not in h.decode.retracted_queue.host
        other = "big1" if victim == "big0" else "big0"
        h.decode.abort(other, None, "client went away")
        rids = ("pre", "xfer", "run", "wait", "big0", "big1")
        h.run_until(lambda: not h.prefill.states and h.done(*rids))
        for rid in rids:
            end = h.result(rid)
            assert isinstance(end, msg.ReqFailed) and end.status == 499, rid
            assert "aborted" in end.error
        assert h.runner.pool.allocator.num_free_pages == free_at_start
        assert_all_free(h)
        assert not h.dkv.receivers and len(h.decode.retracted_queue.host) == 0
    finally:
        h.close()


def test_abort_mid_transfer_waits_for_the_prefill_ack(model_dir):
    h = PD(model_dir, prefill_cfg=SMALL_CHUNKS)
    try:
        ids = prompt(37, 5)
        h.submit("a", 1, ids)
        h.run_until(lambda: h.prefill.chunked is not None and h.state("a") is DecodeState.TRANSFER)
        h.decode.abort("a", None, "client went away")
        # The prefill node stops writing and acknowledges; the pages come back without waiting
        # for any lease.
        h.run_until(
            lambda: h.decode.stats.num_held_pages() == 0 and not h.prefill.states, timeout=LEASE_S
        )
        assert any(isinstance(m, msg.ReqFailed) and m.status == 499 for m in h.replies["a"])
        assert_all_free(h)
    finally:
        h.close()


def test_prefill_failure_ends_the_request_with_a_clear_error(model_dir):
    h = PD(model_dir, prefill_cfg=SMALL_CHUNKS)
    try:
        h.submit("a", 7, prompt(37, 7))
        h.run_until(lambda: h.prefill.chunked is not None and h.state("a") is DecodeState.TRANSFER)
        h.prefill.abort("a", None, "prefill node is shutting down")
        h.run_until(lambda: h.done("a"), timeout=LEASE_S)
        end = h.result("a")
        assert isinstance(end, msg.ReqFailed) and end.status == 500
        assert (
            "KV transfer from the prefill node failed" in end.error and "shutting down" in end.error
        )
        assert_all_free(h)
    finally:
        h.close()


def test_bad_requests_are_refused_with_a_status(model_dir):
    h = PD(model_dir, decode_pages=32)  # 128 tokens
    try:
        h.submit("long", 1, [1] * 300, to_prefill=False)
        h.submit("temp", 2, [1] * 5, temperature=-1.0, to_prefill=False)
        h.submit("who", 3, [1] * 5, prefill_node="nobody", to_prefill=False)
        h.submit("pool", 4, [1] * 100, max_new_tokens=50, to_prefill=False)
        rids = ("long", "temp", "who", "pool")
        h.run_until(lambda: h.done(*rids))
        ends = {rid: h.result(rid) for rid in rids}
        assert all(isinstance(e, msg.ReqFailed) for e in ends.values())
        assert ends["long"].status == 400 and "context length" in ends["long"].error
        assert ends["temp"].status == 400 and "temperature" in ends["temp"].error
        assert ends["who"].status == 503 and "nobody" in ends["who"].error
        assert ends["pool"].status == 400 and "KV pool" in ends["pool"].error
        assert_all_free(h)
    finally:
        h.close()


def test_output_is_clipped_to_the_context_and_duplicates_are_refused(pd):
    pd.submit("huge", 1, [1] * 100, max_new_tokens=200)  # 300 tokens > 256 of context
    pd.run_until(lambda: "huge" in pd.decode.reqs)
    pd.submit("huge", 2, [2] * 5, to_prefill=False)  # a live duplicate rid
    pd.run_until(lambda: any(isinstance(m, msg.ReqFailed) for m in pd.replies["huge"]))
    assert "duplicate" in pd.result("huge").error
    pd.run_until(lambda: isinstance(pd.result("huge"), msg.ReqFinished), timeout=60)
    assert len(pd.tokens("huge")) == 256 - 100
    assert pd.result("huge").finish_reason == "length"
    assert_all_free(pd)


def test_queue_limit_answers_503(model_dir):
    h = PD(model_dir, max_queued_requests=1)
    try:
        h.is_prefill_paused = True
        h.submit("a", 1, prompt(5, 1))
        h.submit("b", 2, prompt(5, 2), to_prefill=False)
        h.run_until(lambda: h.done("b"))
        assert h.result("b").status == 503 and "queue is full" in h.result("b").error
        h.is_prefill_paused = False
        h.run_until(lambda: h.done("a"))
    finally:
        h.close()


def test_stop_conditions(model_dir, ref):
    ids = prompt(10, 3)
    expect = greedy(ref, ids, 12)
    eos = expect[4]
    first_eos = expect.index(eos)
    h = PD(model_dir, tokenizer=FakeTokenizer(eos=[eos]))
    try:
        h.submit("eos", 1, ids, max_new_tokens=12)
        h.submit("ignore", 2, ids, max_new_tokens=12, ignore_eos=True)
        h.submit("stop_id", 3, ids, max_new_tokens=12, ignore_eos=True, stop_token_ids=[expect[6]])
        text = FakeTokenizer().decode(expect)
        h.submit("stop_str", 4, ids, max_new_tokens=12, ignore_eos=True, stop=[text[7:9]])
        h.submit("first", 5, ids, max_new_tokens=1)
        h.submit("zero", 6, ids, max_new_tokens=0)
        h.run_until(lambda: h.done("eos", "ignore", "stop_id", "stop_str", "first", "zero"))
        end = h.result("eos")
        assert (end.finish_reason, end.matched_stop) == ("stop", eos)
        assert h.tokens("eos") == expect[: first_eos + 1]
        assert h.tokens("ignore") == expect and h.result("ignore").finish_reason == "length"
        n = expect.index(expect[6]) + 1
        assert h.tokens("stop_id") == expect[:n] and h.result("stop_id").matched_stop == expect[6]
        at = text.index(text[7:9])
        end = h.result("stop_str")
        assert (end.finish_reason, end.matched_stop) == ("stop", text[7:9])
        assert h.tokens("stop_str") == expect[: at + 2]
        assert h.tokens("first") == expect[:1] and h.result("first").num_output_tokens == 1
        assert h.tokens("zero") == [] and h.result("zero").num_output_tokens == 0
        assert_all_free(h)
    finally:
        h.close()


def test_logprobs_are_streamed_with_every_token(pd):
    pd.submit("lp", 1, prompt(9, 9), max_new_tokens=6, logprobs=True, top_logprobs=3)
    pd.submit("plain", 2, prompt(9, 9), max_new_tokens=6, return_logprob=True)
    pd.run_until(lambda: pd.done("lp", "plain"))
    chunks = [m for m in pd.replies["lp"] if isinstance(m, msg.TokenChunk)]
    assert len(chunks) == 6
    for c in chunks:
        (lp,), (top,) = c.logprobs, c.top_logprobs
        assert len(top) == 3 and top[0][0] == c.token_ids[0]  # greedy: the best token
        assert math.isclose(lp, top[0][1], rel_tol=1e-5) and lp <= 0
    plain = [m for m in pd.replies["plain"] if isinstance(m, msg.TokenChunk)]
    assert all(m.logprobs is not None and m.top_logprobs is None for m in plain)


def test_seeded_sampling_does_not_depend_on_retraction(model_dir):
    runs = []
    for pages in (64, 20):
        h = PD(model_dir, decode_pages=pages, num_reserved_decode_tokens=4)
        try:
            for i in range(3):
                h.submit(
                    f"s{i}",
                    50 + i,
                    prompt(17, 30 + i),
                    max_new_tokens=24,
                    temperature=0.8,
                    seed=1234 + i,
                )
            h.run_until(lambda h=h: h.done("s0", "s1", "s2"))
            runs.append(([h.tokens(f"s{i}") for i in range(3)], h.decode.stats.num_retractions))
        finally:
            h.close()
    (alone, no_retract), (tight, num_retract) = runs
    assert no_retract == 0 and num_retract > 0
    assert alone == tight


def test_lone_request_waits_in_host_memory_while_others_hold_the_pool(model_dir, ref):
    h = PD(model_dir, decode_pages=16, num_reserved_decode_tokens=4)
    try:
        ids = prompt(10, 21)
        h.submit("a", 1, ids, max_new_tokens=20)
        h.run_until(lambda: h.state("a") is DecodeState.RUNNING)
        # Pages of a failed room that cannot be freed yet take the rest of the pool.
        held = UnsafeReceiver()
        h.decode.release_queue.add(
            held, h.decode.allocator.allocate(h.decode.allocator.num_free_pages)
        )
        h.run_until(lambda: h.state("a") is DecodeState.RETRACTED)
        assert h.runner.pool.allocator.num_free_pages > 0  # its own pages went back
        for _ in range(3):
            h.step()
        assert h.state("a") is DecodeState.RETRACTED  # nothing can run: it waits
        held.is_safe = True
        h.run_until(lambda: h.done("a"))
        assert held.is_cleared and h.tokens("a") == greedy(ref, ids, 20)
        assert h.decode.stats.num_retractions == 1
        assert_all_free(h)
    finally:
        h.close()


def test_decode_metrics_carry_the_decode_role(pd):
    from common import metrics

    pd.submit("m", 1, prompt(9, 1), max_new_tokens=5)
    pd.run_until(lambda: pd.done("m"))
    pd.step()
    text = metrics.render_latest().decode()
    for line in (
        'pdserve_queue_requests{queue="running",role="decode"} 0.0',
        'pdserve_queue_requests{queue="retracted",role="decode"} 0.0',
        'pdserve_kv_pages_held{role="decode"} 0.0',
        'pdserve_kv_pages_used{role="decode"} 0.0',
    ):
        assert line in text, line
    assert 'pdserve_inter_token_latency_seconds_count{role="decode"}' in text
    assert 'pdserve_decode_tokens_total{role="decode"}' in text
    assert 'pdserve_retractions_total{role="decode"}' in text


def test_prefill_node_learned_late_from_the_registry_is_waited_for(pd, ref):
    ids = prompt(9, 31)
    pd.known_prefill_nodes.clear()  # the gateway's node table is ahead of ours
    pd.submit("late", 1, ids, max_new_tokens=4)
    pd.run_until(lambda: pd.state("late") is DecodeState.PREALLOC)
    for _ in range(3):
        pd.step()
    assert pd.decode.reqs["late"].receiver is None and not pd.done("late")
    pd.known_prefill_nodes.add("p")
    pd.run_until(lambda: pd.done("late"))
    assert pd.tokens("late") == greedy(ref, ids, 4)
    assert_all_free(pd)
