"""CURVE on every socket from common.ipc: members get through; strangers are refused.

Strangers are never delivered, and they are counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from common import messages as msg
from common import metrics, socket_auth
from common.ipc import PushPool, bind_pull, close_pull, recv_messages

TOKEN = "cluster-secret"
ABORT = msg.AbortReq(node_id="n", room=1, rid="r", reason="test")


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    socket_auth.configure(TOKEN)
    context: zmq.Context[Any] = zmq.Context()
    yield context
    socket_auth.configure(None)  # stops the ZAP handler before the context goes
    context.destroy(linger=0)


def _refusals(socket_name: str, reason: str) -> float:
    value = metrics.UNAUTHENTICATED_CONNECTIONS.labels(
        role=metrics.ROLE, socket=socket_name, reason=reason
    )._value.get()
    return float(value)


def _drain_for(sock: zmq.Socket[Any], name: str, seconds: float) -> list[msg.Message]:
    got: list[msg.Message] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got += recv_messages(sock, socket_name=name)
        time.sleep(0.02)
    return got


def test_keys_come_from_the_token() -> None:
    a, b = socket_auth.ClusterKeys.from_token("t1"), socket_auth.ClusterKeys.from_token("t1")
    other = socket_auth.ClusterKeys.from_token("t2")
    assert a == b and a.public != other.public and a.secret != other.secret
    assert zmq.curve_public(a.secret) == a.public and len(a.public) == 40


def test_a_member_is_served_and_strangers_are_refused_and_counted(ctx: zmq.Context[Any]) -> None:
    sock, endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    name = "test_auth"
    before = {r: _refusals(name, r) for r in ("no_curve", "wrong_key", "protocol")}
    malformed_before = metrics.MALFORMED_MESSAGES.labels(
        role=metrics.ROLE, socket=name
    )._value.get()
    strangers = []
    plain = ctx.socket(zmq.PUSH)  # no CURVE at all
    strangers.append(plain)
    other_cluster = ctx.socket(zmq.PUSH)  # CURVE, keys of another token
    socket_auth.SocketSecurity(socket_auth.ClusterKeys.from_token("guess")).secure_client(
        other_cluster
    )
    strangers.append(other_cluster)
    own_key = ctx.socket(zmq.PUSH)  # knows the server key, but has a key pair of its own
    public, secret = zmq.curve_keypair()
    own_key.curve_serverkey = socket_auth.ClusterKeys.from_token(TOKEN).public
    own_key.curve_publickey, own_key.curve_secretkey = public, secret
    strangers.append(own_key)
    for s in strangers:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 1000)
        s.connect(endpoint)
        try:
            s.send(msg.encode(ABORT))
            s.send(b"\xc1garbage")
        except zmq.Again:
            pass  # the refused handshake left nowhere to queue them
    assert _drain_for(sock, name, 1.5) == []
    after = {r: _refusals(name, r) for r in before}
    assert after["no_curve"] > before["no_curve"]
    assert after["wrong_key"] > before["wrong_key"]
    assert sum(after.values()) - sum(before.values()) >= 3
    # Frames of strangers never reach the decoder: nothing counted as malformed.
    assert metrics.MALFORMED_MESSAGES.labels(role=metrics.ROLE, socket=name)._value.get() == (
        malformed_before
    )
    with PushPool(ctx) as member:
        assert member.send(endpoint, ABORT)
        got = _drain_for(sock, name, 1.0)
    assert got == [ABORT]
    for s in strangers:
        s.close(linger=0)
    close_pull(sock)


def test_without_a_token_sockets_stay_open() -> None:
    socket_auth.configure(None)
    context: zmq.Context[Any] = zmq.Context()
    try:
        sock, endpoint = bind_pull(context, "tcp://127.0.0.1:0")
        plain = context.socket(zmq.PUSH)
        plain.connect(endpoint)
        plain.send(msg.encode(ABORT))
        assert _drain_for(sock, "open", 0.5) == [ABORT]
        plain.close(linger=0)
        close_pull(sock)
    finally:
        context.destroy(linger=0)
