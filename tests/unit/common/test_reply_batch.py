"""Tests for ReplyBatch on the wire: its entries, what it refuses, and unpack's per-entry drop."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import msgpack  # type: ignore[import-untyped]
import pytest

from common.messages import (
    AbortReq,
    MalformedMessage,
    Message,
    PromptLogprobs,
    ReplyBatch,
    ReqFailed,
    ReqFinished,
    TokenChunk,
    codec,
    decode,
    decode_json,
    encode,
    encode_json,
    unpack,
)
from common.messages.schema import schema_of

CHUNK = TokenChunk(rid="a", token_ids=[5], logprobs=[-0.1], top_logprobs=[[[5, -0.1], [9, -2.0]]])
PLAIN = TokenChunk(rid="b", token_ids=[7], logprobs=None, top_logprobs=None, marks={"m": 1.5})
PROMPT = PromptLogprobs(rid="a", logprobs=[-1.0, -0.5], top_logprobs=[[[3, -1.0]], [[4, -0.5]]])
FINISHED = ReqFinished(
    rid="a",
    finish_reason="length",
    matched_stop=None,
    num_prompt_tokens=3,
    num_output_tokens=1,
    num_cached_tokens=0,
)
FAILED = ReqFailed(rid="b", status=503, error="prefill node lost", retryable=True)
EVERY_KIND: list[Any] = [PROMPT, CHUNK, PLAIN, FINISHED, FAILED]


def _raw(obj: Any) -> bytes:
    data: bytes = msgpack.packb(obj, use_bin_type=True)
    return data


def _entries(batch: ReplyBatch) -> list[Any]:
    """The batch's wire entries, ``[tag, fields]`` each, for tampering."""
    tag, payload = msgpack.unpackb(encode(batch), raw=False)
    assert tag == "reply_batch" and list(payload) == ["messages"]
    entries: list[Any] = payload["messages"]
    return entries


def test_every_gateway_reply_round_trips_in_order() -> None:
    batch = ReplyBatch(messages=EVERY_KIND)
    assert decode(encode(batch)) == batch
    assert decode_json(encode_json(batch)) == batch
    assert unpack(encode(batch)).messages == EVERY_KIND
    assert unpack(encode(batch)).dropped == []


def test_entries_are_tag_and_fields_inside_one_msgpack_not_bytes() -> None:
    entries = _entries(ReplyBatch(messages=[CHUNK, FAILED]))
    assert [e[0] for e in entries] == ["token_chunk", "req_failed"]
    assert entries[1][1] == dataclasses.asdict(FAILED)
    assert json.loads(encode_json(ReplyBatch(messages=[FAILED])))[1]["messages"] == [
        ["req_failed", dataclasses.asdict(FAILED)]
    ]


def test_an_empty_batch_round_trips() -> None:
    assert decode(encode(ReplyBatch(messages=[]))) == ReplyBatch(messages=[])
    assert unpack(encode(ReplyBatch(messages=[]))).messages == []


def test_a_lone_message_unpacks_as_itself() -> None:
    assert unpack(encode(CHUNK)).messages == [CHUNK]
    abort = AbortReq(node_id="gw", room=3, rid="a", reason="client gone")
    assert unpack(encode(abort)).messages == [abort]


@pytest.mark.parametrize(
    "inner",
    [
        pytest.param(ReplyBatch(messages=[CHUNK]), id="batch-in-batch"),
        pytest.param(AbortReq(node_id="gw", room=3, rid="a", reason="x"), id="not-a-reply"),
    ],
)
def test_encode_refuses_an_entry_that_is_no_gateway_reply(inner: Message) -> None:
    with pytest.raises(TypeError, match="cannot go where TokenChunk"):
        encode(ReplyBatch(messages=[CHUNK, inner]))  # type: ignore[list-item]
    with pytest.raises(TypeError):
        encode_json(ReplyBatch(messages=[inner]))  # type: ignore[list-item]


def _batch_of(*entries: Any) -> bytes:
    return _raw(["reply_batch", {"messages": list(entries)}])


