"""What every node process (prefill, decode, colocated) shares: start-up, model + pool, sockets,
registration, the READY line and the loop."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from common import messages as msg
from common import metrics, socket_auth
from common.config import ModelConfig, NodeConfig
from common.grammar.backend import GrammarBackend
from common.ipc import bind_pull
from common.model.loader import resolve_model_dir
from common.node.gateway_watch import GatewayWatch
from common.node.http import serve_status
from common.node.idle_check import IdleCheck
from common.node.registry_set import RegistrySet
from common.ready import READY_PREFIX, ready_line  # noqa: F401  (READY_PREFIX: for callers)
from common.tokenizer import Tokenizer

if TYPE_CHECKING:
    from common.model.runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeArgs:
    """Where one node process is and how it is named: NodeConfig with its defaults resolved."""

    role: str
    node_id: str
    bootstrap_urls: tuple[str, ...]
    host: str
    advertise_host: str
    request_port: int
    control_port: int
    http_port: int
    drain_timeout_s: float = 30.0
    # New at each start of the process: the registry and peers tell a restarted node (or
    # a stranger using its node id) from the live one.
    instance_id: str = ""

    @staticmethod
    def from_config(role: str, config: NodeConfig, host: str, http_port: int) -> NodeArgs:
        node_id = config.node_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        return NodeArgs(
            role,
            node_id,
            config.bootstrap_urls,
            host,
            config.advertise_host or host,
            config.request_port,
            config.control_port,
            http_port,
            config.drain_timeout_s,
            uuid.uuid4().hex,
        )

    def endpoint(self, port: int) -> str:
        return f"tcp://{self.host}:{port}"


def start_node(
    role: str,
    config: NodeConfig,
    host: str,
    http_port: int,
    auth_token: str | None,
    *,
    metrics_role: str | None = None,
) -> NodeArgs:
    """What every node process does first, before any socket: logging (its lines and metrics
    labelled `metrics_role`, default `role`), CURVE on every zmq socket, and its resolved
    name and addresses."""
    setup_logging(config.log_level, metrics_role or role)
    socket_auth.configure(auth_token)
    return NodeArgs.from_config(role, config, host, http_port)


@dataclass(frozen=True)
class ServedNode:
    """One node a process registers and serves: a prefill or decode node, or one half of a
    colocated process. Endpoints as bound; the registration advertises them."""

    node_id: str
    role: str
    request_endpoint: str
    control_endpoint: str
    max_running_requests: int
    load: Callable[[], dict[str, Any]]  # the heartbeat's load report
    gateway_watch: GatewayWatch  # its requests are aborted when their gateway is gone
    kv_events_endpoint: str = ""
    colocated_with: str = ""
    # Pages its KV cache can hold, when more than its pool (a prefill node's host tier):
    # what the gateway's KV index allows it. 0: the pool's.
    num_cache_pages: int = 0
    caches_prefixes: bool = False  # a decode node with a prefix cache (session affinity)


def build_runner(
    model: ModelConfig,
    progress: bool = True,
    *,
    decodes: bool = True,
    max_running_requests: int | None = None,
) -> ModelRunner:
    """The node's model and pool, warmed up. `decodes`: False on a prefill node, which
    computes one token per request and never runs decode steps: no decode graphs to capture
    (their buffers and scratch page) and the pool sized for prefill's warm-up alone.
    `max_running_requests`: a decode node's --max-running-requests, the decode slots it
    needs (None: the pool's default)."""
    from common.model.runner import ModelRunner

    budget = None if model.kv_cache_memory_gb is None else int(model.kv_cache_memory_gb * (1 << 30))
    _precompile_kernels(model, decodes)
    runner = ModelRunner.from_path(
        model.model_path,
        progress=progress,
        dtype=model.resolved_dtype(),
        device=model.device,
        page_size=model.page_size,
        max_total_tokens=model.max_total_tokens,
        kv_memory_bytes=budget,
        context_length=model.context_length,
        pack_weights=model.pack_weights,
        cpu_kernels=model.cpu_kernels,
        mem_fraction_static=model.mem_fraction_static,
        attention_backend=model.attention_backend,
        cuda_graph_max_bs=model.cuda_graph_max_bs,
        disable_cuda_graph=model.disable_cuda_graph,
        decodes=decodes,
        kernel_cache_dir=model.kernel_cache_dir or None,
        max_decode_slots=max_running_requests,
    )
    runner.warmup()  # before the node registers: its first request runs at full speed
    return runner


def _precompile_kernels(model: ModelConfig, decodes: bool) -> None:
    """On CUDA with the Triton kernels: every kernel variant the node will launch compiled
    at once, in parallel, before its runner runs its first forward."""
    import torch

    from common.model.attention import triton_usable

    if torch.device(model.device).type != "cuda":
        return
    from common.model import kernel_variants
    from common.model.loader import load_spec
    from common.model.runner import use_device

    device = use_device(model.device)  # current before anything touches CUDA
    if model.attention_backend not in ("auto", "triton") or not triton_usable(device):
        return

    kernel_variants.precompile_serving(
        load_spec(resolve_model_dir(model.model_path)),
        model.resolved_dtype(),
        model.page_size,
        device,
        decodes=decodes,
        graph_max_bs=model.cuda_graph_max_bs,
        context_length=model.context_length,
    )


def bind_request_socket(node: NodeArgs) -> tuple[zmq.Socket, str]:
    sock, endpoint = bind_pull(zmq.Context.instance(), node.endpoint(node.request_port))
    return sock, advertised(endpoint, node)


def advertised(endpoint: str, node: NodeArgs) -> str:
    """The endpoint as peers must dial it (bound on --host, reached on --advertise-host)."""
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{node.advertise_host}:{port}"


class NodeProcess:
    """Runs a node's step() loop with its status server and registry link; stops on SIGTERM."""

    def __init__(
        self,
        node: NodeArgs,
        step: Callable[[], bool],
        health: Callable[[], dict],
        check: Callable[[], None] | None = None,
    ) -> None:
        """`check`: the scheduler's check_integrity, run while the loop is idle."""
        self.node = node
        self.step = step
        self.idle_check = IdleCheck(check) if check is not None else None
        self.health_extra = health
        self.stopping = threading.Event()
        self.registries: list[RegistrySet] = []  # one per node served (colocated: two)
        self.http = serve_status(node.host, node.http_port, self.health)
        self.http_url = f"http://{node.advertise_host}:{self.http.server_address[1]}"

    @property
    def registry(self) -> RegistrySet | None:
        """The first node's registry link (its peers' table); None without --bootstrap-url."""
        return self.registries[0] if self.registries else None

    def health(self) -> dict[str, Any]:
        registered = all(r.is_registered for r in self.registries)
        body = {
            "status": "ok" if registered and not self.stopping.is_set() else "unavailable",
            "role": self.node.role,
            "node_id": self.node.node_id,
            "registered": registered,
        }
        body.update(self.health_extra())
        return body

    def register(self, message: msg.RegisterNode, load: Callable[[], dict[str, Any]]) -> None:
        if self.node.bootstrap_urls:
            self.registries.append(RegistrySet(self.node.bootstrap_urls, message, load).start())

    def registration(
        self, served: ServedNode, runner: ModelRunner, backend: str, auth_token: str | None
    ) -> msg.RegisterNode:
        """What the registry is told of `served`: its endpoints as peers dial them, its KV
        layout and pool, and the process's HTTP side and instance."""
        kv_events = served.kv_events_endpoint
        return msg.RegisterNode(
            node_id=served.node_id,
            role=served.role,
            request_endpoint=served.request_endpoint,
            control_endpoint=advertised(served.control_endpoint, self.node),
            http_url=self.http_url,
            backend=backend,
            backend_metadata=b"",
            kv_layout=runner.layout.to_dict(),
            num_pages=served.num_cache_pages or runner.pool.num_pages,
            max_running_requests=served.max_running_requests,
            protocol_version=msg.PROTOCOL_VERSION,
            auth_token=auth_token,
            instance_id=self.node.instance_id,
            kv_events_endpoint=advertised(kv_events, self.node) if kv_events else "",
            colocated_with=served.colocated_with,
            caches_prefixes=served.caches_prefixes,
        )

    def serve(
        self,
        runner: ModelRunner,
        nodes: Sequence[ServedNode],
        *,
        backend: str,
        auth_token: str | None,
        drain: Callable[[], bool],
        on_drain_timeout: Callable[[], None],
        close: Sequence[Callable[[], None]] = (),
        **announce: Any,
    ) -> None:
        """Register `nodes` (the first names the process in its READY line), point their
        gateway watches at the registries, print the READY line (`announce`: more fields)
        and run until SIGTERM and the drain; `close` runs after, however it ends."""
        try:
            for served in nodes:
                self.register(self.registration(served, runner, backend, auth_token), served.load)
                served.gateway_watch.is_alive = self.is_gateway_alive
            first = nodes[0]
            self.announce(
                request_endpoint=first.request_endpoint,
                control_endpoint=advertised(first.control_endpoint, self.node),
                **announce,
            )
            self.run(drain=drain, on_drain_timeout=on_drain_timeout)
        finally:
            for fn in close:
                fn()

    def announce(self, **fields: Any) -> None:
        """One machine-readable line on stdout for launchers and tests."""
        info = {
            "role": self.node.role,
            "node_id": self.node.node_id,
            "http_url": self.http_url,
            **fields,
        }
        sys.stdout.write(ready_line(info))
        sys.stdout.flush()

    def is_gateway_alive(self, gateway_id: str, now: float) -> bool:
        """Whether the gateway that sent a request is still there (always, without a registry)."""
        return not self.registries or any(
            r.is_gateway_alive(gateway_id, now) for r in self.registries
        )

    def run(
        self,
        drain: Callable[[], bool] | None = None,
        on_drain_timeout: Callable[[], None] | None = None,
    ) -> None:
        """Loop until SIGTERM/SIGINT; then deregister and let `drain()` finish in-flight work
        for --drain-timeout seconds; what is left then is failed by `on_drain_timeout()`."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stopping.set())
        idle = 0
        while not self.stopping.is_set():
            if self.step():
                idle = 0
            else:
                idle += 1
                # Spin briefly (transfers and tokens want sub-ms reaction), then nap.
                if idle > 200:
                    if self.idle_check is not None:
                        self.idle_check.maybe_run()
                    time.sleep(0.0005)
        for registry in self.registries:
            registry.leave()  # no new requests; the gateway is still watched
        deadline = time.monotonic() + self.node.drain_timeout_s
        while drain is not None and not drain() and time.monotonic() < deadline:
            if not self.step():
                time.sleep(0.0005)
        if drain is not None and not drain() and on_drain_timeout is not None:
            logger.warning(
                "drain timeout (%g s) passed; failing what is still running",
                self.node.drain_timeout_s,
            )
            on_drain_timeout()
            for _ in range(20):  # let the failures reach the gateway before we exit
                self.step()
                time.sleep(0.01)
        for registry in self.registries:
            registry.stop(deregister=False)
        self.http.shutdown()


def setup_logging(level: str, role: str) -> None:
    """Log lines to stderr; SIGUSR1 dumps every thread's stack there (a node that seems hung:
    ``kill -USR1 <pid>``; faulthandler answers even while a thread holds the GIL)."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        stream=sys.stderr,
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
    )
    metrics.set_role(role)


def build_grammar(
    config: NodeConfig, model: ModelConfig, vocab_size: int, tokenizer: Tokenizer | None = None
) -> GrammarBackend | None:
    """The node's grammar compiler (--grammar-backend), or None when structured output is off."""
    if config.grammar_backend == "none":
        return None
    if tokenizer is None:
        tokenizer = Tokenizer.from_pretrained(resolve_model_dir(model.model_path))
    return GrammarBackend.for_tokenizer(
        tokenizer, vocab_size, timeout_s=config.grammar_compile_timeout_s
    )
