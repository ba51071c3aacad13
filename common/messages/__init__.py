"""Wire messages: frozen dataclasses, one explicit tag registry, msgpack/JSON codec, version."""

from common.messages.base import PROTOCOL_VERSION, MalformedMessage, Message, is_supported_protocol
from common.messages.cluster import Deregister, Heartbeat, RegisterNode
from common.messages.codec import (
    MESSAGE_TYPES,
    decode,
    decode_json,
    encode,
    encode_json,
    from_jsonable,
    message_types,
    to_jsonable,
)
from common.messages.generation import (
    GenerateReq,
    PromptLogprobs,
    ReqFailed,
    ReqFinished,
    TokenChunk,
)
from common.messages.kv_events import KVEvents, KVSnapshotRequest
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

__all__ = [
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "AbortReq",
    "Deregister",
    "GenerateReq",
    "Heartbeat",
    "KVEvents",
    "KVSnapshotRequest",
    "LateWrite",
    "LeaseGrant",
    "LeaseRenew",
    "PeerReset",
    "PromptLogprobs",
    "MalformedMessage",
    "Message",
    "PeerHello",
    "PeerHelloAck",
    "RegisterNode",
    "ReqFailed",
    "ReqFinished",
    "TokenChunk",
    "TransferDone",
    "TransferFailed",
    "TransferRequest",
    "decode",
    "decode_json",
    "encode",
    "encode_json",
    "from_jsonable",
    "is_supported_protocol",
    "message_types",
    "to_jsonable",
]
