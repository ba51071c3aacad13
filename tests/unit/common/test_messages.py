"""Tests for the wire messages: round trips of every type and rejection of malformed input."""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest

from common.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    AbortReq,
    Deregister,
    GenerateReq,
    Heartbeat,
    KVEvents,
    KVSnapshotRequest,
    LateWrite,
    LeaseGrant,
    LeaseRenew,
    MalformedMessage,
    Message,
    PeerHello,
    PeerHelloAck,
    PeerReset,
    PromptLogprobs,
    RegisterNode,
    ReplyBatch,
    ReqFailed,
    ReqFinished,
    TokenChunk,
    TransferDone,
    TransferFailed,
    TransferRequest,
    decode,
    decode_json,
    encode,
    encode_json,
    is_supported_protocol,
    message_types,
)

KV_LAYOUT = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "page_size": 16, "dtype": "bf16"}

SAMPLES: list[Message] = [
    PeerHello(
        node_id="decode-0",
        role="decode",
        control_endpoint="tcp://127.0.0.1:5001",
        backend="nixl",
        backend_metadata=b"\x00\xffagent-md\n",
        kv_layout=KV_LAYOUT,
        num_pages=4096,
        protocol_version=PROTOCOL_VERSION,
        auth_token="s3cret",
    ),
    PeerHelloAck(
        node_id="prefill-0",
        control_endpoint="tcp://127.0.0.1:7001",
        accepted=False,
        reason="bad token",
    ),
    TransferRequest(room=7, node_id="decode-0", dst_pages=[3, 9, 12], aux_slot=2, lease_s=30.0),
    TransferDone(
        room=7,
        node_id="prefill-0",
        first_token_id=42,
        first_logprob=-0.25,
        top_logprobs=[[42, -0.25], [7, -1.5]],
        room_echo=7,
        num_pages=3,
        marks={"prefill_received": 1764600000.125, "prefill_computed": 1764600000.5},
    ),
    TransferFailed(room=7, node_id="prefill-0", reason="lease expired"),
    LeaseRenew(node_id="prefill-0", rooms=[7, 8, 2**40], instance_id="a1", seq=3),
    AbortReq(node_id="gateway", room=None, rid="req-1", reason="client disconnected"),
    RegisterNode(
        node_id="prefill-0",
        role="prefill",
        request_endpoint="tcp://127.0.0.1:6000",
        control_endpoint="tcp://127.0.0.1:6001",
        http_url="http://127.0.0.1:30000",
        backend="fake",
        backend_metadata=b"",
        kv_layout=KV_LAYOUT,
        num_pages=1024,
        max_running_requests=64,
        protocol_version=PROTOCOL_VERSION,
        auth_token=None,
    ),
    Heartbeat(node_id="decode-0", load={"num_running": 3, "free_pages": 0.5}, auth_token="t"),
    Deregister(node_id="decode-0", auth_token=None),
    GenerateReq(
        rid="req-1",
        room=7,
        input_ids=[1, 15, 99, 0],
        sampling={"temperature": 0.7, "stop": ["\n\n"], "max_new_tokens": 32},
        priority=None,
        routing_key="tenant-a",
        prefill_node_id="prefill-0",
        decode_node_id="decode-0",
        reply_endpoint="tcp://127.0.0.1:7000",
        arrival_time=1_700_000_000.125,
        return_logprob=True,
    ),
    TokenChunk(
        rid="req-1",
        token_ids=[5, 6],
        logprobs=[-0.1, -2.0],
        top_logprobs=[[[5, -0.1], [8, -3.0]], [[6, -2.0]]],
        marks={"decode_transferred": 1764600000.75},
    ),
    TokenChunk(rid="req-2", token_ids=[], logprobs=None, top_logprobs=None),
    ReqFinished(
        rid="req-1",
        finish_reason="stop",
        matched_stop="\n\n",
        num_prompt_tokens=4,
        num_output_tokens=2,
        num_cached_tokens=0,
    ),
    ReqFinished(
        rid="req-2",
        finish_reason="stop",
        matched_stop=2,
        num_prompt_tokens=4,
        num_output_tokens=9,
        num_cached_tokens=4,
    ),
    ReqFinished(
        rid="req-3",
        finish_reason="length",
        matched_stop=None,
        num_prompt_tokens=1,
        num_output_tokens=1,
        num_cached_tokens=0,
    ),
    ReqFailed(rid="req-4", status=503, error="decode node lost"),
    LeaseGrant(
        node_id="decode-0", instance_id="b2", seq=3, lease_s=10.0, granted=[7, 2**40], released=[8]
    ),
    PeerReset(
        node_id="prefill-0", instance_id="a1", control_endpoint="tcp://127.0.0.1:6001", rooms=[7]
    ),
    LateWrite(node_id="prefill-0", instance_id="a1", room=7, dst_pages=[3, 9]),
    KVEvents(
        node_id="prefill-0",
        instance_id="a1",
        seq=4,
        stored=b"\x01" * 16,
        removed=b"",
        is_snapshot=False,
        queued_tokens=300,
        num_pages=512,
    ),
    KVSnapshotRequest(gateway_id="gateway-1"),
    PromptLogprobs(rid="req-3", logprobs=[-1.5, -0.25], top_logprobs=[[[7, -0.5]], [[9, -0.25]]]),
    TransferDone(
        room=8,
        node_id="prefill-0",
        first_token_id=42,
        first_logprob=None,
        top_logprobs=[],
        room_echo=8,
        num_pages=1,
        prompt_logprobs=[-3.0, -0.5],
        prompt_top_logprobs=[[[3, -1.0]], [[4, -0.5]]],
    ),
    ReplyBatch(
        messages=[
            PromptLogprobs(rid="req-5", logprobs=[-1.5], top_logprobs=[[[7, -0.5]]]),
            TokenChunk(
                rid="req-5",
                token_ids=[5],
                logprobs=[-0.1],
                top_logprobs=[[[5, -0.1]]],
                marks={"decode_transferred": 1764600000.75},
            ),
            TokenChunk(rid="req-6", token_ids=[8], logprobs=None, top_logprobs=None),
            ReqFinished(
                rid="req-5",
                finish_reason="stop",
                matched_stop="\n\n",
                num_prompt_tokens=2,
                num_output_tokens=1,
                num_cached_tokens=0,
            ),
            ReqFailed(rid="req-6", status=503, error="drain timeout", retryable=True),
        ]
    ),
]


