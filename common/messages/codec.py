"""The one registry of wire messages and their msgpack / JSON codec with validation on decode."""

import base64
import json
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack  # type: ignore[import-untyped]

from common.messages.base import MalformedMessage, Message
from common.messages.cluster import Deregister, Heartbeat, RegisterNode
from common.messages.generation import (
    GenerateReq,
    PromptLogprobs,
    ReplyBatch,
    ReqFailed,
    ReqFinished,
    TokenChunk,
)
from common.messages.kv_events import KVEvents, KVSnapshotRequest
from common.messages.schema import build, message_converter, schema_of, shape, wire_fields
from common.messages.transfer import (
    AbortReq,
    LateWrite,
    LeaseGrant,
    LeaseRenew,
    PeerHello,
    PeerHelloAck,
    PeerReset,
    TransferDone,
    TransferFailed,
    TransferRequest,
)

# The explicit registry: wire tag -> message class. A class not listed here cannot be
# encoded or decoded; nothing is looked up by name anywhere else.
MESSAGE_TYPES: Final[dict[str, type[Message]]] = {
    PeerHello.TAG: PeerHello,
    PeerHelloAck.TAG: PeerHelloAck,
    TransferRequest.TAG: TransferRequest,
    TransferDone.TAG: TransferDone,
    TransferFailed.TAG: TransferFailed,
    LeaseRenew.TAG: LeaseRenew,
    LeaseGrant.TAG: LeaseGrant,
    PeerReset.TAG: PeerReset,
    LateWrite.TAG: LateWrite,
    AbortReq.TAG: AbortReq,
    RegisterNode.TAG: RegisterNode,
    Heartbeat.TAG: Heartbeat,
    Deregister.TAG: Deregister,
    GenerateReq.TAG: GenerateReq,
    TokenChunk.TAG: TokenChunk,
    PromptLogprobs.TAG: PromptLogprobs,
    ReqFinished.TAG: ReqFinished,
    ReqFailed.TAG: ReqFailed,
    ReplyBatch.TAG: ReplyBatch,
    KVEvents.TAG: KVEvents,
    KVSnapshotRequest.TAG: KVSnapshotRequest,
}
_TAG_OF: Final[dict[type[Message], str]] = {cls: tag for tag, cls in MESSAGE_TYPES.items()}


def _check_registry() -> None:
    """Fail at import, not on the first message, if the registry or a schema is wrong."""
    for tag, cls in MESSAGE_TYPES.items():
        if cls.TAG != tag:
            raise TypeError(f"{cls.__name__}.TAG is {cls.TAG!r} but it is registered as {tag!r}")
        if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")
        for spec in schema_of(cls):
            for inner in spec.nested:
                where = f"{cls.__name__}.{spec.name}"
                if _TAG_OF.get(inner) != inner.TAG:
                    raise TypeError(f"{where} holds {inner.__name__}, which is not registered")
                if any(s.nested for s in schema_of(inner)):  # one level: no batch in a batch
                    raise TypeError(f"{where} holds {inner.__name__}, which holds messages")
    if len(_TAG_OF) != len(MESSAGE_TYPES):
        raise TypeError("a message class is registered under two tags")


_check_registry()

# One ReplyBatch entry's validator: unpack drops a malformed entry alone.
_REPLY_ENTRY: Final = message_converter(schema_of(ReplyBatch)[0].nested, is_json=False)


def message_types() -> tuple[type[Message], ...]:
    """Every registered message class, in registry order."""
    return tuple(MESSAGE_TYPES.values())


def _tag_of(msg: Message) -> str:
    tag = _TAG_OF.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message type")
    return tag


def encode(msg: Message) -> bytes:
    """msgpack of ``[tag, {field: value}]`` (a nested message is its own ``[tag, fields]``)."""
    data: bytes = msgpack.packb([_tag_of(msg), wire_fields(msg)], use_bin_type=True)
    return data


def decode(data: bytes) -> Message:
    """Parse and validate msgpack bytes; raises MalformedMessage with a one-line reason."""
    return _from_obj(_unpackb(data), is_json=False)


@dataclass(frozen=True, slots=True)
class Unpacked:
    """What one frame carries, in order, and why any ReplyBatch entry was dropped."""

    messages: list[Message]
    dropped: list[str] = field(default_factory=list)


def unpack(data: bytes) -> Unpacked:
    """The messages of one frame: a ReplyBatch's entries (it is not kept), else the message.

    A malformed entry is dropped alone, its one-line reason in ``dropped``; a frame that is
    not a message (or a ReplyBatch whose envelope is wrong) raises MalformedMessage.
    """
    obj = _unpackb(data)
    if not (isinstance(obj, list) and len(obj) == 2 and obj[0] == ReplyBatch.TAG):
        return Unpacked([_from_obj(obj, is_json=False)])
    payload = obj[1]
    entries = payload.get("messages") if isinstance(payload, dict) else None
    if not isinstance(entries, list) or len(payload) != 1:
        raise MalformedMessage("ReplyBatch: fields must be {messages: [...]} alone")
    unpacked = Unpacked([])
    for i, entry in enumerate(entries):
        try:
            unpacked.messages.append(_REPLY_ENTRY(entry, f"ReplyBatch.messages[{i}]"))
        except MalformedMessage as exc:
            unpacked.dropped.append(str(exc))
    return unpacked


def _unpackb(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MalformedMessage(f"not msgpack: {type(exc).__name__}") from None


def to_jsonable(msg: Message) -> list[Any]:
    """``[tag, {field: value}]`` with bytes as base64 strings, ready for ``json.dumps``."""
    return [_tag_of(msg), _jsonable(wire_fields(msg))]


def from_jsonable(obj: Any) -> Message:
    """Validate an already parsed JSON value (e.g. an HTTP body) as a message."""
    return _from_obj(obj, is_json=True)


def encode_json(msg: Message) -> str:
    """JSON text of ``[tag, {field: value}]``; bytes fields are base64 strings."""
    return json.dumps(to_jsonable(msg), separators=(",", ":"))


def decode_json(data: str | bytes) -> Message:
    """Parse and validate JSON text; raises MalformedMessage with a one-line reason."""
    try:
        obj = json.loads(data)
    except (ValueError, TypeError, RecursionError) as exc:
        raise MalformedMessage(f"not JSON: {type(exc).__name__}") from None
    return _from_obj(obj, is_json=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _from_obj(obj: Any, *, is_json: bool) -> Message:
    if not isinstance(obj, list) or len(obj) != 2:
        raise MalformedMessage(f"expected [tag, fields], got {shape(obj)}")
    tag, payload = obj
    if not isinstance(tag, str):
        raise MalformedMessage(f"tag must be a string, got {type(tag).__name__}")
    cls = MESSAGE_TYPES.get(tag)
    if cls is None:
        raise MalformedMessage(f"unknown tag {tag!r:.60}")
    return build(cls, payload, cls.__name__, is_json=is_json)
