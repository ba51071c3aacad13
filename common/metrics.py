"""Prometheus metrics shared by every role (DESIGN.md "Observability"); all carry a ``role`` label.

Callers label with the process role set once at start-up::

    metrics.set_role("prefill")
    metrics.QUEUE_REQUESTS.labels(**metrics.role_labels(queue="waiting")).set(3)
"""

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROLES: Final = ("bootstrap", "prefill", "decode")
# The role label of this process; "unknown" until set_role is called (e.g. in unit tests).
ROLE: str = "unknown"

# Our own registry, not prometheus_client's global one: importing twice or building
# test registries never collides with metrics of other libraries.
REGISTRY: Final = CollectorRegistry()

# fmt: off
_LATENCY_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
_SORT_BUCKETS: Final = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)
_CLIENT_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
_ITL_BUCKETS: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
)
# fmt: on


def set_role(role: str) -> None:
    """Set the ``role`` label every metric of this process carries."""
    global ROLE
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    ROLE = role


def role_labels(**labels: str) -> dict[str, str]:
    """``labels`` plus this process's role, for ``metric.labels(**role_labels(...))``."""
    return {"role": ROLE, **labels}


def render_latest() -> bytes:
    """The text exposition of every pdserve metric, for ``/metrics``."""
    return generate_latest(REGISTRY)


def _gauge(name: str, doc: str, *labels: str) -> Gauge:
    return Gauge(name, doc, ("role", *labels), registry=REGISTRY)


def _counter(name: str, doc: str, *labels: str) -> Counter:
    return Counter(name, doc, ("role", *labels), registry=REGISTRY)


def _histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
    return Histogram(name, doc, ("role", *labels), registry=REGISTRY, buckets=buckets)


# --- queues and KV pool ------------------------------------------------------------------
QUEUE_REQUESTS: Final = _gauge(
    "pdserve_queue_requests",
    "Requests per queue (bootstrap, waiting, inflight; prealloc, transfer, running, retracted).",
    "queue",
)
KV_PAGES_USED: Final = _gauge(
    "pdserve_kv_pages_used", "KV pool pages in use, cached prefixes included."
)
KV_PAGES_TOTAL: Final = _gauge("pdserve_kv_pages_total", "KV pool pages in all.")
KV_PAGES_HELD: Final = _gauge(
    "pdserve_kv_pages_held", "KV pages held by live requests; 0 when the node is idle."
)

# --- prefill scheduling ------------------------------------------------------------------
PROMPT_TOKENS: Final = _counter("pdserve_prompt_tokens_total", "Prompt tokens received.")
PREFILL_TOKENS: Final = _counter(
    "pdserve_prefill_tokens_total", "Prompt tokens actually computed by prefill."
)
PREFIX_CACHE_HIT_TOKENS: Final = _counter(
    "pdserve_prefix_cache_hit_tokens_total", "Prompt tokens served from the radix cache."
)
GROUP_SAMPLE_TOKENS: Final = _counter(
    "pdserve_group_sample_tokens_total",
    "Prompt tokens a sample of an n > 1 request took from another sample of its prompt "
    "(prefill: not computed; decode: KV copied on the node, not transferred).",
)
CALC_PRIORITY_SECONDS: Final = _histogram(
    "pdserve_calc_priority_seconds",
    "Time of one sort of the waiting queue.",
    _SORT_BUCKETS,
    "policy",
)
POLICY_FALLBACKS: Final = _counter(
    "pdserve_policy_fallbacks_total", "Rounds in which a cache-aware policy was not applied."
)

# --- KV transfer -------------------------------------------------------------------------
KV_TRANSFER_BYTES: Final = _counter("pdserve_kv_transfer_bytes_total", "KV bytes moved.")
KV_TRANSFER_SECONDS: Final = _histogram(
    "pdserve_kv_transfer_seconds", "KV transfer time per room.", _LATENCY_BUCKETS
)
KV_BOOTSTRAP_SECONDS: Final = _histogram(
    "pdserve_kv_bootstrap_seconds",
    "Time from a room's GenerateReq to its TransferRequest being accepted.",
    _LATENCY_BUCKETS,
)
KV_TRANSFER_SPEED_GBPS: Final = _gauge(
    "pdserve_kv_transfer_speed_gbps", "Speed of the last finished room transfer, in GB/s."
)
KV_TRANSFER_FAILURES: Final = _counter(
    "pdserve_kv_transfer_failures_total", "Room transfers that failed, by reason.", "reason"
)
KV_FENCED_WRITES: Final = _counter(
    "pdserve_kv_fenced_writes_total",
    "Writes not posted because the room's lease fence had passed (transfer/fence.py).",
)
KV_LATE_WRITES: Final = _counter(
    "pdserve_kv_late_writes_total",
    "Writes that may have landed after their room's fence (reported by the writer).",
)
KV_TRANSFER_ROOMS: Final = _gauge(
    "pdserve_kv_transfer_rooms", "Transfer rooms per KVPoll state.", "state"
)