def _id(msg: Message) -> str:
    return type(msg).__name__


def _raw(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def _fields(msg: Message) -> dict[str, Any]:
    """The wire payload of ``msg``, decoded back into a plain dict for tampering."""
    tag, payload = msgpack.unpackb(encode(msg), raw=False)
    assert tag == msg.TAG
    fields: dict[str, Any] = payload
    return fields


def _reason(data: bytes) -> str:
    with pytest.raises(MalformedMessage) as info:
        decode(data)
    reason = str(info.value)
    assert reason and "\n" not in reason
    return reason


def test_samples_cover_every_registered_type() -> None:
    assert {type(m) for m in SAMPLES} == set(message_types())
    assert len(message_types()) == 21


def test_registry_is_consistent() -> None:
    assert len(set(MESSAGE_TYPES)) == len(MESSAGE_TYPES)
    for tag, cls in MESSAGE_TYPES.items():
        assert cls.TAG == tag
        assert cls.__doc__
    # 3: GenerateReq.cache_salt; 4: marks on TokenChunk, TransferDone; 5: KV events;
    # 6: prompt logprobs (GenerateReq, TransferDone, PromptLogprobs); 7: sample groups
    # (GenerateReq), and a decode node may hold every page of a room (an aux-only transfer);
    # 8: ReplyBatch (one frame per decode step per gateway)
    assert PROTOCOL_VERSION == 8
    assert is_supported_protocol(PROTOCOL_VERSION)
    assert not is_supported_protocol(PROTOCOL_VERSION + 1)


def test_messages_are_frozen() -> None:
    msg = SAMPLES[0]
    assert isinstance(msg, PeerHello)
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.node_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize("msg", SAMPLES, ids=_id)
def test_msgpack_round_trip(msg: Message) -> None:
    data = encode(msg)
    assert isinstance(data, bytes)
    assert decode(data) == msg
    tag, payload = msgpack.unpackb(data, raw=False)
    assert tag == msg.TAG
    assert list(payload) == [f.name for f in dataclasses.fields(msg)]


@pytest.mark.parametrize("msg", SAMPLES, ids=_id)
def test_json_round_trip(msg: Message) -> None:
    text = encode_json(msg)
    assert decode_json(text) == msg
    assert decode_json(text.encode()) == msg


def test_json_carries_bytes_as_base64() -> None:
    msg = SAMPLES[0]
    assert isinstance(msg, PeerHello)
    tag, payload = json.loads(encode_json(msg))
    assert tag == "peer_hello"
    assert base64.b64decode(payload["backend_metadata"]) == msg.backend_metadata


def test_int_is_accepted_for_float_and_becomes_float() -> None:
    payload = _fields(SAMPLES[2]) | {"lease_s": 5}
    decoded = decode(_raw(["transfer_request", payload]))
    assert isinstance(decoded, TransferRequest)
    assert decoded.lease_s == 5.0 and type(decoded.lease_s) is float


def test_optional_and_union_fields_accept_each_member() -> None:
    payload = _fields(SAMPLES[13])
    for value in (2, "</s>", None):
        decoded = decode(_raw(["req_finished", payload | {"matched_stop": value}]))
        assert isinstance(decoded, ReqFinished) and decoded.matched_stop == value


def test_unregistered_object_cannot_be_encoded() -> None:
    @dataclasses.dataclass(frozen=True)
    class Stray(Message):
        x: int

    with pytest.raises(TypeError):
        encode(Stray(1))


GOOD_REQ = SAMPLES[10]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(b"\xc1\xc1garbage", "not msgpack", id="garbage-bytes"),
        pytest.param(b"", "not msgpack", id="empty"),
        pytest.param(encode(GOOD_REQ)[:-3], "not msgpack", id="truncated"),
        pytest.param(encode(GOOD_REQ) + b"\x00", "not msgpack", id="trailing-bytes"),
        pytest.param(_raw({"tag": "generate_req"}), "expected [tag, fields]", id="not-a-list"),
        pytest.param(_raw(["generate_req"]), "expected [tag, fields]", id="list-of-one"),
        pytest.param(_raw([7, {}]), "tag must be a string", id="tag-not-str"),
        pytest.param(_raw(["no_such_msg", {}]), "unknown tag 'no_such_msg'", id="unknown-tag"),
        pytest.param(_raw(["GenerateReq", {}]), "unknown tag", id="class-name-is-not-a-tag"),
        pytest.param(_raw(["generate_req", [1, 2]]), "fields must be a map", id="payload-list"),
    ],
)
def test_malformed_frames_are_rejected(data: bytes, expected: str) -> None:
    assert expected in _reason(data)


