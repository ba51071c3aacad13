"""Tests for the decode node's Outbox over real PUSH/PULL sockets on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq

from common import messages as msg
from common import metrics
from common.ipc import PushPool, Socket, bind_pull, close_pull, poll_any, recv_messages
from decode_node.outbox import Outbox
from tests.support.ports import free_port

Context = zmq.Context[Any]


@pytest.fixture
def ctx() -> Iterator[Context]:
    context: Context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def gateways(ctx: Context) -> Iterator[list[tuple[Socket, str]]]:
    """Two gateways' reply sockets: (PULL socket, its endpoint)."""
    bound = [bind_pull(ctx, f"tcp://127.0.0.1:{free_port()}") for _ in range(2)]
    yield bound
    for sock, _ in bound:
        close_pull(sock)


def _chunk(rid: str, token_id: int) -> msg.TokenChunk:
    return msg.TokenChunk(rid=rid, token_ids=[token_id], logprobs=None, top_logprobs=None)


def _finished(rid: str, num: int) -> msg.ReqFinished:
    return msg.ReqFinished(
        rid=rid,
        finish_reason="length",
        matched_stop=None,
        num_prompt_tokens=3,
        num_output_tokens=num,
        num_cached_tokens=0,
    )


Step = list[tuple[str, msg.Message]]  # (gateway endpoint, reply), in the order sent


def _steps(endpoints: list[str]) -> list[Step]:
    """Three decode steps of six requests, three per gateway, every reply kind among them."""
    rids = [(f"req-{i}", endpoints[i % 2]) for i in range(6)]
    first: Step = [
        (endpoints[0], msg.PromptLogprobs(rid="req-0", logprobs=[-1.0], top_logprobs=[[]]))
    ]
    first += [(endpoint, _chunk(rid, 100)) for rid, endpoint in rids]
    second: Step = [(endpoint, _chunk(rid, 101)) for rid, endpoint in rids]
    second.append((endpoints[1], msg.ReqFailed(rid="req-3", status=500, error="boom")))
    third: Step = [(endpoint, _chunk(rid, 102)) for rid, endpoint in rids if rid != "req-3"]
    third += [(endpoint, _finished(rid, 3)) for rid, endpoint in rids if rid != "req-3"]
    return [first, second, third]


