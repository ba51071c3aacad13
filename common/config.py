"""One frozen, validated config per role (SGLang's names and defaults), built from parsed flags.

The parsers are in common/flags.py; every flag's dest is its field's name here.
"""

import argparse
import os
import re
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Self

from common.cpu_features import has_native_bf16

DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "torch")  # common.model.attention
TRANSFER_BACKENDS = ("nixl", "fake")
GRAMMAR_BACKENDS = ("xgrammar", "none")  # common.grammar
RETRACTION_POLICIES = ("length", "priority")
# Cache-aware policies other than shortest-prefill-first run as fcfs without the radix cache.
FALLBACK_CACHE_AWARE_POLICIES = ("lpm", "dfs-weight", "hrrn")
_CACHE_BLIND_POLICIES = ("fcfs", "lof", "random", "routing-key")
SCHEDULE_POLICIES = (
    *_CACHE_BLIND_POLICIES,
    *FALLBACK_CACHE_AWARE_POLICIES,
    "shortest-prefill-first",
)
# SGLang's HiCache write policies (prefill_node/hiradix_cache.py's WritePolicy).
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
_DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


PREFILL_ROUTERS = ("precise", "affinity", "round-robin", "random")
# The cluster's lease: a node (to the registry) or a transfer peer (to a room) silent this
# long is gone. bootstrap/registry.py's DEFAULT_LEASE_S; tests keep the two equal.
DEFAULT_LEASE_S = 10.0


def default_kernel_cache_dir() -> str:
    """kernels/ under pdserve's cache ($PDSERVE_CACHE_DIR, else ~/.cache/pdserve, as the
    default model's conversion: common.model.gguf_convert)."""
    root = os.environ.get("PDSERVE_CACHE_DIR") or os.path.expanduser("~/.cache/pdserve")
    return os.path.join(root, "kernels")


class ConfigError(ValueError):
    """An invalid flag value or combination; the one-line message says what and how to fix it."""


def _check(is_ok: bool, message: str) -> None:
    if not is_ok:
        raise ConfigError(message)


def _check_positive(value: float | None, flag: str) -> None:
    _check(value is None or value > 0, f"{flag} must be > 0, got {value}; pass a positive value")


def _check_non_negative(value: float | None, flag: str) -> None:
    _check(value is None or value >= 0, f"{flag} must be >= 0, got {value}; pass 0 or more")


def _check_port(value: int, flag: str) -> None:
    _check(0 <= value <= 65535, f"{flag} {value} is not a TCP port; pass a value in [0, 65535]")


def _check_choice(value: str, choices: tuple[str, ...], flag: str) -> None:
    _check(value in choices, f"unknown {flag} {value!r}; choose one of: {', '.join(choices)}")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; set it to one or unset it") from None


def _env_auth_token() -> str | None:
    return os.environ.get("PDSERVE_AUTH_TOKEN") or None


NESTED_CONFIGS = ("model", "transfer", "node")  # fields that hold a config, built by the caller


