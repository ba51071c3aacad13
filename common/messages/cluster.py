"""Registry messages from nodes to the bootstrap service (zmq or JSON over HTTP)."""

from dataclasses import dataclass
from typing import Any, ClassVar

from common.messages.base import Message


@dataclass(frozen=True, slots=True)
class RegisterNode(Message):
    """Node -> bootstrap: join the cluster with endpoints, transfer metadata and capacity."""

    TAG: ClassVar[str] = "register_node"
    node_id: str
    role: str
    request_endpoint: str
    control_endpoint: str
    http_url: str
    backend: str
    backend_metadata: bytes
    kv_layout: dict[str, Any]
    num_pages: int
    max_running_requests: int
    protocol_version: int
    auth_token: str | None
    # New at each start of the node's process; a live node id with another instance is
    # refused (409) until the live one's lease runs out.
    instance_id: str = ""
    # Prefill: the PUB endpoint of its KV events ("" : it publishes none).
    kv_events_endpoint: str = ""
    # A colocated process registers a prefill and a decode node, each naming the other
    # here: the router pairs them with each other only (their KV hand-over is in memory).
    colocated_with: str = ""
    # Decode: it keeps finished requests' KV in a prefix cache; the gateway keeps a
    # conversation on the node that served its last turn (session affinity).
    caches_prefixes: bool = False


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Node -> bootstrap: renew the node's lease and report its load."""

    TAG: ClassVar[str] = "heartbeat"
    node_id: str
    load: dict[str, Any]
    auth_token: str | None
    instance_id: str = ""


@dataclass(frozen=True, slots=True)
class Deregister(Message):
    """Node -> bootstrap: leave the cluster now instead of letting the lease expire."""

    TAG: ClassVar[str] = "deregister"
    node_id: str
    auth_token: str | None
    instance_id: str = ""
