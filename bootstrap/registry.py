"""The node registry: registration with the cluster token and protocol check, leases, node table.

One owner of the table. A node's entry lives from ``register`` until it deregisters, its
lease expires (no heartbeat for ``lease_s``), or another instance of it takes over:

    register ──▶ LIVE ──heartbeat──▶ LIVE
                  │ expire() / deregister / register of a new instance after expiry
                  ▼
               removed  (listeners hear (node_id, reason) unless it deregistered)

Identity: every node process has an instance id, new at each start. While a node id's
lease is live, only its own instance may register, heartbeat or deregister under it;
another instance (a stranger with the token and fake endpoints, or a restart before the
old lease ran out) is refused with 409. Once the lease expires the new instance takes
over. The same instance registering again (it lost our answer) just refreshes its entry.

A removal other than a deregistration is a loss: listeners (the gateway) fail the rooms
routed to the node at once. A deregistering node drains its in-flight work itself.
The clock is injected; ``expire()`` is called by the service's timer.

A lease counts only the time the registry was running to hear heartbeats. With
``pause_after_s`` set (the service sets it to twice its timer's interval), a gap longer than
that between any two calls is the registry's own pause (the process was stopped, starved of
CPU, or its pod frozen): every node's silence is shortened by the gap, so that a gateway
resuming from a pause past the leases does not drop every node at once and answer 503 "no
prefill node is registered" while they are beating at its door. A node that did die during
the pause is dropped one lease of running time later (sooner through its closed connection).

Thread safe: the registry's HTTP server runs on a thread of its own (so API load never
delays a heartbeat) while the gateway reads views on its event loop; every public call
holds one lock. Listeners may be called on either thread.
"""

from __future__ import annotations

import base64
import functools
import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from common import messages as msg

logger = logging.getLogger(__name__)

NODE_ROLES = ("prefill", "decode")
DEFAULT_LEASE_S = 10.0
# A node is reported unhealthy once it missed about two heartbeats (they come every lease/3).
UNHEALTHY_AFTER_LEASE_FRACTION = 2.0 / 3.0

NodeLostListener = Callable[[str, str], None]
P = ParamSpec("P")
R = TypeVar("R")


def _locked(method: Callable[P, R]) -> Callable[P, R]:
    """Run a NodeRegistry method under the registry's lock."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with args[0]._lock:  # type: ignore[attr-defined]
            return method(*args, **kwargs)

    return wrapper


class RegistryError(Exception):
    """A refused registry call: the HTTP status and a one-line reason."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclass
class NodeEntry:
    """A live node: its registration, its last reported load and when it was last heard."""

    info: msg.RegisterNode
    registered_at: float
    last_seen: float
    load: dict[str, Any]
    # When the gateway saw the node close its request connection (it died or restarted);
    # unhealthy and never routed to until a heartbeat comes after it.
    unreachable_since: float | None = None

    def is_reachable(self) -> bool:
        return self.unreachable_since is None or self.last_seen > self.unreachable_since


@dataclass(frozen=True)
class NodeView:
    """A snapshot of one live node for the router and the gateway."""

    node_id: str
    role: str
    is_healthy: bool
    request_endpoint: str
    control_endpoint: str
    num_pages: int
    load: dict[str, Any]
    instance_id: str = ""
    kv_events_endpoint: str = ""
    page_size: int = 0  # of its KV layout (0: not given)
    colocated_with: str = ""  # the other half of a colocated process ("" : none)
    caches_prefixes: bool = False  # a decode node with a prefix cache
    # False from the node closing its request connection to its next heartbeat: a process
    # that died (the kernel closed its sockets), long before its lease runs out.
    is_reachable: bool = True


