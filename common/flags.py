"""The command-line flags of every role, parsed into common/config.py's frozen configs.

Each role's parser is built here from shared groups (model, transfer and cluster, node,
role-only); every flag's dest is its config field's name and its default the field's, so a
parsed namespace and a config read alike (tests/unit/common/test_flags.py holds that every
flag lands in a field some role reads).
"""

import argparse
from collections.abc import Callable

from common.config import (
    DTYPES,
    GRAMMAR_BACKENDS,
    HICACHE_WRITE_POLICIES,
    PREFILL_ROUTERS,
    RETRACTION_POLICIES,
    SCHEDULE_POLICIES,
    TRANSFER_BACKENDS,
    BootstrapConfig,
    DecodeConfig,
    ModelConfig,
    NodeConfig,
    PrefillConfig,
    TransferConfig,
    field_values,
)

Parser = argparse.ArgumentParser


def _add_model_identity_args(parser: Parser) -> None:
    parser.add_argument("--model-path", help="weights folder or hub id; unset: the built-in model")
    parser.add_argument("--context-length", type=int, help="unset: the model's")


def _add_cluster_args(parser: Parser) -> None:
    add = parser.add_argument
    add("--auth-token", help="registry secret; unset: $PDSERVE_AUTH_TOKEN")
    add(
        "--lease-timeout",
        dest="lease_s",
        type=float,
        help="the cluster's lease: seconds without a heartbeat before the registry drops a "
        "node and fails its requests, and before a KV transfer room whose peer stopped "
        "renewing fails and frees its pages (default 10)",
    )
    add("--advertise-host", help="address peers reach this process at (default: --host)")
    add("--log-level")


def _add_node_args(parser: Parser) -> None:
    add = parser.add_argument
    add("--host")
    add("--port", type=int, help="HTTP port for /health and /metrics")
    add(
        "--max-running-requests",
        type=int,
        help="decode: the running batch's cap (unset: derived from the KV pool size); prefill: "
        "requests prefilling or transferring their KV at once (unset: unlimited)",
    )
    add(
        "--max-queued-requests",
        type=int,
        help="requests waiting to be scheduled past which a new one gets a 503 (unset: unlimited)",
    )
    add("--enable-priority-scheduling", action="store_true")
    add("--schedule-low-priority-values-first", action="store_true")
    add("--node-id", help="unique node name (default: <role>-<host>-<pid>)")
    add(
        "--bootstrap-url",
        dest="bootstrap_urls",
        action="append",
        help="registry URL of a bootstrap replica, e.g. http://127.0.0.1:8998; repeat (or "
        "separate with commas) for several replicas; a host name that resolves to "
        "several addresses (a headless Service) is one replica per address "
        "(default: run standalone)",
    )
    add("--request-port", type=int, help="zmq port for requests (0: any free port)")
    add("--control-port", type=int, help="zmq port for KV transfer control (0: any)")
    add(
        "--drain-timeout",
        dest="drain_timeout_s",
        type=float,
        help="on SIGTERM, seconds to let running requests finish; those still running then "
        "get a clean 503 error (default 30)",
    )
    add(
        "--grammar-backend",
        help=f"structured output (response_format, tools, /generate's json_schema, regex, "
        f"ebnf): one of {', '.join(GRAMMAR_BACKENDS)}; none answers such requests 400 "
        "(default xgrammar)",
    )
    add(
        "--grammar-compile-timeout",
        dest="grammar_compile_timeout_s",
        type=float,
        help="seconds a request waits for its grammar to compile before it fails with 500; "
        "the compile goes on for later requests with the same grammar (default 30)",
    )
    parser.set_defaults(**field_values(NodeConfig, NodeConfig()))
    parser.set_defaults(bootstrap_urls=None)  # argparse's append needs a list or None