NESTED = ["reply_batch", {"messages": [["token_chunk", dataclasses.asdict(CHUNK)]]}]
ABORT = ["abort_req", {"node_id": "gw", "room": 3, "rid": "a", "reason": "x"}]


@pytest.mark.parametrize(
    ("entry", "reason"),
    [
        pytest.param(NESTED, "tag 'reply_batch' is not one of TokenChunk", id="batch-in-batch"),
        pytest.param(ABORT, "tag 'abort_req' is not one of TokenChunk", id="not-a-reply"),
        pytest.param(["nope", {}], "tag 'nope' is not one of", id="unknown-tag"),
        pytest.param([7, {}], "tag 7 is not one of", id="tag-not-str"),
        pytest.param("token_chunk", "expected [tag, fields], got str", id="not-a-pair"),
        pytest.param(["req_failed", [1]], "ReqFailed: fields must be a map", id="fields-list"),
        pytest.param(
            ["req_failed", {"rid": "b", "status": "503", "error": "x"}],
            "ReplyBatch.messages[1]: ReqFailed.status: expected int, got str",
            id="bad-field",
        ),
        pytest.param(
            ["token_chunk", {"rid": "b", "token_ids": [1]}],
            "ReplyBatch.messages[1]: TokenChunk: missing field 'logprobs'",
            id="missing-field",
        ),
    ],
)
def test_a_malformed_entry_fails_decode_and_is_dropped_alone_by_unpack(
    entry: Any, reason: str
) -> None:
    good = _entries(ReplyBatch(messages=[CHUNK, FAILED]))
    data = _batch_of(good[0], entry, good[1])
    with pytest.raises(MalformedMessage) as info:
        decode(data)
    assert reason in str(info.value)
    unpacked = unpack(data)
    assert unpacked.messages == [CHUNK, FAILED]
    assert len(unpacked.dropped) == 1 and reason in unpacked.dropped[0]
    assert "\n" not in unpacked.dropped[0]


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(_raw(["reply_batch", [CHUNK.rid]]), id="fields-not-a-map"),
        pytest.param(_raw(["reply_batch", {}]), id="no-messages"),
        pytest.param(_raw(["reply_batch", {"messages": {"a": 1}}]), id="messages-not-a-list"),
        pytest.param(_raw(["reply_batch", {"messages": [], "x": 1}]), id="unknown-field"),
        pytest.param(b"\xc1\xc1", id="not-msgpack"),
    ],
)
def test_a_malformed_envelope_drops_the_whole_frame(data: bytes) -> None:
    with pytest.raises(MalformedMessage):
        unpack(data)
    with pytest.raises(MalformedMessage):
        decode(data)


def test_schema_refuses_messages_where_the_codec_cannot_carry_them() -> None:
    @dataclasses.dataclass(frozen=True)
    class InAMap(Message):
        TAG: ClassVar[str] = "in_a_map"
        replies: dict[str, TokenChunk]

    @dataclasses.dataclass(frozen=True)
    class Mixed(Message):
        TAG: ClassVar[str] = "mixed"
        reply: TokenChunk | None

    for cls in (InAMap, Mixed):
        with pytest.raises(TypeError):
            schema_of(cls)


def test_the_schema_knows_what_a_batch_holds() -> None:
    (spec,) = schema_of(ReplyBatch)
    assert spec.nested == (TokenChunk, PromptLogprobs, ReqFinished, ReqFailed)
    # One level deep: what a batch holds holds no message (codec._check_registry).
    assert all(not s.nested for cls in spec.nested for s in schema_of(cls))


def test_the_registry_refuses_a_message_that_nests_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    @dataclasses.dataclass(frozen=True)
    class Holder(Message):
        TAG: ClassVar[str] = "holder"
        batches: list[ReplyBatch]

    monkeypatch.setitem(codec.MESSAGE_TYPES, Holder.TAG, Holder)
    monkeypatch.setitem(codec._TAG_OF, Holder, Holder.TAG)
    with pytest.raises(TypeError, match="Holder.batches holds ReplyBatch, which holds messages"):
        codec._check_registry()