def _page_size(layout: dict[str, Any]) -> int:
    value = layout.get("page_size") if isinstance(layout, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value, if that is its shape."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


def check_token(expected: str | None, *candidates: str | None) -> bool:
    """Whether one of ``candidates`` is the cluster token (always true when none is set)."""
    if expected is None:
        return True
    want = expected.encode()
    return any(c is not None and hmac.compare_digest(c.encode(), want) for c in candidates)


class NodeRegistry:
    """Registered nodes with leases; the only owner of the node table."""

    def __init__(
        self,
        auth_token: str | None,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
        pause_after_s: float | None = None,
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        if pause_after_s is not None and pause_after_s <= 0:
            raise ValueError(f"pause_after_s must be > 0, got {pause_after_s}")
        self.auth_token = auth_token
        self.lease_s = lease_s
        self.pause_after_s = pause_after_s  # None: no pause detection (no timer calls us)
        self.paused_s = 0.0  # the registry's own pauses so far, in seconds
        # The instance id of the gateway serving this registry, told to every node in each
        # answer: nodes abort requests of a gateway they no longer hear from.
        self.gateway_id = ""
        self._clock = clock
        self._awake_at = clock()  # when any call last ran
        self._nodes: dict[str, NodeEntry] = {}
        self._lost_listeners: list[NodeLostListener] = []
        self._lock = threading.RLock()

    def add_lost_listener(self, listener: NodeLostListener) -> None:
        """Call ``listener(node_id, reason)`` whenever a node is lost (not on deregister)."""
        self._lost_listeners.append(listener)

    # ---- calls from nodes ----------------------------------------------------------------

    @_locked
    def register(self, m: msg.RegisterNode, header_token: str | None = None) -> None:
        """Add (or replace) a node; raises RegistryError 401 or 400."""
        self._authorize(m.auth_token, header_token)
        if not msg.is_supported_protocol(m.protocol_version):
            raise RegistryError(
                400,
                f"protocol version {m.protocol_version} is not supported; this bootstrap "
                f"speaks version {msg.PROTOCOL_VERSION}: run matching pdserve builds",
                "protocol_version_mismatch",
            )
        if m.role not in NODE_ROLES:
            raise RegistryError(
                400, f"role must be one of {', '.join(NODE_ROLES)}, got {m.role!r:.40}", "bad_role"
            )
        for name in ("node_id", "request_endpoint"):
            if not getattr(m, name):
                raise RegistryError(400, f"{name} must not be empty", "bad_field")
        if m.num_pages < 0 or m.max_running_requests < 0:
            raise RegistryError(400, "num_pages and max_running_requests must be >= 0", "bad_field")
        now = self._now()
        old = self._nodes.get(m.node_id)
        if old is not None and old.info.instance_id != m.instance_id:
            if now - old.last_seen <= self.lease_s:
                logger.warning("refused a second instance of live node %s", m.node_id)
                raise RegistryError(
                    409,
                    f"node id {m.node_id!r:.80} is registered by another live instance; "
                    f"retry after its lease ({self.lease_s:g} s) runs out",
                    "node_id_in_use",
                )
            del self._nodes[m.node_id]  # its lease ran out before expire() got to it
            self._notify_lost(m.node_id, f"node {m.node_id} lost: its lease expired")
            old = None
        self._nodes[m.node_id] = NodeEntry(info=m, registered_at=now, last_seen=now, load={})
        logger.info("registered %s node %s at %s", m.role, m.node_id, m.request_endpoint)

    @_locked
    def heartbeat(self, m: msg.Heartbeat, header_token: str | None = None) -> None:
        """Renew a lease and store the load; raises RegistryError 401 or 404 (register again)."""
        self._authorize(m.auth_token, header_token)
        entry = self._nodes.get(m.node_id)
        if entry is None:
            raise RegistryError(
                404, f"unknown node {m.node_id!r:.80}; register again", "unknown_node"
            )
        if entry.info.instance_id != m.instance_id:
            raise RegistryError(
                409, f"node id {m.node_id!r:.80} belongs to another instance", "node_id_in_use"
            )
        entry.last_seen = self._now()
        entry.load = dict(m.load)

    @_locked
    def deregister(self, m: msg.Deregister, header_token: str | None = None) -> bool:
        """Remove a node that is leaving; whether it was registered. Raises RegistryError 401."""
        self._authorize(m.auth_token, header_token)
        entry = self._nodes.get(m.node_id)
        if entry is None:
            return False
        if entry.info.instance_id != m.instance_id:
            raise RegistryError(
                409, f"node id {m.node_id!r:.80} belongs to another instance", "node_id_in_use"
            )
        del self._nodes[m.node_id]
        logger.info("node %s deregistered", m.node_id)
        return True

    def _authorize(self, body_token: str | None, header_token: str | None) -> None:
        if not check_token(self.auth_token, body_token, header_token):
            raise RegistryError(
                401,
                "missing or wrong cluster token (--auth-token / PDSERVE_AUTH_TOKEN)",
                "invalid_auth_token",
            )

    # ---- leases --------------------------------------------------------------------------

    def _now(self) -> float:
        """The clock; a gap since the last call longer than ``pause_after_s`` was our own
        pause, and no node's silence (call under the lock)."""
        now = self._clock()
        gap = now - self._awake_at
        self._awake_at = now
        if self.pause_after_s is not None and gap > self.pause_after_s and self._nodes:
            self.paused_s += gap
            for entry in self._nodes.values():
                entry.last_seen += gap
                if entry.unreachable_since is not None:
                    entry.unreachable_since += gap
            logger.warning(
                "the registry did not run for %.1f s (paused or starved): the nodes' leases "
                "do not count it",
                gap,
            )
        return now

    @_locked
    def expire(self) -> list[str]:
        """Remove every node whose lease ran out; their ids (listeners are told)."""
        now = self._now()
        expired = [i for i, e in self._nodes.items() if now - e.last_seen > self.lease_s]
        for node_id in expired:
            del self._nodes[node_id]
            logger.warning("node %s lost: no heartbeat for %.1f s", node_id, self.lease_s)
            self._notify_lost(node_id, f"node {node_id} lost: its lease expired")
        return expired

    def _notify_lost(self, node_id: str, reason: str) -> None:
        for listener in self._lost_listeners:
            try:
                listener(node_id, reason)
            except Exception:  # a listener's bug must not corrupt the table
                logger.exception("node-lost listener failed for %s", node_id)

    # ---- reads ---------------------------------------------------------------------------

    @_locked
    def __len__(self) -> int:
        return len(self._nodes)

    @_locked
    def views(self, role: str | None = None) -> list[NodeView]:
        """Snapshots of the live nodes (of ``role``), in registration order."""
        now = self._now()
        return [
            NodeView(
                node_id=node_id,
                role=e.info.role,
                is_healthy=self._is_healthy(e, now),
                request_endpoint=e.info.request_endpoint,
                control_endpoint=e.info.control_endpoint,
                num_pages=e.info.num_pages,
                load=e.load,
                instance_id=e.info.instance_id,
                kv_events_endpoint=e.info.kv_events_endpoint,
                page_size=_page_size(e.info.kv_layout),
                colocated_with=e.info.colocated_with,
                caches_prefixes=e.info.caches_prefixes,
                is_reachable=e.is_reachable(),
            )
            for node_id, e in self._nodes.items()
            if role is None or e.info.role == role
        ]

    def _is_healthy(self, entry: NodeEntry, now: float) -> bool:
        return (
            now - entry.last_seen <= self.lease_s * UNHEALTHY_AFTER_LEASE_FRACTION
            and entry.is_reachable()
        )

    @_locked
    def mark_unreachable(self, request_endpoint: str) -> list[str]:
        """The nodes at ``request_endpoint`` closed their connection: unreachable (and not
        routed to) until their next heartbeat; their ids."""
        now = self._now()
        hit = [i for i, e in self._nodes.items() if e.info.request_endpoint == request_endpoint]
        for node_id in hit:
            self._nodes[node_id].unreachable_since = now
            logger.warning("node %s closed its request connection: unreachable", node_id)
        return hit

    @_locked
    def table(self) -> list[dict[str, Any]]:
        """The node table as JSON objects (the shape of ``GET /nodes``); never the token."""
        now = self._now()
        rows = []
        for node_id, e in self._nodes.items():
            info = e.info
            http_url = info.http_url.rstrip("/")
            rows.append(
                {
                    "id": node_id,
                    "role": info.role,
                    "healthy": self._is_healthy(e, now),
                    "metrics_url": f"{http_url}/metrics" if http_url else "",
                    "http_url": http_url,
                    "request_endpoint": info.request_endpoint,
                    "control_endpoint": info.control_endpoint,
                    "kv_events_endpoint": info.kv_events_endpoint,
                    "colocated_with": info.colocated_with,
                    "caches_prefixes": info.caches_prefixes,
                    "num_pages": info.num_pages,
                    "max_running_requests": info.max_running_requests,
                    "load": e.load,
                    "backend": info.backend,
                    "backend_metadata": base64.b64encode(info.backend_metadata).decode("ascii"),
                    "kv_layout": info.kv_layout,
                    "protocol_version": info.protocol_version,
                    "instance_id": info.instance_id,
                    "registered_s_ago": round(now - e.registered_at, 3),
                    "last_heartbeat_s_ago": round(now - e.last_seen, 3),
                }
            )
        return rows