def add_model_args(parser: Parser) -> None:
    """Add the model and KV pool flags."""
    add = parser.add_argument
    _add_model_identity_args(parser)
    add(
        "--dtype",
        help=f"one of: {', '.join(DTYPES)}; auto: bfloat16 on cuda and on CPUs with "
        "AMX or AVX512-BF16, float32 on other CPUs",
    )
    add("--device", help="cpu, cuda or cuda:N")
    add("--page-size", type=int, help="tokens per KV page, a power of two up to 256")
    add("--max-total-tokens", type=int, help="KV pool size in tokens")
    add("--kv-cache-memory-gb", type=float, help="KV pool budget when --max-total-tokens is unset")
    add(
        "--no-packed-weights",
        dest="pack_weights",
        action="store_false",
        help="CPU: keep no packed copies of the weights (oneDNN's or AMX's, and the float32 "
        "panel product's on AVX-512: each adds their memory again, and they speed the "
        "products 1.2-1.7x where they measure fastest)",
    )
    add(
        "--mem-fraction-static",
        type=float,
        help="KV pool: this fraction of the device's memory less what is in use after the "
        "weights and a warm-up forward at the largest batch (default on CUDA: 0.85; on "
        "the CPU, with it, of the machine's memory, else 2 GiB)",
    )
    add(
        "--attention-backend",
        help="auto (triton on CUDA, the C kernels on the CPU), cpu, "
        "triton or torch (gathered pages and SDPA)",
    )
    add(
        "--cuda-graph-max-bs",
        type=int,
        help="CUDA: capture decode graphs for batch buckets 1, 2, 4, 8, 16, 32, ... up to this",
    )
    add("--disable-cuda-graph", action="store_true", help="CUDA: decode without graphs")
    add(
        "--no-cpu-kernels",
        dest="cpu_kernels",
        action="store_false",
        help="CPU: run the model on torch's ops only, without the C kernels built at install "
        "time (attention over the KV pages in place, fused per-layer steps, the AMX and "
        "panel products)",
    )
    add(
        "--kernel-cache-dir",
        help="CPU: keep warm-up's kernel choice here and take it at the next start on this "
        "machine (same CPU, torch, dtype and model shapes): a start without the measuring, "
        "and the same numerics as before a restart. '' measures at every start "
        "(default: kernels/ in $PDSERVE_CACHE_DIR, else in ~/.cache/pdserve)",
    )
    parser.set_defaults(**field_values(ModelConfig, ModelConfig()))


def add_transfer_args(parser: Parser, *, has_backend: bool = True) -> None:
    """Add the KV transfer flags and the cluster's (token, lease, address, log level);
    `has_backend`: False where the backend is fixed (colocated: in-memory)."""
    add = parser.add_argument
    if has_backend:
        add("--disaggregation-transfer-backend", dest="backend", help=", ".join(TRANSFER_BACKENDS))
    _add_cluster_args(parser)
    add("--disaggregation-bootstrap-timeout", dest="bootstrap_timeout_s", type=float)
    add("--disaggregation-waiting-timeout", dest="waiting_timeout_s", type=float)
    parser.set_defaults(**field_values(TransferConfig, TransferConfig()))


