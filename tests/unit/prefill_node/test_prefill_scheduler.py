"""The prefill loop in one process: tiny Llama, real zmq sockets, loopback KV transfer.

The KV goes to a test receiver (tests/support/prefill_harness.py).
"""

from __future__ import annotations

import time

import pytest
import torch

from common import messages as msg
from common.ipc import recv_messages
from common.kv_pool import pages_needed
from common.model.runner import ExtendRequest
from prefill_node.req_state import PrefillState
from tests.support.prefill_harness import Harness, check_landed, prompt
from transfer.kv_poll import KVPoll

PAGE = 4


def test_prompt_kv_and_first_token_arrive_at_the_decode_side(h):
    ids = prompt(23, 1)
    h.submit("a", 1, ids)
    receiver, pages = h.receive(1, len(ids))
    h.run_until(lambda: receiver.poll() is KVPoll.Success and not h.sched.states)
    check_landed(h, receiver, pages, ids)
    assert h.sched.stats.num_held_pages() == 0
    # The prompt's whole pages stay cached; nothing else is used.
    assert h.runner.pool.allocator.num_used_pages == h.sched.tree.total_size() // PAGE == 5
    h.sched.check_integrity()


def test_long_prompt_is_prefilled_in_chunks_and_still_lands_exactly(model_dir):
    h = Harness(model_dir, chunked_prefill_size=8, max_prefill_tokens=8)
    try:
        ids = prompt(37, 2)
        h.submit("long", 2, ids)
        receiver, pages = h.receive(2, len(ids))
        rounds = []
        h.run_until(
            lambda: (
                (rounds.append(1) if h.sched.chunked else None) or receiver.poll() is KVPoll.Success
            )
        )
        assert len(rounds) >= 4  # 37 tokens in chunks of 8
        check_landed(h, receiver, pages, ids)
    finally:
        h.close()


def test_prompt_logprobs_cover_the_whole_prompt_though_cached_and_chunked(model_dir):
    """A request asking for its prompt's logprobs computes the whole prompt again (its
    pages are cached by an earlier one), in chunks; the logprobs and top 2 that reach the
    decode side equal one extend of the whole prompt, and its KV lands exactly."""
    h = Harness(model_dir, chunked_prefill_size=8, max_prefill_tokens=8)
    try:
        ids = prompt(30, 7)
        h.submit("warm", 31, ids)
        r0, _ = h.receive(31, len(ids))
        h.run_until(lambda: r0.poll() is KVPoll.Success and not h.sched.states)
        computed = h.sched.processed_tokens
        sampling = {"max_new_tokens": 8, "temperature": 0.0, "top_logprobs": 2}
        h.submit("scored", 32, ids, sampling=sampling, return_prompt_logprobs=True)
        r1, pages = h.receive(32, len(ids))
        h.run_until(lambda: r1.poll() is KVPoll.Success and not h.sched.states)
        assert h.sched.processed_tokens - computed == len(ids)  # nothing read from the cache
        ref_pages = h.ref.pool.allocator.allocate(pages_needed(len(ids), PAGE))
        ref = h.ref.extend(
            [ExtendRequest(ids, 0, ref_pages, logprob_targets=ids[1:], top_logprobs=2)]
        )
        h.ref.pool.allocator.free(ref_pages)
        aux = r1.aux
        assert aux is not None and aux.prompt_logprobs is not None
        assert aux.prompt_logprobs == pytest.approx(ref.target_logprobs[0].tolist(), abs=1e-4)
        top_ids = [[t for t, _ in row] for row in aux.prompt_top_logprobs or []]
        assert top_ids == ref.top_logprobs[0][1][: len(ids) - 1].tolist()
        assert r0.aux is not None and r0.aux.prompt_logprobs is None  # not asked: not sent
        check_landed(h, r1, pages, ids)
        h.sched.check_integrity()
    finally:
        h.close()


