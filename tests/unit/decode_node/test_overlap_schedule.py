"""Overlap scheduling on the real prefill and decode loops (loopback KV): step N+1 is launched
before step N's tokens are read, the outputs equal those without overlap token for token, and
a request that ends while a step still writes its next KV slot keeps that page out of every
other hand until the step has completed."""

from __future__ import annotations

import pytest

from common import messages as msg
from decode_node import running_batch
from tests.support.decode_harness import PD, assert_all_free, greedy, prompt

# (prompt length, seed, sampling): greedy with logprobs, seeded sampling with penalties,
# a stop token, and long enough to need pages during decode
MIX = [
    (9, 1, {"max_new_tokens": 24, "logprobs": True, "top_logprobs": 2}),
    (14, 2, {"max_new_tokens": 20, "temperature": 0.9, "seed": 7, "frequency_penalty": 0.5}),
    (5, 3, {"max_new_tokens": 22, "temperature": 1.0, "seed": 11, "repetition_penalty": 1.3}),
    (21, 4, {"max_new_tokens": 26, "top_k": 5, "temperature": 0.7, "seed": 3}),
]


def _replies(h: PD, rid: str) -> list[tuple]:
    out = []
    for m in h.replies[rid]:
        if isinstance(m, msg.TokenChunk):
            out.append(("tokens", tuple(m.token_ids), m.logprobs, m.top_logprobs))
        elif isinstance(m, msg.ReqFinished):
            out.append(("end", m.finish_reason, m.matched_stop, m.num_output_tokens))
        else:
            out.append((type(m).__name__,))
    return out


def _run_mix(
    model_dir, overlap: bool, stop_token: int | None, pages: int
) -> tuple[dict[str, list], int]:
    h = PD(
        model_dir,
        decode_pages=pages,
        num_reserved_decode_tokens=1,
        disable_overlap_schedule=not overlap,
    )
    try:
        for k, (n, seed, sampling) in enumerate(MIX):
            extra = {"stop_token_ids": [stop_token]} if stop_token is not None and k == 0 else {}
            h.submit(f"r{k}", 100 + k, prompt(n, seed), **sampling, **extra)
        h.run_until(lambda: h.done(*(f"r{k}" for k in range(len(MIX)))), timeout=60)
        h.run_until(h.decode.is_idle, timeout=10)
        assert_all_free(h)
        replies = {f"r{k}": _replies(h, f"r{k}") for k in range(len(MIX))}
        return replies, h.decode.stats.num_retractions
    finally:
        h.close()


@pytest.mark.parametrize("pages", [64, 18])  # roomy, and small enough to retract
def test_outputs_equal_without_overlap_token_for_token(model_dir, ref, pages):
    stop = greedy(ref, prompt(9, 1), 24)[5]  # the first request stops at its 6th token
    on, retracted_on = _run_mix(model_dir, True, stop, pages)
    off, retracted_off = _run_mix(model_dir, False, stop, pages)
    assert on == off
    if pages < 64:
        assert retracted_on > 0 and retracted_off > 0
    first = [r for r in on["r0"] if r[0] == "end"]
    assert first[0][1] == "stop"  # a finish nobody can predict: by a token's value


class _Order:
    """Spies on the runner's step launches and the reads of sampled tokens."""

    def __init__(self, h: PD, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[str] = []
        launch = h.runner.decode_slots
        results = h.decode.running.results

        def spy_launch(*a, **kw):
            self.events.append("launch")
            return launch(*a, **kw)

        def spy_results():
            got = results()
            if got is not None:
                self.events.append("read")
            return got

        monkeypatch.setattr(h.runner, "decode_slots", spy_launch)
        monkeypatch.setattr(h.decode.running, "results", spy_results)


@pytest.mark.parametrize("overlap", [True, False])
def test_the_next_step_is_launched_before_the_last_steps_tokens_are_read(
    model_dir, monkeypatch, overlap
):
    h = PD(model_dir, disable_overlap_schedule=not overlap)
    try:
        order = _Order(h, monkeypatch)
        h.submit("a", 1, prompt(7, 5), max_new_tokens=8)
        h.run_until(lambda: h.done("a"))
        events = "".join("L" if e == "launch" else "R" for e in order.events)
        # 7 decode steps (the first token came from the prefill node)
        assert events.count("L") == 7 and events.count("R") == 7
        if overlap:
            # each step launched before the one before it is read: L L R L R ... R
            assert events == "L" + "LR" * 6 + "R"
        else:
            assert events == "LR" * 7
    finally:
        h.close()


class _Done:
    """A step's device work that completes when the test says so."""

    def __init__(self) -> None:
        self.is_done = False

    def query(self) -> bool:
        return self.is_done

    def synchronize(self) -> None:
        self.is_done = True


def test_a_page_the_step_in_flight_writes_is_held_until_the_step_completes(
    model_dir, ref, monkeypatch
):
    """r stops at a token nobody could predict, while the next step (which writes r's next
    KV slot) is launched: that page waits in the release queue, is handed to no one, and
    is freed once the step's work is done."""
    dones: list[_Done] = []

    def record(_device):
        dones.append(_Done())
        return dones[-1]

    monkeypatch.setattr(running_batch, "record_work_done", record)
    ids = prompt(9, 1)
    stop = greedy(ref, ids, 12)[3]
    h = PD(model_dir, decode_pages=16)
    try:
        h.submit("r", 1, ids, max_new_tokens=12, stop_token_ids=[stop])
        h.run_until(lambda: h.done("r"))
        end = h.result("r")
        assert isinstance(end, msg.ReqFinished) and end.finish_reason == "stop"
        held = h.decode.release_queue.all_pages()
        assert len(held) == 1  # the page the launched step writes r's stop token's KV into
        everything_free = h.decode.allocator.allocate(h.decode.allocator.num_free_pages)
        assert held[0] not in everything_free
        h.decode.allocator.free(everything_free)
        assert not h.decode.is_idle()
        for done in dones:
            done.is_done = True
        h.step()
        assert h.decode.is_idle() and not h.decode.release_queue
        assert_all_free(h)
    finally:
        h.close()


def test_a_step_sends_each_gateway_one_frame_at_a_time(model_dir, monkeypatch):
    """Four requests decoding together: their tokens reach the gateway as one ReplyBatch a
    flush (at most two a step: before the forward and at the end), not one per request."""
    h = PD(model_dir)
    try:
        pool = h.decode.push.push
        frames: list[str] = []
        send_encoded, send = pool.send_encoded, pool.send

        def spy_encoded(endpoint, data):
            frames.append(endpoint)
            return send_encoded(endpoint, data)

        def spy_send(endpoint, message):
            frames.append(endpoint)
            return send(endpoint, message)

        monkeypatch.setattr(pool, "send_encoded", spy_encoded)
        monkeypatch.setattr(pool, "send", spy_send)
        for k in range(4):
            h.submit(f"r{k}", 10 + k, prompt(6 + k, k), max_new_tokens=12)
        steps = 0
        while not h.done(*(f"r{k}" for k in range(4))):
            before = len(frames)
            h.step()
            steps += 1
            assert len(frames) - before <= 2
        chunks = sum(isinstance(m, msg.TokenChunk) for r in h.replies.values() for m in r)
        assert chunks == 48 and steps * 2 >= len(frames)
        assert len(frames) <= chunks // 2  # several requests' tokens in each frame
    finally:
        h.close()
