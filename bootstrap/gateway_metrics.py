"""Gateway metrics beyond common.metrics: router decisions, prefix-affinity hits, requests in flight.

Registered on ``common.metrics.REGISTRY`` with the ``role`` label like every pdserve metric.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge

from common import metrics

ROUTER_DECISIONS: Final = Counter(
    "pdserve_router_decisions_total",
    "Pairs chosen by the router, by how the prefill node was chosen: affinity (the key's "
    "home node on the ring), spilled (home over the load bound), routing_key (home by key).",
    ("role", "decision"),
    registry=metrics.REGISTRY,
)
PREFIX_AFFINITY_HITS: Final = Counter(
    "pdserve_prefix_affinity_hits_total",
    "Requests sent to the prefill node their affinity key was last sent to (likely cached).",
    ("role",),
    registry=metrics.REGISTRY,
)
GATEWAY_INFLIGHT: Final = Gauge(
    "pdserve_gateway_inflight_requests",
    "Requests admitted by the gateway and not yet ended (bounded by --max-queued-requests).",
    ("role",),
    registry=metrics.REGISTRY,
)
REGISTERED_NODES: Final = Gauge(
    "pdserve_registered_nodes",
    "Nodes holding a live lease, by node role.",
    ("role", "node_role"),
    registry=metrics.REGISTRY,
)
NODES_LOST: Final = Counter(
    "pdserve_nodes_lost_total",
    "Nodes removed for an expired lease or a re-registration (their requests failed).",
    ("role",),
    registry=metrics.REGISTRY,
)


def count_decision(decision: str, is_affinity_hit: bool) -> None:
    ROUTER_DECISIONS.labels(**metrics.role_labels(decision=decision)).inc()
    if is_affinity_hit:
        PREFIX_AFFINITY_HITS.labels(**metrics.role_labels()).inc()


def count_request(outcome: str) -> None:
    metrics.REQUESTS.labels(**metrics.role_labels(outcome=outcome)).inc()
