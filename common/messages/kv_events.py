"""KV events: what a prefill node's radix cache gains and loses, for the gateway's index."""

from dataclasses import dataclass
from typing import ClassVar

from common.messages.base import Message


@dataclass(frozen=True, slots=True)
class KVEvents(Message):
    """Prefill -> every gateway (PUB/SUB, CURVE like every socket): one batch of cache changes.

    ``stored`` and ``removed`` are packed little-endian uint64 page hashes
    (common/page_hash.py), the net change since the previous batch. ``seq`` grows by one
    per batch that changes something; a keepalive repeats the last one. A snapshot
    (``is_snapshot``) lists every page the cache holds in ``stored`` and replaces what the
    subscriber had for this node. ``queued_tokens``: prompt tokens waiting to be
    prefilled on the node (the router's load). With a host tier under the node's cache,
    ``stored_host`` lists the pages now held on the host alone (a snapshot: every such
    page), ``stored`` those on the device (again, when loaded back), and
    ``host_load_cost`` what loading a page back costs there as a fraction of computing it
    (measured on the node)."""

    TAG: ClassVar[str] = "kv_events"
    node_id: str
    instance_id: str
    seq: int
    stored: bytes
    removed: bytes
    is_snapshot: bool
    queued_tokens: int
    num_pages: int
    stored_host: bytes = b""
    host_load_cost: float = 0.0


@dataclass(frozen=True, slots=True)
class KVSnapshotRequest(Message):
    """Gateway -> prefill (its request socket): publish a snapshot of your cache; sent
    on a gap in ``seq``, a new node instance or a subscriber that joined late."""

    TAG: ClassVar[str] = "kv_snapshot_request"
    gateway_id: str