def _add_prefill_only_args(parser: Parser) -> None:
    add = parser.add_argument
    add("--schedule-policy", help=", ".join(SCHEDULE_POLICIES))
    add("--max-prefill-tokens", type=int)
    add("--chunked-prefill-size", type=int, help="-1 disables chunked prefill")
    add("--prefill-max-requests", type=int, help="unset: unlimited")
    add(
        "--abort-on-priority-when-disabled",
        action="store_true",
        help="reject (400) a request that gives a priority while priority scheduling is off",
    )
    add("--disable-radix-cache", action="store_true")
    add(
        "--enable-hierarchical-cache",
        action="store_true",
        help="keep KV the device pool evicts in a host-memory tier and load it back on a hit",
    )
    add("--hicache-ratio", type=float, help="host-tier pages per device pool page (default 2)")
    add("--hicache-size", type=float, help="host-tier size in GB; 0: --hicache-ratio sizes it")
    add("--hicache-write-policy", choices=HICACHE_WRITE_POLICIES)
    add("--in-batch-prefix-caching-check-threshold", type=int)
    add("--in-batch-prefix-caching-deprioritize-threshold", type=int)
    add("--cache-aware-fallback-threshold", type=int, help="queue length above which fcfs runs")
    add(
        "--dfs-weight-dedup",
        choices=("on", "off"),
        help="on: dfs-weight puts in-batch dedup's deprioritized requests last; off: as SGLang",
    )
    add(
        "--lpm-length-aware",
        action="store_true",
        help="lpm sorts on cached minus uncached tokens (not in SGLang)",
    )
    add(
        "--kv-events-port",
        type=int,
        help="zmq PUB port of the node's KV cache events, which every gateway subscribes to "
        "for precise prefix routing (0: any free port)",
    )


def _add_decode_only_args(parser: Parser) -> None:
    add = parser.add_argument
    add("--retraction-policy", help=", ".join(RETRACTION_POLICIES))
    add("--num-reserved-decode-tokens", type=int)
    add(
        "--schedule-conservativeness",
        type=float,
        help="scales new_token_ratio: above 1 admits fewer, retracts less",
    )
    add(
        "--priority-scheduling-preemption-threshold",
        type=int,
        help="priority gap at which a waiting request preempts running ones",
    )
    add("--disable-priority-preemption", action="store_true")
    add(
        "--disable-overlap-schedule",
        action="store_true",
        help="plan and launch each decode step only after the last one's tokens are read "
        "(default: the next step is launched first, its results read one step later)",
    )
    add(
        "--host-pool-size",
        type=float,
        help="GB of host memory that retracted requests' KV is copied into, pinned once at "
        "start on CUDA (0, the default: as many pages as the KV pool, on CUDA at most 1/8 "
        "of the machine's memory); a full pool falls back to slower pageable copies",
    )


def add_prefill_args(parser: Parser) -> None:
    """Add every prefill node flag, the model, transfer and process ones included."""
    add_model_args(parser)
    add_transfer_args(parser)
    _add_node_args(parser)
    _add_prefill_only_args(parser)
    parser.set_defaults(**field_values(PrefillConfig, PrefillConfig()))


def add_decode_args(parser: Parser) -> None:
    """Add every decode node flag, the model, transfer and process ones included."""
    add_model_args(parser)
    add_transfer_args(parser)
    _add_node_args(parser)
    _add_decode_only_args(parser)
    parser.add_argument(
        "--disaggregation-decode-enable-radix-cache",
        action="store_true",
        help="keep finished requests' KV; a prompt that starts with it (a chat's next turn) "
        "receives only the pages after it (not on a colocated node: its halves share a pool)",
    )
    parser.add_argument(
        "--prefill-endpoint",
        dest="prefill_endpoints",
        action="append",
        metavar="ID=ENDPOINT",
        help="a prefill node's KV control endpoint, without a registry "
        "(repeatable; tests and static setups)",
    )
    parser.set_defaults(**field_values(DecodeConfig, DecodeConfig()))
    parser.set_defaults(prefill_endpoints=None)  # argparse's append needs a list or None


def add_colocated_args(parser: Parser) -> None:
    """Add every colocated process flag: both node roles' but the transfer backend (the
    halves hand pages over in memory) and the static prefill endpoints (its prefill half
    is its own). PrefillConfig.from_args and DecodeConfig.from_args both read the result."""
    add_model_args(parser)
    add_transfer_args(parser, has_backend=False)
    _add_node_args(parser)
    _add_prefill_only_args(parser)
    _add_decode_only_args(parser)
    parser.set_defaults(**field_values(DecodeConfig, DecodeConfig()))
    parser.set_defaults(**field_values(PrefillConfig, PrefillConfig()))  # --port 30000


