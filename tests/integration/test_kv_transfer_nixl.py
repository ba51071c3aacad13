"""KV transfer between two real processes: NIXL writes over UCX, zmq control, leases and aborts."""

from __future__ import annotations

import time

import pytest
import zmq

from tests.support.kv_node import NodeProcess, NodeSpec

pytest.importorskip("nixl._api", reason="NIXL is not installed")


def _pair(**kw):
    prefill = NodeProcess(NodeSpec("prefill", seed=1234, **kw))
    decode = NodeProcess(NodeSpec("decode", **kw))
    return prefill, decode


@pytest.fixture(scope="module")
def nodes():
    prefill, decode = _pair()
    yield prefill, decode
    prefill.stop()
    decode.stop()


def _handshake(prefill, decode, room, tokens, dst):
    prefill.call("create_sender", room, tokens)
    decode.call("create_receiver", room, prefill.endpoint)
    decode.wait_state(room, ("WaitingForInput",))
    decode.call("send_metadata", room, dst)
    prefill.wait_state(room, ("WaitingForInput",))


def test_scattered_pages_of_concurrent_rooms_arrive_byte_for_byte_over_chunks(nodes):
    prefill, decode = nodes
    rooms = {
        1001: (100, [40, 41, 42, 10, 11, 3, 50], [7, 8, 9, 20, 30, 31, 32]),
        1002: (40, [0, 1, 2], [60, 2, 61]),
        1003: (
            250,
            list(range(12, 28)),
            [33, 34, 35, 36, 1, 0, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46],
        ),
    }
    for room, (n, _, dst) in rooms.items():
        _handshake(prefill, decode, room, n, dst)
    for room, (n, src, _) in rooms.items():
        for end in (17, 64, n - 1):  # mid-page chunk ends: whole pages only until the last
            prefill.call("send", room, src, min(end, n - 1), None)
        aux = dict(
            first_token_id=room % 1000,
            room_echo=room,
            first_logprob=-0.25,
            top_logprobs=[(room % 1000, -0.25)],
        )
        prefill.call("send", room, src, n, aux)
    for room in rooms:
        assert decode.wait_state(room, ("Success", "Failed"))[0] == "Success"
        assert prefill.wait_state(room, ("Success", "Failed"))[0] == "Success"
    for room, (_, src, dst) in rooms.items():
        assert decode.call("pages", dst) == prefill.call("pages", src)
        assert decode.call("aux", room) == (room % 1000, [(room % 1000, -0.25)])
    written = {p for _, _, dst in rooms.values() for p in dst}
    assert set(decode.call("nonzero_pages")) == written


def test_room_echo_mismatch_is_detected(nodes):
    prefill, decode = nodes
    _handshake(prefill, decode, 2001, 20, [50, 51])
    prefill.call("send", 2001, [5, 6], 20, dict(first_token_id=1, room_echo=9999))
    state, reason, _, _ = decode.wait_state(2001, ("Success", "Failed"))
    assert (state, reason) == ("Failed", "room_echo_mismatch")


def test_abort_from_either_side_reaches_the_other(nodes):
    prefill, decode = nodes
    _handshake(prefill, decode, 3001, 20, [52, 53])
    decode.call("abort", 3001)
    assert prefill.wait_state(3001, ("Failed",))[1] == "peer_aborted"
    deadline = time.monotonic() + 5
    while not decode.call("state", 3001)[2]:  # pages become safe to free after the ack
        assert time.monotonic() < deadline
        time.sleep(0.01)
    _handshake(prefill, decode, 3002, 20, [54, 55])
    prefill.call("abort", 3002)
    state, reason, safe, _ = decode.wait_state(3002, ("Failed",))
    assert reason == "peer_aborted" and safe


def test_garbage_on_the_control_socket_is_dropped_and_the_next_transfer_works(nodes):
    prefill, decode = nodes
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(prefill.endpoint)
    push.send(b"\xc1 not msgpack")
    push.send_multipart([b"two", b"frames"])
    push.close()
    _handshake(prefill, decode, 4001, 16, [56])
    prefill.call("send", 4001, [9], 16, dict(first_token_id=2, room_echo=4001))
    assert decode.wait_state(4001, ("Success", "Failed"))[0] == "Success"
    assert decode.call("pages", [56]) == prefill.call("pages", [9])


def test_killing_the_sender_mid_transfer_fails_the_receiver_within_its_lease():
    prefill, decode = _pair(lease_s=1.0)
    try:
        _handshake(prefill, decode, 5001, 64, [1, 2, 3, 4])
        prefill.call("send", 5001, [10, 11, 12, 13], 40, None)  # two pages of four written
        prefill.kill()
        start = time.monotonic()
        state, reason, _, _ = decode.wait_state(5001, ("Failed", "Success"), timeout=10)
        assert (state, reason) == ("Failed", "lease_expired")
        assert time.monotonic() - start < 3.0
        deadline = time.monotonic() + 5
        while not decode.call("state", 5001)[2]:
            assert time.monotonic() < deadline, "pages never became safe to free"
            time.sleep(0.05)
    finally:
        prefill.stop()
        decode.stop()


def test_killing_the_receiver_makes_the_sender_release_within_the_lease():
    prefill, decode = _pair(lease_s=1.0)
    try:
        _handshake(prefill, decode, 6001, 64, [1, 2, 3, 4])
        decode.kill()
        start = time.monotonic()
        state, reason, _, _ = prefill.wait_state(6001, ("Failed", "Success"), timeout=10)
        assert (state, reason) == ("Failed", "lease_expired")
        assert time.monotonic() - start < 3.0
    finally:
        prefill.stop()
        decode.stop()


def test_incompatible_pools_are_refused_with_a_clear_error():
    prefill = NodeProcess(NodeSpec("prefill"))
    other = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=32, dtype="float32")
    decode = NodeProcess(NodeSpec("decode", layout=other))
    try:
        prefill.call("create_sender", 7001, 16)
        decode.call("create_receiver", 7001, prefill.endpoint)
        state, reason, _, detail = decode.wait_state(7001, ("Failed", "WaitingForInput"))
        assert (state, reason) == ("Failed", "incompatible")
        assert "page_size 16 != 32" in detail
    finally:
        prefill.stop()
        decode.stop()
