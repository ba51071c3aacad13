"""Tests for the zmq helpers over real PUSH/PULL sockets on loopback."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from common import metrics
from common.ipc import PushPool, bind_pull, poll_any, recv_messages
from common.messages import Message, TokenChunk, encode

Socket = zmq.Socket[Any]


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _chunk(i: int) -> TokenChunk:
    return TokenChunk(rid=f"req-{i}", token_ids=[i, i + 1], logprobs=None, top_logprobs=None)


def _receive(sock: Socket, count: int, socket_name: str, timeout_s: float = 5.0) -> list[Message]:
    """Drain ``sock`` until ``count`` valid messages arrived or the timeout passed."""
    received: list[Message] = []
    deadline = time.monotonic() + timeout_s
    while len(received) < count and time.monotonic() < deadline:
        if poll_any([sock], timeout_ms=50):
            received += recv_messages(sock, socket_name=socket_name)
    return received


def _malformed_count(socket_name: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "pdserve_malformed_messages_total", {"role": metrics.ROLE, "socket": socket_name}
    )
    return value or 0.0


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:0", "tcp://127.0.0.1:*"])
def test_bind_pull_returns_the_real_endpoint(ctx: zmq.Context[Any], endpoint: str) -> None:
    sock, bound = bind_pull(ctx, endpoint)
    match = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", bound)
    assert match is not None and int(match.group(1)) > 0
    with PushPool(ctx) as pool:
        assert pool.send(bound, _chunk(1))
        assert _receive(sock, 1, "bind-test") == [_chunk(1)]
    sock.close()


def test_bind_pull_on_a_taken_port_raises(ctx: zmq.Context[Any]) -> None:
    sock, bound = bind_pull(ctx, "tcp://127.0.0.1:0")
    with pytest.raises(zmq.ZMQError):
        bind_pull(ctx, bound)
    sock.close()


def test_messages_arrive_in_order(ctx: zmq.Context[Any]) -> None:
    sock, endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    sent = [_chunk(i) for i in range(50)]
    with PushPool(ctx) as pool:
        for msg in sent:
            assert pool.send(endpoint, msg)
        assert _receive(sock, len(sent), "order-test") == sent
    assert recv_messages(sock, socket_name="order-test") == []


def test_garbage_frame_is_dropped_counted_and_logged_once(
    ctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    name = "garbage-test"
    sock, endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    before = _malformed_count(name)
    with PushPool(ctx) as pool:
        raw = pool.socket(endpoint)
        raw.send(encode(_chunk(1)))
        raw.send(b"\xc1 not msgpack")
        raw.send_multipart([encode(_chunk(9)), b"second frame"])
        raw.send(b"\x92\xa4nope\x80")  # well-formed msgpack, unknown tag
        raw.send(encode(_chunk(2)))
        with caplog.at_level(logging.WARNING, logger="common.ipc"):
            received = _receive(sock, 2, name)
    assert received == [_chunk(1), _chunk(2)]
    assert _malformed_count(name) == before + 3
    drops = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(drops) == 1 and name in drops[0].getMessage()


def test_max_frames_bounds_one_drain(ctx: zmq.Context[Any]) -> None:
    sock, endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    with PushPool(ctx) as pool:
        for i in range(5):
            pool.send(endpoint, _chunk(i))
        assert poll_any([sock], timeout_ms=5000) == [sock]
        time.sleep(0.1)  # let all five land in the receive queue
        assert recv_messages(sock, socket_name="bound-test", max_frames=2) == [_chunk(0), _chunk(1)]
        assert _receive(sock, 3, "bound-test") == [_chunk(2), _chunk(3), _chunk(4)]


def test_push_pool_reuses_one_socket_per_endpoint(ctx: zmq.Context[Any]) -> None:
    sock_a, endpoint_a = bind_pull(ctx, "tcp://127.0.0.1:0")
    sock_b, endpoint_b = bind_pull(ctx, "tcp://127.0.0.1:0")
    pool = PushPool(ctx)
    first = pool.socket(endpoint_a)
    for i in range(3):
        pool.send(endpoint_a, _chunk(i))
        pool.send(endpoint_b, _chunk(i))
    assert pool.socket(endpoint_a) is first
    assert pool.num_sockets == 2
    assert _receive(sock_a, 3, "reuse-a") == [_chunk(i) for i in range(3)]
    assert _receive(sock_b, 3, "reuse-b") == [_chunk(i) for i in range(3)]
    pool.discard(endpoint_b)
    assert pool.num_sockets == 1 and first.closed is False
    pool.close()
    assert pool.num_sockets == 0 and first.closed


def test_full_queue_send_fails_and_close_never_blocks() -> None:
    context: zmq.Context[Any] = zmq.Context()
    pool = PushPool(context, sndhwm=1)
    nobody = "tcp://127.0.0.1:1"  # nothing listens: messages stay queued
    results = [pool.send(nobody, _chunk(i)) for i in range(100)]
    assert results[0] and not all(results)
    pool.close()
    term = threading.Thread(target=context.term, daemon=True)
    term.start()
    term.join(timeout=5)
    assert not term.is_alive(), "context.term blocked on a lingering PUSH socket"


def test_poll_any_returns_only_ready_sockets(ctx: zmq.Context[Any]) -> None:
    quiet, _ = bind_pull(ctx, "tcp://127.0.0.1:0")
    busy, busy_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    started = time.monotonic()
    assert poll_any([quiet, busy], timeout_ms=50) == []
    assert time.monotonic() - started >= 0.04
    with PushPool(ctx) as pool:
        pool.send(busy_endpoint, _chunk(1))
        assert poll_any([quiet, busy], timeout_ms=5000) == [busy]


def test_malformed_counter_is_exported_with_role_and_socket(ctx: zmq.Context[Any]) -> None:
    sock, endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    with PushPool(ctx) as pool:
        pool.socket(endpoint).send(b"junk")
        pool.send(endpoint, _chunk(1))
        assert _receive(sock, 1, "export-test") == [_chunk(1)]
    text = metrics.render_latest().decode()
    line = f'pdserve_malformed_messages_total{{role="{metrics.ROLE}",socket="export-test"}} 1.0'
    assert line in text


def test_set_role_rejects_an_unknown_role() -> None:
    role = metrics.ROLE
    with pytest.raises(ValueError, match="role must be one of"):
        metrics.set_role("gateway")
    assert metrics.ROLE == role
    assert metrics.role_labels(queue="waiting") == {"role": role, "queue": "waiting"}