def add_bootstrap_args(parser: Parser) -> None:
    """Add every bootstrap process flag."""
    add = parser.add_argument
    add("--host")
    add("--port", type=int, help="public API port")
    add(
        "--disaggregation-bootstrap-port",
        dest="bootstrap_port",
        type=int,
        help="HTTP port of the node registry, which nodes reach through --bootstrap-url",
    )
    _add_cluster_args(parser)
    add("--reply-port", type=int, help="zmq port for node replies (0: any free port)")
    add(
        "--api-key",
        dest="api_keys",
        action="append",
        help="a key clients must send (Bearer); repeat for several; unset: open API",
    )
    add("--api-key-file", help="one API key per line, re-read when it changes")
    add("--max-queued-requests", type=int, help="unset: unlimited")
    add("--request-timeout", dest="request_timeout_s", type=float)
    add("--max-n", type=int, help="samples (n) one request may ask for (default 16)")
    add(
        "--gc-gen0-threshold",
        type=int,
        help="allocations between young garbage collections after start-up is frozen "
        "(default 50000; 0: Python's own policy)",
    )
    add(
        "--migration-limit",
        type=int,
        help="times a request whose node pair fails moves to another pair with its output "
        "so far, the client's stream going on (default 3; 0: the client gets the error)",
    )
    add(
        "--migration-timeout",
        dest="migration_timeout_s",
        type=float,
        help="seconds a migrating request waits for a healthy pair before a 503 (default 10)",
    )
    add(
        "--registration-window",
        dest="registration_window_s",
        type=float,
        help="seconds after a start in which /ready says not ready and requests wait for "
        "the nodes to register instead of a 503 (default 2; nodes beat every second)",
    )
    add(
        "--max-request-bytes",
        type=int,
        help="API bodies over this many bytes get a 413 (default 4 MiB)",
    )
    add(
        "--prefill-router",
        choices=PREFILL_ROUTERS,
        help="how a prefill node is chosen: precise (cached prefix from the nodes' KV events, "
        "against their queued tokens; the default), affinity (consistent hashing of the "
        "prompt's first 32 tokens), round-robin, random",
    )
    add(
        "--prefix-affinity-tokens",
        type=int,
        help="leading prompt tokens hashed for prefill affinity",
    )
    add(
        "--load-balance-epsilon",
        type=float,
        help="bounded-load slack: a prefill node over (1+eps) x average load is skipped",
    )
    add("--served-model-name", help="model id in the API (default: from the path)")
    _add_model_identity_args(parser)
    parser.set_defaults(**field_values(BootstrapConfig, BootstrapConfig()))
    parser.set_defaults(api_keys=None)  # argparse's append needs a list or None


def _parse(argv: list[str], prog: str, add_args: Callable[[Parser], None]) -> argparse.Namespace:
    parser = Parser(prog=prog)  # defaults live on the dataclasses; --help must not print tokens
    add_args(parser)
    return parser.parse_args(argv)


def parse_prefill_config(argv: list[str]) -> PrefillConfig:
    """Parse prefill node flags into a validated config."""
    return PrefillConfig.from_args(_parse(argv, "pdserve prefill", add_prefill_args))


def parse_decode_config(argv: list[str]) -> DecodeConfig:
    """Parse decode node flags into a validated config."""
    return DecodeConfig.from_args(_parse(argv, "pdserve decode", add_decode_args))


def parse_colocated_config(argv: list[str]) -> tuple[PrefillConfig, DecodeConfig]:
    """Parse colocated process flags into its two halves' validated configs."""
    ns = _parse(argv, "pdserve colocated", add_colocated_args)
    return PrefillConfig.from_args(ns), DecodeConfig.from_args(ns)


def parse_bootstrap_config(argv: list[str]) -> BootstrapConfig:
    """Parse bootstrap process flags into a validated config."""
    return BootstrapConfig.from_args(_parse(argv, "pdserve bootstrap", add_bootstrap_args))