def _tampered(**changes: Any) -> bytes:
    payload = _fields(GOOD_REQ)
    for key, value in changes.items():
        if value is _MISSING:
            del payload[key]
        else:
            payload[key] = value
    return _raw(["generate_req", payload])


_MISSING = object()


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"room": _MISSING}, "GenerateReq: missing field 'room'"),
        ({"evil": 1}, "GenerateReq: unknown field(s) 'evil'"),
        ({"room": "7"}, "GenerateReq.room: expected int, got str"),
        ({"room": True}, "GenerateReq.room: expected int, got bool"),
        ({"room": 7.0}, "GenerateReq.room: expected int, got float"),
        ({"room": None}, "GenerateReq.room: expected int, got NoneType"),
        ({"rid": b"req-1"}, "GenerateReq.rid: expected str, got bytes"),
        ({"input_ids": [1, "2", 3]}, "GenerateReq.input_ids[1]: expected int, got str"),
        ({"input_ids": [1, False]}, "GenerateReq.input_ids[1]: expected int, got bool"),
        ({"input_ids": {"a": 1}}, "GenerateReq.input_ids: expected list[int], got dict"),
        ({"sampling": [1]}, "GenerateReq.sampling: expected dict[str, any], got list"),
        ({"priority": "high"}, "GenerateReq.priority: expected int | None, got str"),
        ({"priority": True}, "GenerateReq.priority: expected int | None, got bool"),
        ({"arrival_time": "now"}, "GenerateReq.arrival_time: expected float, got str"),
        ({"return_logprob": 1}, "GenerateReq.return_logprob: expected bool, got int"),
    ],
)
def test_bad_fields_are_rejected(changes: dict[str, Any], expected: str) -> None:
    assert _reason(_tampered(**changes)) == expected


def test_union_rejects_members_not_declared() -> None:
    payload = _fields(SAMPLES[13])
    for value in (True, 1.5, [1]):
        data = _raw(["req_finished", payload | {"matched_stop": value}])
        assert "ReqFinished.matched_stop: expected int | str | None" in _reason(data)


def test_nested_lists_are_checked() -> None:
    payload = _fields(SAMPLES[11]) | {"top_logprobs": [[[5, -0.1]], 3]}
    assert "TokenChunk.top_logprobs[1]" in _reason(_raw(["token_chunk", payload]))
    payload = _fields(SAMPLES[11]) | {"logprobs": [-0.1, "x"]}
    assert "TokenChunk.logprobs[1]: expected float" in _reason(_raw(["token_chunk", payload]))


def test_free_form_map_needs_string_keys() -> None:
    payload = _fields(SAMPLES[8]) | {"load": {1: 2}}
    with pytest.raises(MalformedMessage):
        decode(_raw(["heartbeat", payload]))


def _json_reason(text: str | bytes) -> str:
    with pytest.raises(MalformedMessage) as info:
        decode_json(text)
    return str(info.value)


def test_json_malformed_inputs_are_rejected() -> None:
    payload = json.loads(encode_json(SAMPLES[0]))[1]
    assert "not JSON" in _json_reason("{not json")
    assert "not JSON" in _json_reason(b"\xff\xfe\x00")
    assert "expected [tag, fields]" in _json_reason('{"tag": "peer_hello"}')
    assert "unknown tag" in _json_reason('["nope", {}]')
    bad_b64 = json.dumps(["peer_hello", payload | {"backend_metadata": "!!not base64!!"}])
    assert _json_reason(bad_b64) == "PeerHello.backend_metadata: not valid base64"
    not_str = json.dumps(["peer_hello", payload | {"backend_metadata": 12}])
    assert "expected base64 string, got int" in _json_reason(not_str)
    bool_int = json.dumps(["peer_hello", payload | {"num_pages": True}])
    assert _json_reason(bool_int) == "PeerHello.num_pages: expected int, got bool"
    extra = json.dumps(["peer_hello", payload | {"x": 1}])
    assert "unknown field(s) 'x'" in _json_reason(extra)
    missing = json.dumps(["peer_hello", {k: v for k, v in payload.items() if k != "role"}])
    assert _json_reason(missing) == "PeerHello: missing field 'role'"
    huge = json.dumps(["transfer_request", _fields(SAMPLES[2]) | {"lease_s": 10**400}])
    assert "too large" in _json_reason(huge)
