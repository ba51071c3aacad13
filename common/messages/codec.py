"""The one registry of wire messages and their msgpack / JSON codec with validation on decode."""

import base64
import json
from typing import Any, Final

import msgpack  # type: ignore[import-untyped]

from common.messages.base import MalformedMessage, Message
from common.messages.cluster import Deregister, Heartbeat, RegisterNode
from common.messages.generation import (
    GenerateReq,
    PromptLogprobs,
    ReqFailed,
    ReqFinished,
    TokenChunk,
)
from common.messages.kv_events import KVEvents, KVSnapshotRequest
from common.messages.schema import FieldSpec, schema_of
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
        schema_of(cls)
    if len(_TAG_OF) != len(MESSAGE_TYPES):
        raise TypeError("a message class is registered under two tags")


_check_registry()


def message_types() -> tuple[type[Message], ...]:
    """Every registered message class, in registry order."""
    return tuple(MESSAGE_TYPES.values())


def _tag_and_schema(msg: Message) -> tuple[str, tuple[FieldSpec, ...]]:
    tag = _TAG_OF.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message type")
    return tag, schema_of(type(msg))


def encode(msg: Message) -> bytes:
    """msgpack of ``[tag, {field: value}]``."""
    tag, schema = _tag_and_schema(msg)
    payload = {spec.name: getattr(msg, spec.name) for spec in schema}
    data: bytes = msgpack.packb([tag, payload], use_bin_type=True)
    return data


def decode(data: bytes) -> Message:
    """Parse and validate msgpack bytes; raises MalformedMessage with a one-line reason."""
    try:
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MalformedMessage(f"not msgpack: {type(exc).__name__}") from None
    return _from_obj(obj, is_json=False)


def to_jsonable(msg: Message) -> list[Any]:
    """``[tag, {field: value}]`` with bytes as base64 strings, ready for ``json.dumps``."""
    tag, schema = _tag_and_schema(msg)
    return [tag, {spec.name: _jsonable(getattr(msg, spec.name)) for spec in schema}]


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
        raise MalformedMessage(f"expected [tag, fields], got {_shape(obj)}")
    tag, payload = obj
    if not isinstance(tag, str):
        raise MalformedMessage(f"tag must be a string, got {type(tag).__name__}")
    cls = MESSAGE_TYPES.get(tag)
    if cls is None:
        raise MalformedMessage(f"unknown tag {tag!r:.60}")
    name = cls.__name__
    if not isinstance(payload, dict):
        raise MalformedMessage(f"{name}: fields must be a map, got {type(payload).__name__}")
    schema = schema_of(cls)
    unknown = payload.keys() - {spec.name for spec in schema}
    if unknown:
        listed = ", ".join(sorted(f"{k!r:.40}" for k in unknown))
        raise MalformedMessage(f"{name}: unknown field(s) {listed:.200}")
    kwargs: dict[str, Any] = {}
    for spec in schema:
        if spec.name not in payload:
            if spec.is_required:
                raise MalformedMessage(f"{name}: missing field {spec.name!r}")
            continue
        convert = spec.from_json if is_json else spec.from_msgpack
        kwargs[spec.name] = convert(payload[spec.name], f"{name}.{spec.name}")
    return cls(**kwargs)


def _shape(obj: Any) -> str:
    if isinstance(obj, list):
        return f"list of {len(obj)}"
    return type(obj).__name__