def test_abort_in_bootstrap_or_mid_chunk_or_from_decode_frees_everything(model_dir):
    h = Harness(model_dir, chunked_prefill_size=8, max_prefill_tokens=8)
    try:
        h.submit("x", 21, prompt(12, 6))
        h.run_until(lambda: "x" in h.sched.states)
        h.sched.abort("x", None, "client went away")  # still in the bootstrap queue
        assert not h.sched.states and len(h.sched.bootstrap_queue) == 0
        ids = prompt(37, 7)
        h.submit("y", 22, ids)
        r, _ = h.receive(22, len(ids))
        h.run_until(lambda: h.sched.chunked is not None)  # mid-prompt, holding pages
        assert h.runner.pool.allocator.num_used_pages > 0
        h.sched.abort("y", None, "client went away")
        h.run_until(lambda: r.poll() is KVPoll.Failed)
        h.submit("z", 23, prompt(20, 8))
        rz, _ = h.receive(23, 20)
        rz.abort()  # the decode side gives up before prefill ran
        h.run_until(lambda: not h.sched.states)
        assert h.sched.stats.num_held_pages() == 0
        # Only what the radix cache keeps (the chunks computed before the abort) is used.
        assert h.runner.pool.allocator.num_used_pages == h.sched.tree.total_size() // PAGE
        assert h.sched.tree.protected_size() == 0
        h.sched.check_integrity()
    finally:
        h.close()


def test_prompt_longer_than_the_context_is_refused_with_400(h):
    h.submit("big", 31, [1] * 300)
    h.run_until(lambda: any(isinstance(m, msg.ReqFailed) for m in h.replies))
    failed = next(m for m in h.replies if isinstance(m, msg.ReqFailed))
    assert failed.rid == "big" and failed.status == 400 and "context length" in failed.error
    assert not h.sched.states


def test_a_priority_while_priority_scheduling_is_off_is_refused_when_asked(model_dir):
    h = Harness(model_dir, abort_on_priority_when_disabled=True)
    try:
        h.submit("p", 1, prompt(9, 1), priority=3)
        h.run_until(lambda: any(isinstance(m, msg.ReqFailed) for m in h.replies))
        [failed] = [m for m in h.replies if isinstance(m, msg.ReqFailed)]
        # The seeds: SGLang rejects it with 503.
        assert failed.rid == "p" and failed.status == 503 and "priority" in failed.error
        assert not h.sched.states
    finally:
        h.close()


def test_shortest_prefill_first_admits_short_requests_beside_the_capped_chunk(model_dir):
    # The seeds' chunk limit reserves budget beside a long chunked request for shorter
    # waiting ones: they must be admitted in that same round (they used to wait for the
    # long one to finish, so the reservation was never used).
    h = Harness(
        model_dir,
        num_pages=512,
        chunked_prefill_size=16,
        max_prefill_tokens=256,
        schedule_policy="shortest-prefill-first",
    )
    batches: list[list[str]] = []
    schedule = h.sched._schedule

    def recording():
        chunks = schedule()
        if chunks:
            batches.append([c.req.rid for c in chunks])
        return chunks

    h.sched._schedule = recording
    try:
        long_ids = prompt(h.runner.context_length - 1, 7)  # many rounds of 16
        h.submit("long", 31, long_ids)
        r_long, p_long = h.receive(31, len(long_ids))
        h.run_until(lambda: h.sched.chunked is not None)
        shorts = {"s1": (32, prompt(6, 8)), "s2": (33, prompt(7, 9))}
        receivers = {}
        for rid, (room, ids) in shorts.items():
            h.submit(rid, room, ids)
            receivers[rid] = h.receive(room, len(ids))
        h.run_until(lambda: all(r.poll() is KVPoll.Success for r, _ in receivers.values()))
        assert h.sched.chunked is not None, "the long request finished first: test too short"
        beside = [b for b in batches if "long" in b and len(b) > 1]
        assert beside, batches
        assert set(beside[0]) <= {"long", "s1", "s2"}
        h.run_until(lambda: r_long.poll() is KVPoll.Success and not h.sched.states)
        for rid, (room, ids) in shorts.items():
            check_landed(h, *receivers[rid], ids)
        check_landed(h, r_long, p_long, long_ids)
        h.sched.check_integrity()
    finally:
        h.close()


