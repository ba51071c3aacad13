"""Gateway metrics beyond common.metrics: router decisions, prefix-affinity hits, inflight requests.

Registered on ``common.metrics.REGISTRY`` with the ``role`` label like every pdserve metric.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram

from common import metrics

ROUTER_DECISIONS: Final = Counter(
    "pdserve_router_decisions_total",
    "Pairs chosen by the router, by how the prefill node was chosen: cache (precise: the "
    "least prefill work given the KV index), affinity (the key's home node on the ring), "
    "spilled (home over the load bound), routing_key (home by key), round_robin, random.",
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
REGISTRY_PAUSED: Final = Counter(
    "pdserve_registry_paused_seconds_total",
    "Time the gateway's registry did not run (the process was stopped or starved of CPU); "
    "node leases do not count it.",
    ("role",),
    registry=metrics.REGISTRY,
)


KV_EVENTS: Final = Counter(
    "pdserve_kv_events_total",
    "KV event batches from prefill nodes: applied, snapshot (a whole cache), gap (batches "
    "were lost; a snapshot is asked for), dropped (unknown node or instance, or malformed).",
    ("role", "outcome"),
    registry=metrics.REGISTRY,
)
KV_INDEX_PAGES: Final = Gauge(
    "pdserve_kv_index_pages",
    "Distinct cached page hashes in the gateway's KV index (precise prefix routing).",
    ("role",),
    registry=metrics.REGISTRY,
)
ROUTE_SECONDS: Final = Histogram(
    "pdserve_route_seconds",
    "Time to choose a request's pair, KV index lookup included (on the API event loop).",
    ("role",),
    buckets=(1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2),
    registry=metrics.REGISTRY,
)

NODE_DISCONNECTS: Final = Counter(
    "pdserve_node_disconnects_total",
    "Nodes that closed their request connection (a process that died or restarted): their "
    "requests move on at once and the node is not routed to until it is heard from again.",
    ("role",),
    registry=metrics.REGISTRY,
)
MIGRATIONS: Final = Counter(
    "pdserve_migrations_total",
    "Requests moved to another node pair mid-way, by why their pair failed: decode_lost, "
    "prefill_lost (the gateway lost the node), node_failure (a node failed it: transfer, "
    "handshake, drain, full queue).",
    ("role", "reason"),
    registry=metrics.REGISTRY,
)
MIGRATION_GAP_SECONDS: Final = Histogram(
    "pdserve_migration_gap_seconds",
    "The gap a migrated stream shows: from the last token before its pair failed (or from "
    "its arrival) to the first token from the new pair.",
    ("role",),
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0),
    registry=metrics.REGISTRY,
)


def count_decision(decision: str, is_affinity_hit: bool) -> None:
    ROUTER_DECISIONS.labels(**metrics.role_labels(decision=decision)).inc()
    if is_affinity_hit:
        PREFIX_AFFINITY_HITS.labels(**metrics.role_labels()).inc()


def count_request(outcome: str) -> None:
    metrics.REQUESTS.labels(**metrics.role_labels(outcome=outcome)).inc()
