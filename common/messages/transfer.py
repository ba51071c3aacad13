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
    # New at each start of the sender's process: a peer that restarted is a new peer.
    instance_id: str = ""


@dataclass(frozen=True, slots=True)
class PeerHelloAck(Message):
    """Prefill -> decode answer to PeerHello; ``reason`` explains a refusal."""

    TAG: ClassVar[str] = "peer_hello_ack"
    node_id: str
    control_endpoint: str
    accepted: bool
    reason: str
    instance_id: str = ""


@dataclass(frozen=True, slots=True)
class TransferRequest(Message):
    """Decode -> prefill: write room's KV into ``dst_pages`` and aux data into ``aux_slot``."""

    TAG: ClassVar[str] = "transfer_request"
    room: int
    node_id: str
    dst_pages: list[int]
    aux_slot: int
    lease_s: float
    instance_id: str = ""
    # Where to answer when the prefill node does not know us (PeerReset).
    control_endpoint: str = ""
    # Leading pages of the room's KV the decode node holds already (its prefix cache):
    # ``dst_pages`` are for the pages after them, and only those move.
    num_held_pages: int = 0


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
    instance_id: str = ""
    # The prefill node's wall-clock marks of this request (common/stages.py).
    marks: dict[str, float] | None = None
    # Prompt tokens served from the prefill node's radix cache (usage.cached_tokens).
    num_cached_tokens: int = 0
    # GenerateReq.return_prompt_logprobs: the logprob of each prompt token after the first
    # and its top alternatives ((token_id, logprob) pairs, best first); None: not asked.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[Any]] | None = None


@dataclass(frozen=True, slots=True)
class TransferFailed(Message):
    """Prefill -> decode: the room's KV will not arrive, and nothing of ours is in flight
    into its pages any more (the writer's explicit stop); ``reason`` says why."""

    TAG: ClassVar[str] = "transfer_failed"
    room: int
    node_id: str
    reason: str
    instance_id: str = ""


@dataclass(frozen=True, slots=True)
class LeaseRenew(Message):
    """Writer (prefill) -> receiver (decode): I am alive and still writing these rooms;
    grant me their pages for another lease. ``seq`` is echoed in the LeaseGrant, so the
    writer dates the grant by its own clock at sending (transfer/fence.py)."""

    TAG: ClassVar[str] = "lease_renew"
    node_id: str
    rooms: list[int]
    instance_id: str = ""
    seq: int = 0


@dataclass(frozen=True, slots=True)
class LeaseGrant(Message):
    """Receiver -> writer, the answer to LeaseRenew ``seq``: the pages of ``granted`` rooms
    stay theirs for ``lease_s`` from now on the receiver's clock; ``released`` rooms are
    no longer wanted (the writer must stop)."""

    TAG: ClassVar[str] = "lease_grant"
    node_id: str
    instance_id: str
    seq: int
    lease_s: float
    granted: list[int]
    released: list[int]


@dataclass(frozen=True, slots=True)
class PeerReset(Message):
    """Prefill -> decode: I do not know you (I restarted, or forgot you): say PeerHello
    again, then resend the TransferRequests of ``rooms``."""

    TAG: ClassVar[str] = "peer_reset"
    node_id: str
    instance_id: str
    control_endpoint: str
    rooms: list[int]


@dataclass(frozen=True, slots=True)
class LateWrite(Message):
    """Writer -> receiver: a write into ``dst_pages`` of ``room`` may have landed after the
    room's fence had passed (the writer was paused while posting it)."""

    TAG: ClassVar[str] = "late_write"
    node_id: str
    instance_id: str
    room: int
    dst_pages: list[int]


@dataclass(frozen=True, slots=True)
class AbortReq(Message):
    """Gateway -> nodes or node -> node: abort a request, named by room or rid (or both)."""

    TAG: ClassVar[str] = "abort_req"
    node_id: str
    room: int | None
    rid: str | None
    reason: str
    instance_id: str = ""