def test_queued_tokens_count_what_is_left_to_compute_less_the_cached_prefix(h):
    base = prompt(32, 21)
    h.submit("warm", 31, base + [7])
    r, _ = h.receive(31, 33)
    h.run_until(lambda: r.poll() is KVPoll.Success and not h.sched.states)
    assert h.sched.queued_tokens() == 0
    # Two requests wait in the bootstrap queue (no decode side has asked for them yet):
    # one shares the cached 32 tokens, one shares nothing.
    hit, miss = base + prompt(9, 22), prompt(20, 23)
    h.submit("hit", 32, hit)
    h.submit("miss", 33, miss)
    h.run_until(lambda: len(h.sched.states) == 2)
    h.sched._queued_at = -float("inf")  # no memo: read it now
    assert h.sched.queued_tokens() == (len(hit) - 32) + len(miss)


def test_a_sample_whose_decode_side_holds_every_page_samples_from_the_first_ones_logits(h):
    """n = 3 (one sample group): the first sample is prefilled; the second's decode side
    holds every page (it copied them) and asks for the first token alone: nothing is
    computed, its token is the greedy one; the third's asks for pages and is computed as
    usual (the KV it sends must exist). A sample waiting in the bootstrap queue whose
    group's logits are here counts no queued token."""
    ids = prompt(23, 24)
    group = {"sample_group": "g", "num_group_samples": 3}
    h.submit("s0", 41, ids, **group)
    r0, p0 = h.receive(41, len(ids))
    h.run_until(lambda: r0.poll() is KVPoll.Success and not h.sched.states)
    check_landed(h, r0, p0, ids)
    computed = h.sched.processed_tokens
    h.submit("s1", 42, ids, **group)
    h.run_until(lambda: len(h.sched.states) == 1)
    h.sched._queued_at = -float("inf")
    assert h.sched.queued_tokens() == 0
    r1, _ = h.receive(42, len(ids), holds_all=True)
    h.run_until(lambda: r1.poll() is KVPoll.Success and not h.sched.states)
    assert h.sched.processed_tokens == computed
    assert r1.aux.first_token_id == r0.aux.first_token_id
    assert r1.aux.num_cached_tokens == len(ids)
    h.submit("s2", 43, ids, **group)
    r2, p2 = h.receive(43, len(ids))
    h.run_until(lambda: r2.poll() is KVPoll.Success and not h.sched.states)
    assert h.sched.processed_tokens == computed + len(ids) - 20  # the last partial page
    check_landed(h, r2, p2, ids)
    assert len(h.sched.groups) == 1  # s2 did not take the logits: they stay for keep_s
    h.sched.check_integrity()


class _Pending:
    """A forward's completion marker that says "still running" until `finish()`."""

    def __init__(self) -> None:
        self.is_done = False

    def query(self) -> bool:
        return self.is_done

    def synchronize(self) -> None:
        self.is_done = True


def test_no_page_is_written_before_the_forward_that_filled_it_completed(model_dir, monkeypatch):
    """On CUDA extend() returns with its kernels queued: a chunk's pages must not reach the
    backend until the forward's marker says done (each forward gets its own marker)."""
    import common.model.runner as runner_module

    markers: list[_Pending] = []

    def pending(device):
        markers.append(_Pending())
        return markers[-1]

    monkeypatch.setattr(runner_module, "record_work_done", pending)
    h = Harness(model_dir, chunked_prefill_size=8, max_prefill_tokens=8)
    try:
        written: list[tuple[int, int]] = []
        write = h.kv.backend.write

        def recording(peer, pairs, notification=b""):
            written.extend(pairs)
            return write(peer, pairs, notification)

        monkeypatch.setattr(h.kv.backend, "write", recording)
        ids = prompt(21, 9)  # three chunks: 8, 8, 5 tokens
        h.submit("fenced", 9, ids)
        receiver, pages = h.receive(9, len(ids))
        h.run_until(lambda: len(markers) == 1)
        for _ in range(20):  # the loop goes on (the next chunk runs); nothing is posted
            h.sched.step()
        assert written == [] and len(markers) >= 2
        markers[0].is_done = True
        h.run_until(lambda: len(written) == 2)  # chunk one's two whole pages, and no more
        assert [dst for _, dst in written] == pages[:2]
        for m in markers:
            m.is_done = True
        h.run_until(lambda: receiver.poll() is KVPoll.Success)
        check_landed(h, receiver, pages, ids)
    finally:
        h.close()


