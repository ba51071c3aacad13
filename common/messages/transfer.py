"""Transfer control messages between decode and prefill nodes (the prefill control socket)."""

from dataclasses import dataclass
from typing import Any, ClassVar

from common.messages.base import Message


@dataclass(frozen=True, slots=True)
class PeerHello(Message):
    """Decode -> prefill greeting: who I am, my transfer backend metadata and KV layout."""

    TAG: ClassVar[str] = "peer_hello"
    node_id: str
    role: str
    control_endpoint: str
    backend: str
    backend_metadata: bytes
    kv_layout: dict[str, Any]
    num_pages: int
    protocol_version: int
    auth_token: str | None


@dataclass(frozen=True, slots=True)
class PeerHelloAck(Message):
    """Prefill -> decode answer to PeerHello; ``reason`` explains a refusal."""

    TAG: ClassVar[str] = "peer_hello_ack"
    node_id: str
    control_endpoint: str
    accepted: bool
    reason: str


@dataclass(frozen=True, slots=True)
class TransferRequest(Message):
    """Decode -> prefill: write room's KV into ``dst_pages`` and aux data into ``aux_slot``."""

    TAG: ClassVar[str] = "transfer_request"
    room: int
    node_id: str
    dst_pages: list[int]
    aux_slot: int
    lease_s: float


@dataclass(frozen=True, slots=True)
class TransferDone(Message):
    """Prefill -> decode: all pages of a room are written; carries the first sampled token."""

    TAG: ClassVar[str] = "transfer_done"
    room: int
    node_id: str
    first_token_id: int
    first_logprob: float | None
    # (token_id, logprob) pairs of the first position, best first.
    top_logprobs: list[list[Any]]
    room_echo: int
    num_pages: int


@dataclass(frozen=True, slots=True)
class TransferFailed(Message):
    """Prefill -> decode: the room's KV will not arrive; ``reason`` says why."""

    TAG: ClassVar[str] = "transfer_failed"
    room: int
    node_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class LeaseRenew(Message):
    """Decode -> prefill: these rooms are still wanted; extend their leases."""

    TAG: ClassVar[str] = "lease_renew"
    node_id: str
    rooms: list[int]


@dataclass(frozen=True, slots=True)
class AbortReq(Message):
    """Gateway -> nodes or node -> node: abort a request, named by room or rid (or both)."""

    TAG: ClassVar[str] = "abort_req"
    node_id: str
    room: int | None
    rid: str | None
    reason: str