# --- decode ------------------------------------------------------------------------------
PREFIX_CACHE_EVICTED_PAGES: Final = _counter(
    "pdserve_prefix_cache_evicted_pages_total", "KV pages evicted from the radix cache (LRU)."
)
PREFIX_CACHE_PAGES: Final = _gauge(
    "pdserve_prefix_cache_pages",
    "KV pages a decode node's prefix cache holds (locked by requests or evictable).",
)
# --- the host tier under the radix cache (--enable-hierarchical-cache) ----------------------
HOST_CACHE_HIT_TOKENS: Final = _counter(
    "pdserve_host_cache_hit_tokens_total",
    "Prompt tokens loaded back from the host tier (also counted in prefix_cache_hit_tokens).",
)
HOST_CACHE_SKIPPED_TOKENS: Final = _counter(
    "pdserve_host_cache_skipped_tokens_total",
    "Host-tier hit tokens computed instead, as a page loads slower than it computes here.",
)
HOST_CACHE_PAGES: Final = _gauge(
    "pdserve_host_cache_pages", "Host-tier pages holding a copy of cached KV."
)
HOST_CACHE_PAGES_TOTAL: Final = _gauge("pdserve_host_cache_pages_total", "Host-tier pages in all.")
HOST_CACHE_EVICTED_PAGES: Final = _counter(
    "pdserve_host_cache_evicted_pages_total", "Host-tier pages dropped to make room (LRU)."
)
HOST_CACHE_LOAD_SECONDS: Final = _histogram(
    "pdserve_host_cache_load_seconds",
    "Time to copy one request's host-tier prefix back to the device pool.",
    _SORT_BUCKETS,
)
INTEGRITY_CHECK_FAILURES: Final = _counter(
    "pdserve_integrity_check_failures_total",
    "Idle-time integrity checks that found pages or requests out of place (the log says "
    "what); 0 on a sound node.",
)
RETRACTIONS: Final = _counter("pdserve_retractions_total", "Decode retractions.")
PREEMPTIONS: Final = _counter(
    "pdserve_priority_preemptions_total",
    "Running requests retracted on the decode node to admit a more urgent one (also counted "
    "in pdserve_retractions_total).",
)

# --- the model's CPU kernels -------------------------------------------------------------
CPU_KERNELS_INFO: Final = _gauge(
    "pdserve_cpu_kernels_info",
    "1 for the CPU kernel library variant the model runs (amx, avx512, avx2, portable), or "
    "none: torch's ops only (slower; the node logs why).",
    "variant",
)

# --- requests as the client saw them (gateway) -------------------------------------------
TIME_TO_FIRST_TOKEN_SECONDS: Final = _histogram(
    "pdserve_time_to_first_token_seconds",
    "Time to first token: from the request's first byte at the gateway to its response's "
    "first byte (streamed) or its first token (answered whole at the end).",
    _CLIENT_BUCKETS,
)
INTER_TOKEN_LATENCY_SECONDS: Final = _histogram(
    "pdserve_inter_token_latency_seconds", "Time between streamed tokens.", _ITL_BUCKETS
)
# Buckets from half a millisecond (a hop on loopback) to a minute (a long queue).
_STAGE_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
REQUEST_STAGE_SECONDS: Final = _histogram(
    "pdserve_request_stage_seconds",
    "Time a request spent in each stage before its first token (common/stages.py). The "
    "gateway records the whole path, whose chain stages add up to its TTFT; each node "
    "records the stages it sees itself.",
    _STAGE_BUCKETS,
    "stage",
)


def observe_stages(seconds: dict[str, float]) -> None:
    """One request's stage durations into pdserve_request_stage_seconds."""
    for stage, value in seconds.items():
        REQUEST_STAGE_SECONDS.labels(**role_labels(stage=stage)).observe(value)


E2E_REQUEST_LATENCY_SECONDS: Final = _histogram(
    "pdserve_e2e_request_latency_seconds",
    "Request latency, arrival to last token.",
    _CLIENT_BUCKETS,
)
REQUESTS: Final = _counter(
    "pdserve_requests_total",
    "Requests ended, by outcome (finished, aborted, error, rejected).",
    "outcome",
)

# --- bad input ---------------------------------------------------------------------------
MALFORMED_MESSAGES: Final = _counter(
    "pdserve_malformed_messages_total", "Internal messages dropped as invalid, by socket.", "socket"
)
UNAUTHENTICATED_CONNECTIONS: Final = _counter(
    "pdserve_unauthenticated_connections_total",
    "Connections to an internal socket refused at the CURVE handshake (no cluster token), "
    "by socket and reason; nothing they send is delivered.",
    "socket",
    "reason",
)
REJECTED_MESSAGES: Final = _counter(
    "pdserve_rejected_messages_total",
    "Well-formed internal messages dropped as unacceptable (unknown or impostor peer, "
    "no such room), by socket and reason.",
    "socket",
    "reason",
)

# --- structured output -------------------------------------------------------------------
GRAMMAR_COMPILE_SECONDS: Final = _histogram(
    "pdserve_grammar_compile_seconds",
    "Time to compile one grammar (JSON schema, regex, EBNF, structural tag), cache misses only.",
    _LATENCY_BUCKETS,
)
GRAMMAR_CACHE_TOTAL: Final = _counter(
    "pdserve_grammar_cache_total",
    "Grammar lookups at request arrival, by result (hit: compiled or compiling already; miss).",
    "result",
)