def test_the_first_token_is_sampled_with_a_generator_on_the_logits_device(h, monkeypatch):
    """torch refuses a CPU generator for cuda logits: the prefill node made its generator on
    the CPU whatever the device, so every sampled (temperature > 0) request failed on a GPU."""
    import prefill_node.first_token as scheduler_module

    asked: list[object] = []
    real = scheduler_module.make_generator

    def spy(seed, device=None):
        asked.append(device)
        return real(seed, "cpu" if device is None else device)

    monkeypatch.setattr(scheduler_module, "make_generator", spy)
    ids = prompt(9, 3)
    h.submit("sampled", 3, ids, sampling={"max_new_tokens": 4, "temperature": 0.8, "seed": 5})
    receiver, _ = h.receive(3, len(ids))
    h.run_until(lambda: receiver.poll() is KVPoll.Success)
    assert asked and all(torch.device(d) == h.runner.device for d in asked)


def test_a_full_queue_refuses_new_requests_with_503(model_dir):
    """--max-queued-requests: two requests wait for their decode node's pages; a third is
    refused (SGLang's meaning), and one admitted frees a place again."""
    h = Harness(model_dir, max_queued_requests=2)
    try:
        for i in range(3):
            h.submit(f"q{i}", 40 + i, prompt(9, 40 + i))
        h.run_until(lambda: any(isinstance(m, msg.ReqFailed) for m in h.replies))
        [refused] = [m for m in h.replies if isinstance(m, msg.ReqFailed)]
        assert refused.rid == "q2" and refused.status == 503 and "queue is full" in refused.error
        assert set(h.sched.states) == {"q0", "q1"}
        receiver, _ = h.receive(40, 9)
        h.run_until(lambda: receiver.poll() is KVPoll.Success and "q0" not in h.sched.states)
        h.submit("q3", 43, prompt(9, 43))
        h.run_until(lambda: "q3" in h.sched.states)
    finally:
        h.close()


def test_running_requests_are_capped(model_dir):
    """--max-running-requests 1: of two bootstrapped requests one prefills and transfers at
    a time; the other waits in the queue, then runs; both land."""
    h = Harness(model_dir, max_running_requests=1)
    try:
        ids = {r: prompt(11, 50 + r) for r in (0, 1)}
        for r in ids:
            h.submit(f"r{r}", 50 + r, ids[r])
        got = {r: h.receive(50 + r, 11) for r in ids}
        most = 0

        def done() -> bool:
            nonlocal most
            most = max(most, len(h.sched.inflight_queue) + (h.sched.chunked is not None))
            return all(rec.poll() is KVPoll.Success for rec, _ in got.values())

        h.run_until(done)
        assert most <= 1
        for r, (rec, pages) in got.items():
            check_landed(h, rec, pages, ids[r])
    finally:
        h.close()


def _run_checked(h, cond, seen, timeout=10.0):
    """run_until, with the scheduler's integrity checked and each request's state noted
    after every step."""
    deadline = time.monotonic() + timeout
    while not cond():
        h.sched.step()
        h.sched.check_integrity()
        for rid, s in h.sched.states.items():
            seen.setdefault(rid, []).append(s.state)
        h.decode.poll()
        h.replies += recv_messages(h.reply_sock)
        assert time.monotonic() < deadline, "condition not reached"


def test_each_request_state_matches_its_queue_after_every_step(model_dir):
    """Two chunked requests, one running at a time: between steps each sits in the queue its
    state names; an abort in the waiting queue takes it out of that queue alone."""
    h = Harness(model_dir, max_running_requests=1, chunked_prefill_size=8, max_prefill_tokens=8)
    try:
        ids = {r: prompt(21, 60 + r) for r in (0, 1, 2)}
        for r, tokens in ids.items():
            h.submit(f"r{r}", 60 + r, tokens)
        seen: dict[str, list[PrefillState]] = {}
        _run_checked(h, lambda: len(h.sched.states) == 3, seen)
        assert all(s.state is PrefillState.BOOTSTRAP for s in h.sched.states.values())
        got = {r: h.receive(60 + r, len(ids[r])) for r in ids}
        _run_checked(
            h,
            lambda: (
                h.sched.states["r1"].state is PrefillState.WAITING and h.sched.chunked is not None
            ),
            seen,
        )
        h.sched.abort("r1", None, "client went away")
        assert "r1" not in h.sched.states
        h.sched.check_integrity()
        _run_checked(h, lambda: not h.sched.states, seen)
        for r in (0, 2):
            assert got[r][0].poll() is KVPoll.Success
            check_landed(h, *got[r], ids[r])
        assert got[1][0].poll() is KVPoll.Failed
        # Between steps: waiting (r0 ran as soon as it was bootstrapped), the chunk in
        # progress, the pages in flight.
        assert {PrefillState.PREFILLING, PrefillState.TRANSFERRING} <= set(seen["r0"])
        assert {PrefillState.WAITING, PrefillState.PREFILLING, PrefillState.TRANSFERRING} <= set(
            seen["r2"]
        ), seen["r2"]
        assert h.sched.stats.num_held_pages() == 0
    finally:
        h.close()