def field_values(cls: type[Any], source: object) -> dict[str, Any]:
    # Every flag's dest is its field's name, so a namespace and a config read alike.
    return {f.name: getattr(source, f.name) for f in fields(cls) if f.name not in NESTED_CONFIGS}


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load, where, and how large the paged KV pool is."""

    model_path: str | None = None  # None: the built-in default model
    dtype: str = "auto"  # auto: bfloat16 on cuda and on CPUs with native bf16, else float32
    device: str = "cpu"  # whether a GPU exists is checked at model load
    context_length: int | None = None
    page_size: int = 16
    max_total_tokens: int | None = None
    kv_cache_memory_gb: float | None = None  # pool budget when max_total_tokens is not given
    # CPU: packed copies of every weight matrix beside the plain one (oneDNN's or AMX's, and
    # the float32 panels), kernels warm-up chooses from (common.model.cpu.gemm); the copies
    # no row count chose are dropped after warm-up
    pack_weights: bool = True
    # CPU: the C kernels of common.model.cpu.library (attention over the KV pages in place,
    # the fused per-layer steps, the AMX and panel products), built at install time
    cpu_kernels: bool = True
    # the pool as a fraction of the device's memory less what is in use after the weights
    # and a warm-up forward (common.model.memory); None: 0.85 on CUDA, 2 GiB on the CPU
    mem_fraction_static: float | None = None
    attention_backend: str = "auto"  # common.model.attention: auto, cpu, triton, torch
    cuda_graph_max_bs: int = 128  # decode graphs for batch buckets up to this
    disable_cuda_graph: bool = False
    # CPU: where warm-up's kernel choice is kept for the next start on this machine
    # (common.model.cpu.choice_cache); "": measured at every start
    kernel_cache_dir: str = field(default_factory=default_kernel_cache_dir)

    def __post_init__(self) -> None:
        page = self.page_size
        _check_choice(self.attention_backend, ATTENTION_BACKENDS, "--attention-backend")
        _check(
            self.cuda_graph_max_bs >= 1,
            f"--cuda-graph-max-bs {self.cuda_graph_max_bs} must be at least 1",
        )
        _check(
            self.mem_fraction_static is None or 0.0 < self.mem_fraction_static <= 1.0,
            f"--mem-fraction-static {self.mem_fraction_static} must be in (0, 1]",
        )
        _check(
            self.mem_fraction_static is None
            or (self.max_total_tokens is None and self.kv_cache_memory_gb is None),
            "--mem-fraction-static sizes the KV pool like --max-total-tokens and "
            "--kv-cache-memory-gb; pass only one",
        )
        _check_choice(self.dtype, DTYPES, "--dtype")
        is_device = _DEVICE_PATTERN.fullmatch(self.device) is not None
        _check(is_device, f"unknown --device {self.device!r}; use cpu, cuda or cuda:N")
        is_power_of_two = 1 <= page <= 256 and page & (page - 1) == 0
        _check(is_power_of_two, f"--page-size {page} is not a power of two in [1, 256]; pass 16")
        _check_positive(self.context_length, "--context-length")
        _check(
            self.max_total_tokens is None or self.max_total_tokens >= page,
            f"--max-total-tokens {self.max_total_tokens} is below --page-size {page}; raise it",
        )
        _check_positive(self.kv_cache_memory_gb, "--kv-cache-memory-gb")
        _check(
            self.max_total_tokens is None or self.kv_cache_memory_gb is None,
            "--max-total-tokens and --kv-cache-memory-gb both size the KV pool; pass only one",
        )

    def resolved_dtype(self) -> str:
        """The concrete dtype name: auto becomes bfloat16 on cuda and on a CPU with AMX or
        AVX512-BF16 (bfloat16 decode 1.3-1.5x float32 there), float32 on other CPUs.

        The KV layout carries the dtype, so prefill and decode nodes on different kinds of
        CPU must be given the same --dtype: auto could pick two and their pages would not mix.
        """
        if self.dtype != "auto":
            return self.dtype
        if self.device != "cpu":
            return "bfloat16"
        return "bfloat16" if has_native_bf16() else "float32"

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Self:
        return cls(**field_values(cls, ns))


@dataclass(frozen=True)
class TransferConfig:
    """How a node reaches the bootstrap registry and moves KV pages to its peer."""

    backend: str = "nixl"
    bootstrap_timeout_s: float = 300.0
    waiting_timeout_s: float = 300.0
    # A room whose peer stops renewing for this long fails and its pages are freed; the
    # cluster's one lease (the registry drops a silent node after as long: --lease-timeout).
    lease_s: float = DEFAULT_LEASE_S
    auth_token: str | None = field(default_factory=_env_auth_token)

    def __post_init__(self) -> None:
        _check_choice(self.backend, TRANSFER_BACKENDS, "--disaggregation-transfer-backend")
        _check_positive(self.bootstrap_timeout_s, "--disaggregation-bootstrap-timeout")
        _check_positive(self.waiting_timeout_s, "--disaggregation-waiting-timeout")
        _check_positive(self.lease_s, "--lease-timeout")
        _check(self.auth_token != "", "--auth-token is empty; pass a non-empty token or omit it")

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Self:
        return cls(**field_values(cls, ns))


@dataclass(frozen=True)
class NodeConfig:
    """What every node process takes beyond its role: its name, registry, reachable address,
    zmq ports, shutdown drain and log level."""

    node_id: str | None = None  # None: <role>-<host name>-<pid>
    bootstrap_urls: tuple[str, ...] = ()  # registry replicas; none: the node runs standalone
    advertise_host: str | None = None  # how peers reach this node; None: --host
    request_port: int = 0  # 0: any free port
    control_port: int = 0  # KV transfer control; 0: any free port
    drain_timeout_s: float = 30.0
    log_level: str = "INFO"
    # Structured output (common/grammar/): xgrammar, or none (a request with a grammar: 400)
    grammar_backend: str = "xgrammar"
    grammar_compile_timeout_s: float = 30.0  # a compile still running then fails its request

    def __post_init__(self) -> None:
        _check_choice(self.grammar_backend, GRAMMAR_BACKENDS, "--grammar-backend")
        _check(
            self.grammar_compile_timeout_s > 0,
            f"--grammar-compile-timeout {self.grammar_compile_timeout_s} must be positive",
        )
        _check_port(self.request_port, "--request-port")
        _check_port(self.control_port, "--control-port")
        _check_non_negative(self.drain_timeout_s, "--drain-timeout")
        _check(self.node_id != "", "--node-id is empty; pass a name or omit it")

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Self:
        values = field_values(cls, ns)
        # Repeated flags and comma-separated lists alike: one URL per replica.
        values["bootstrap_urls"] = tuple(
            url.strip()
            for value in values["bootstrap_urls"] or ()
            for url in value.split(",")
            if url.strip()
        )
        return cls(**values)


@dataclass(frozen=True)
class PrefillConfig:
    """A prefill node: model, transfer, process, HTTP endpoint and scheduling."""

    model: ModelConfig = field(default_factory=ModelConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    host: str = "127.0.0.1"
    port: int = 30000  # /health and /metrics
    kv_events_port: int = 0  # zmq PUB of the radix cache's events; 0: any free port
    schedule_policy: str = "fcfs"
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 8192  # SGLang's flag: -1 disables chunking
    prefill_max_requests: int | None = None  # None: unlimited
    max_running_requests: int | None = None  # None: unlimited (prefilling or transferring)
    max_queued_requests: int | None = None  # None: unlimited (bootstrap + waiting queues)
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False  # ignored without priority scheduling
    abort_on_priority_when_disabled: bool = False
    disable_radix_cache: bool = False
    # A host-memory tier under the radix cache (SGLang's HiCache; prefill_node/hiradix_cache.py)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0  # host pages per device page
    hicache_size: float = 0.0  # GB of host pages; 0: --hicache-ratio sizes the tier
    hicache_write_policy: str = "write_through"
    in_batch_prefix_caching_check_threshold: int = field(
        default_factory=partial(_env_int, "IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD", 32)
    )
    in_batch_prefix_caching_deprioritize_threshold: int = field(
        default_factory=partial(_env_int, "IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD", 32)
    )
    cache_aware_fallback_threshold: int | None = None  # None: never fall back to fcfs
    # dfs-weight sends in-batch dedup's deprioritized requests to the back; "off" is SGLang
    # 0.5.23, which computes the dedup set under dfs-weight but does not use it.
    dfs_weight_dedup: str = "on"
    # lpm on cached minus uncached tokens instead of cached ones (beyond SGLang; see
    # bench/policy_ablation.py for what it does).
    lpm_length_aware: bool = False

    def __post_init__(self) -> None:
        page, chunk = self.model.page_size, self.chunked_prefill_size
        _check_port(self.port, "--port")
        _check_port(self.kv_events_port, "--kv-events-port")
        _check_choice(self.schedule_policy, SCHEDULE_POLICIES, "--schedule-policy")
        _check(
            self.schedule_policy != "shortest-prefill-first" or not self.disable_radix_cache,
            "--schedule-policy shortest-prefill-first needs the radix cache;"
            " drop --disable-radix-cache or pick another policy",
        )
        _check(
            self.max_prefill_tokens >= page,
            f"--max-prefill-tokens {self.max_prefill_tokens} is below --page-size {page}; raise it",
        )
        _check(
            chunk == -1 or (chunk >= page and chunk % page == 0),
            f"--chunked-prefill-size {chunk} is not a positive multiple of --page-size {page};"
            " pass e.g. 8192, or -1 to disable chunking",
        )
        _check_positive(self.prefill_max_requests, "--prefill-max-requests")
        _check_positive(self.max_running_requests, "--max-running-requests")
        _check_positive(self.max_queued_requests, "--max-queued-requests")
        _check(
            not (self.abort_on_priority_when_disabled and self.enable_priority_scheduling),
            "--abort-on-priority-when-disabled contradicts --enable-priority-scheduling;"
            " pass only one of them",
        )
        _check_non_negative(self.cache_aware_fallback_threshold, "--cache-aware-fallback-threshold")
        _check(
            not (self.enable_hierarchical_cache and self.disable_radix_cache),
            "--enable-hierarchical-cache is a tier under the radix cache;"
            " drop --disable-radix-cache",
        )
        _check(
            self.hicache_ratio > 0 and self.hicache_size >= 0,
            f"--hicache-ratio {self.hicache_ratio} must be > 0 and --hicache-size"
            f" {self.hicache_size} >= 0",
        )
        _check_choice(self.hicache_write_policy, HICACHE_WRITE_POLICIES, "--hicache-write-policy")
        _check(
            self.dfs_weight_dedup in ("on", "off"),
            f"--dfs-weight-dedup must be on or off, got {self.dfs_weight_dedup!r}",
        )

    @property
    def effective_schedule_policy(self) -> str:
        """The policy that runs: lpm, dfs-weight and hrrn become fcfs without the radix cache."""
        if self.disable_radix_cache and self.schedule_policy in FALLBACK_CACHE_AWARE_POLICIES:
            return "fcfs"
        return self.schedule_policy

    @property
    def effective_chunked_prefill_size(self) -> int | None:
        """The chunk size in tokens, or None when chunked prefill is disabled."""
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Self:
        return cls(**_nested_configs(ns), **field_values(cls, ns))


def _nested_configs(ns: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": ModelConfig.from_args(ns),
        "transfer": TransferConfig.from_args(ns),
        "node": NodeConfig.from_args(ns),
    }


@dataclass(frozen=True)
class DecodeConfig:
    """A decode node: model, transfer, process, HTTP endpoint, batch limits and retraction."""

    model: ModelConfig = field(default_factory=ModelConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    host: str = "127.0.0.1"
    port: int = 30001  # /health and /metrics
    # "ID=ENDPOINT": a prefill node's KV control endpoint known without a registry.
    prefill_endpoints: tuple[str, ...] = ()
    max_running_requests: int | None = None  # None: derived from the pool size later
    max_queued_requests: int | None = None  # None: unlimited
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    retraction_policy: str = "length"
    num_reserved_decode_tokens: int = 512
    # Scales new_token_ratio (the share of max_new_tokens a running request is expected
    # to still need), as SGLang's flag does; a prefill node reserves no decode room.
    schedule_conservativeness: float = 1.0
    # With priority scheduling: retract running requests less urgent by more than this to
    # admit a waiting one (decode_node/preemption.py).
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    # Keep finished requests' KV in a prefix cache; a prompt that starts with a cached
    # prefix receives only the pages after it (decode_node/prefix_cache.py).
    disaggregation_decode_enable_radix_cache: bool = False
    # Overlap scheduling (SGLang's and mini-sglang's): step N+1 is planned and launched
    # before step N's tokens are read; its results are processed one step late.
    disable_overlap_schedule: bool = False
    # GB of host memory for retracted requests' KV (decode_node/host_pool.py); 0: as many
    # pages as the device pool, on CUDA (pinned) at most 1/8 of the machine's memory.
    host_pool_size: float = 0.0

    def __post_init__(self) -> None:
        _check_port(self.port, "--port")
        _check_non_negative(self.host_pool_size, "--host-pool-size")
        _check_positive(self.max_running_requests, "--max-running-requests")
        _check_positive(self.max_queued_requests, "--max-queued-requests")
        _check_choice(self.retraction_policy, RETRACTION_POLICIES, "--retraction-policy")
        _check(
            self.retraction_policy != "priority" or self.enable_priority_scheduling,
            "--retraction-policy priority needs --enable-priority-scheduling;"
            " add it or use --retraction-policy length",
        )
        _check_non_negative(self.num_reserved_decode_tokens, "--num-reserved-decode-tokens")
        _check_non_negative(self.schedule_conservativeness, "--schedule-conservativeness")
        _check_non_negative(
            self.priority_scheduling_preemption_threshold,
            "--priority-scheduling-preemption-threshold",
        )
        _check(
            all(item.split("=", 1)[0] and "=" in item for item in self.prefill_endpoints),
            f"--prefill-endpoint {self.prefill_endpoints} must be ID=ENDPOINT",
        )

    @property
    def static_prefill_endpoints(self) -> dict[str, str]:
        """Prefill node id -> its KV control endpoint, from --prefill-endpoint."""
        return dict(item.split("=", 1) for item in self.prefill_endpoints)

    @property
    def is_priority_preemption_on(self) -> bool:
        """Whether a waiting request may retract less urgent running ones."""
        return self.enable_priority_scheduling and not self.disable_priority_preemption

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Self:
        values = field_values(cls, ns)
        values["prefill_endpoints"] = tuple(values["prefill_endpoints"] or ())
        return cls(**_nested_configs(ns), **values)


@dataclass(frozen=True)
class BootstrapConfig:
    """The bootstrap process: public API port, node registry port and request limits."""

    host: str = "127.0.0.1"
    port: int = 8000  # the public API
    bootstrap_port: int = 8998  # the node registry
    auth_token: str | None = field(default_factory=_env_auth_token)
    api_keys: tuple[str, ...] = ()  # --api-key, repeatable; none (and no file): an open API
    api_key_file: str | None = None
    max_queued_requests: int | None = None  # None: unlimited
    request_timeout_s: float = 600.0
    # A request whose node pair fails (a node lost, a failed transfer) moves to another
    # pair with its output so far, at most this many times (0: the client gets the error).
    migration_limit: int = 3
    # Samples one request may ask for (n); each is its own request through the cluster.
    max_n: int = 16
    # How long a migrating request waits for a pair to take it (nodes restarting, or none
    # healthy) before the client gets a 503.
    migration_timeout_s: float = 10.0
    # A gateway that has just started knows no node: for this long, /ready says not ready
    # and a request that finds no pair waits for the nodes to register instead of getting a
    # 503 (nodes heartbeat at least every second, common/node/registry_client.py).
    registration_window_s: float = 2.0
    # API bodies above this are a 413 before they are parsed. 4 MiB holds a prompt of ~1M
    # tokens of text, 100x the built-in model's context.
    max_request_bytes: int = 4 << 20
    model_path: str | None = None  # for the tokenizer; None: the built-in default model
    context_length: int | None = None
    # How the gateway picks a prefill node (bootstrap/router.py): precise (from the nodes'
    # KV events), affinity (consistent hashing of the prompt's head), round-robin, random.
    prefill_router: str = "precise"
    lease_s: float = DEFAULT_LEASE_S  # a node silent this long is dropped, its requests fail
    advertise_host: str | None = None  # how nodes reach the reply socket; None: --host
    reply_port: int = 0  # zmq PULL of the nodes' replies; 0: any free port
    # bootstrap/router.py's DEFAULT_AFFINITY_TOKENS and DEFAULT_EPSILON
    prefix_affinity_tokens: int = 32
    load_balance_epsilon: float = 0.25
    served_model_name: str | None = None  # None: from --model-path
    log_level: str = "INFO"
    # Allocations between young-generation collections once start-up is frozen
    # (common/gc_policy.py); 0: Python's own policy.
    gc_gen0_threshold: int = 50_000

    def __post_init__(self) -> None:
        _check_port(self.port, "--port")
        _check_non_negative(self.gc_gen0_threshold, "--gc-gen0-threshold")
        _check_port(self.reply_port, "--reply-port")
        _check_positive(self.lease_s, "--lease-timeout")
        _check(
            self.prefix_affinity_tokens >= 1,
            f"--prefix-affinity-tokens must be >= 1, got {self.prefix_affinity_tokens}",
        )
        _check_positive(self.load_balance_epsilon, "--load-balance-epsilon")
        _check(
            self.prefill_router in PREFILL_ROUTERS,
            f"--prefill-router {self.prefill_router!r}: choose one of {', '.join(PREFILL_ROUTERS)}",
        )
        _check_port(self.bootstrap_port, "--disaggregation-bootstrap-port")
        _check(
            self.port != self.bootstrap_port or self.port == 0,
            f"--port and --disaggregation-bootstrap-port are both {self.port}; make them differ",
        )
        _check_positive(self.max_queued_requests, "--max-queued-requests")
        _check_positive(self.request_timeout_s, "--request-timeout")
        _check_non_negative(self.migration_limit, "--migration-limit")
        _check_positive(self.max_n, "--max-n")
        _check_positive(self.migration_timeout_s, "--migration-timeout")
        _check_non_negative(self.registration_window_s, "--registration-window")
        _check_positive(self.max_request_bytes, "--max-request-bytes")
        _check(self.auth_token != "", "--auth-token is empty; pass a non-empty token or omit it")
        _check(all(k.strip() for k in self.api_keys), "--api-key is empty; pass a key or omit it")
        _check(
            self.auth_token is None or self.auth_token not in self.api_keys,
            "--api-key equals the cluster token; the API key is given to clients, the cluster "
            "token must stay inside the cluster",
        )
        _check_positive(self.context_length, "--context-length")

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> Self:
        values = field_values(cls, ns)
        values["api_keys"] = tuple(values["api_keys"] or ())
        return cls(**values)