def _frames(sock: Socket, timeout_s: float = 5.0) -> list[list[msg.Message]]:
    """Each frame's messages, one drain of one frame at a time, until none came for 0.2 s."""
    frames: list[list[msg.Message]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not poll_any([sock], timeout_ms=200):
            break
        frames.append(recv_messages(sock, socket_name="outbox-test", max_frames=1))
    return frames


def test_one_frame_per_gateway_per_flush_in_the_order_sent(
    ctx: Context, gateways: list[tuple[Socket, str]]
) -> None:
    endpoints = [endpoint for _, endpoint in gateways]
    steps = _steps(endpoints)
    # Unbuffered first: what the gateways received before the Outbox.
    with PushPool(ctx) as push:
        for step in steps:
            for endpoint, message in step:
                assert push.send(endpoint, message)
        unbuffered = [sum(_frames(sock), []) for sock, _ in gateways]
    assert [len(got) for got in unbuffered] == [
        sum(endpoint == e for step in steps for e, _ in step) for endpoint in endpoints
    ]
    with Outbox(PushPool(ctx)) as outbox:
        per_step: list[list[list[list[msg.Message]]]] = []  # step, gateway, frame, message
        for step in steps:
            for endpoint, message in step:
                assert outbox.send(endpoint, message)
            assert outbox.num_held == len(step)
            assert outbox.flush() == []
            assert outbox.num_held == 0
            per_step.append([_frames(sock) for sock, _ in gateways])
    for g, got in enumerate(unbuffered):
        frames = [step[g] for step in per_step]
        assert all(len(f) == 1 for f in frames), "one frame per gateway per flush"
        assert [m for (frame,) in frames for m in frame] == got


def test_a_lone_reply_goes_as_itself(ctx: Context, gateways: list[tuple[Socket, str]]) -> None:
    sock, endpoint = gateways[0]
    with Outbox(PushPool(ctx)) as outbox:
        outbox.send(endpoint, _chunk("a", 1))
        outbox.flush()
        assert poll_any([sock], timeout_ms=5000) == [sock]
        assert msg.decode(sock.recv()) == _chunk("a", 1)  # not a ReplyBatch of one
        assert outbox.flush() == []  # nothing held: nothing sent
        assert not poll_any([sock], timeout_ms=100)


def test_a_message_that_is_no_reply_goes_at_once_after_what_is_held(
    ctx: Context, gateways: list[tuple[Socket, str]]
) -> None:
    sock, endpoint = gateways[0]
    abort = msg.AbortReq(node_id="d", room=1, rid="a", reason="x")
    with Outbox(PushPool(ctx)) as outbox:
        outbox.send(endpoint, _chunk("a", 1))
        outbox.send(endpoint, _chunk("b", 1))
        assert outbox.send(endpoint, abort)
        assert outbox.num_held == 0
        outbox.send(endpoint, _chunk("a", 2))
        outbox.flush()
        frames = _frames(sock)
    assert frames == [[_chunk("a", 1), _chunk("b", 1)], [abort], [_chunk("a", 2)]]


def test_a_batch_too_large_for_one_frame_goes_in_parts_in_order(
    ctx: Context, gateways: list[tuple[Socket, str]]
) -> None:
    sock, endpoint = gateways[0]
    replies: list[msg.GatewayReply] = [_chunk(f"req-{i}", i) for i in range(10)]
    one = len(msg.encode(msg.ReplyBatch(messages=replies[:3])))
    with Outbox(PushPool(ctx), max_batch_bytes=one) as outbox:
        for reply in replies:
            outbox.send(endpoint, reply)
        outbox.flush()
        frames = _frames(sock)
    assert 2 < len(frames) <= 5  # halves of halves, none above the limit
    assert [m for frame in frames for m in frame] == replies


class RecordingPool(PushPool):
    """A PushPool that also keeps each frame it sends, decoded, per endpoint."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.sent: list[tuple[str, msg.Message]] = []

    def send_encoded(self, endpoint: str, data: bytes) -> bool:
        self.sent.append((endpoint, msg.decode(data)))
        return super().send_encoded(endpoint, data)


def test_close_sends_what_is_held_then_closes_the_sockets(ctx: Context) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    push = RecordingPool(ctx)
    outbox = Outbox(push)
    outbox.send(endpoint, _chunk("a", 1))
    outbox.send(endpoint, _chunk("a", 2))
    assert push.sent == []
    outbox.close()
    assert push.sent == [(endpoint, msg.ReplyBatch(messages=[_chunk("a", 1), _chunk("a", 2)]))]
    assert push.num_sockets == 0 and outbox.num_held == 0


def test_a_full_queue_is_reported_by_flush_and_the_order_has_no_gap() -> None:
    context: Context = zmq.Context()
    nobody = "tcp://127.0.0.1:1"  # nothing listens: frames stay queued
    outbox = Outbox(PushPool(context, sndhwm=1))
    refused: list[list[str]] = []
    for i in range(20):
        outbox.send(nobody, _chunk("a", i))
        outbox.send(nobody, _chunk("a", i + 100))
        refused.append(outbox.flush())
    assert refused[0] == [] and [nobody] in refused
    assert outbox.num_held == 0  # refused replies are dropped, not held for ever
    outbox.close()
    context.destroy(linger=0)


def test_malformed_entries_are_counted_per_entry(
    ctx: Context, gateways: list[tuple[Socket, str]]
) -> None:
    sock, endpoint = gateways[0]
    name = "outbox-malformed"

    def count() -> float:
        labels = {"role": metrics.ROLE, "socket": name}
        return metrics.REGISTRY.get_sample_value("pdserve_malformed_messages_total", labels) or 0.0

    before = count()
    good = ["token_chunk", {"rid": "a", "token_ids": [1], "logprobs": None, "top_logprobs": None}]
    bad = ["token_chunk", {"rid": 7}]
    with PushPool(ctx) as push:
        frame = msgpack.packb(["reply_batch", {"messages": [bad, good, ["abort_req", {}]]}])
        assert push.send_encoded(endpoint, frame)
        assert poll_any([sock], timeout_ms=5000) == [sock]
        assert recv_messages(sock, socket_name=name) == [_chunk("a", 1)]
    assert count() == before + 2