def test_the_integrity_check_catches_a_state_that_disagrees_with_its_queue(model_dir):
    h = Harness(model_dir, chunked_prefill_size=8, max_prefill_tokens=8)
    try:
        ids = prompt(37, 70)
        h.submit("a", 70, ids)
        h.run_until(lambda: "a" in h.sched.states)
        s = h.sched.states["a"]
        h.sched.check_integrity()
        s.state = PrefillState.WAITING  # still in the bootstrap queue
        with pytest.raises(AssertionError, match="a in the bootstrap queue is waiting"):
            h.sched.check_integrity()
        s.state = PrefillState.BOOTSTRAP
        h.sched.bootstrap_queue.remove(s)  # moved without its state: waiting, says BOOTSTRAP
        h.sched.waiting_queue.append(s.req)
        with pytest.raises(AssertionError, match="a in the waiting queue is bootstrap"):
            h.sched.check_integrity()
        h.sched.waiting_queue.remove(s.req)  # in no queue at all
        with pytest.raises(AssertionError, match="queues and the request table disagree"):
            h.sched.check_integrity()
        h.sched.bootstrap_queue.add(s)
        h.receive(70, len(ids))
        h.run_until(lambda: h.sched.chunked is s)
        h.sched.check_integrity()
        s.state = PrefillState.TRANSFERRING  # the chunked request is still prefilling
        with pytest.raises(AssertionError, match="a in the prefilling queue is transferring"):
            h.sched.check_integrity()
        s.state = PrefillState.PREFILLING
        s.pages.pop()  # fewer pages than the tokens it computed
        with pytest.raises(AssertionError, match="pages for"):
            h.sched.check_integrity()
    finally:
        h.close()


def test_the_integrity_check_catches_a_page_nobody_owns(h):
    ids = prompt(23, 71)
    h.submit("a", 71, ids)
    receiver, _ = h.receive(71, len(ids))
    h.run_until(lambda: receiver.poll() is KVPoll.Success and not h.sched.states)
    h.sched.check_integrity()
    h.runner.pool.allocator.allocate(1)  # behind the scheduler's back
    with pytest.raises(AssertionError, match="0 pages owned and 5 cached but 6 used"):
        h.sched.check_integrity()


def test_a_prompt_that_needs_nearly_the_whole_pool_is_admitted_or_refused_never_stuck(model_dir):
    """A pool of 12 pages of 4 tokens: the adder takes a prompt's pages, its first token
    and a page of overhead, so 40 tokens (10 pages) go and 41 can never go: that one is
    refused with 400 at once, not left waiting (it waited until a timeout before)."""
    h = Harness(model_dir, num_pages=12)
    try:
        h.submit("fits", 1, prompt(30, 7))  # fills the radix cache first
        r, pages = h.receive(1, 30)
        h.run_until(lambda: r.poll() is KVPoll.Success and not h.sched.states)
        r.clear()
        h.dpool.allocator.free(pages)  # the test's decode pool is as small
        ids = prompt(40, 8)
        h.submit("whole", 2, ids)
        r, pages = h.receive(2, len(ids))
        h.run_until(lambda: r.poll() is KVPoll.Success and not h.sched.states)
        check_landed(h, r, pages, ids)
        h.submit("over", 3, prompt(41, 9))
        h.run_until(lambda: any(isinstance(m, msg.ReqFailed) for m in h.replies))
        (failed,) = [m for m in h.replies if isinstance(m, msg.ReqFailed)]
        assert failed.rid == "over" and failed.status == 400
        assert "at most 40" in failed.error and not h.sched.states
        h.sched.check_integrity()
    finally:
        h.close()
