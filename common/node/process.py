"""What every node process (prefill, decode) shares: flags, model + pool, sockets, registry, the loop."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from common import messages as msg
from common import metrics
from common.config import ModelConfig
from common.ipc import bind_pull
from common.node.http import serve_status
from common.ready import READY_PREFIX, ready_line  # noqa: F401  (READY_PREFIX: for callers)
from common.node.registry_set import RegistrySet

if TYPE_CHECKING:
    from common.model.runner import ModelRunner

logger = logging.getLogger(__name__)


def add_node_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--node-id", default=None, help="unique node name (default: <role>-<host>-<pid>)")
    add("--bootstrap-url", dest="bootstrap_urls", action="append", default=None,
        help="registry URL of a bootstrap replica, e.g. http://127.0.0.1:8998; repeat (or "
             "separate with commas) for several replicas; a host name that resolves to "
             "several addresses (a headless Service) is one replica per address "
             "(default: run standalone)")
    add("--advertise-host", default=None, help="address peers use to reach this node (default: --host)")
    add("--request-port", type=int, default=0, help="zmq port for requests (0: any free port)")
    add("--control-port", type=int, default=0, help="zmq port for KV transfer control (0: any)")
    add("--drain-timeout", dest="drain_timeout_s", type=float, default=30.0,
        help="on SIGTERM, seconds to let running requests finish; those still running then "
             "get a clean 503 error (default 30)")
    add("--log-level", default="INFO")


@dataclass(frozen=True)
class NodeArgs:
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
    def from_args(role: str, ns: argparse.Namespace, host: str, http_port: int) -> NodeArgs:
        node_id = ns.node_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        if ns.drain_timeout_s < 0:
            raise SystemExit(f"pdserve {role}: error: --drain-timeout must be >= 0, "
                             f"got {ns.drain_timeout_s:g}")
        urls = tuple(u.strip() for value in ns.bootstrap_urls or () for u in value.split(",")
                     if u.strip())
        return NodeArgs(role, node_id, urls, host, ns.advertise_host or host,
                        ns.request_port, ns.control_port, http_port, ns.drain_timeout_s,
                        uuid.uuid4().hex)

    def endpoint(self, port: int) -> str:
        return f"tcp://{self.host}:{port}"


def build_runner(model: ModelConfig, progress: bool = True, *,
                 decodes: bool = True) -> ModelRunner:
    """The node's model and pool, warmed up. `decodes`: False on a prefill node, which
    computes one token per request and never runs decode steps: no decode graphs to capture
    (their buffers and scratch page) and the pool sized for prefill's warm-up alone."""
    from common.model.runner import ModelRunner

    budget = None if model.kv_cache_memory_gb is None else int(model.kv_cache_memory_gb * (1 << 30))
    runner = ModelRunner.from_path(model.model_path, progress=progress,
                                   dtype=model.resolved_dtype(), device=model.device,
                                   page_size=model.page_size,
                                   max_total_tokens=model.max_total_tokens,
                                   kv_memory_bytes=budget, context_length=model.context_length,
                                   pack_weights=model.pack_weights,
                                   cpu_kernels=model.cpu_kernels,
                                   mem_fraction_static=model.mem_fraction_static,
                                   attention_backend=model.attention_backend,
                                   cuda_graph_max_bs=model.cuda_graph_max_bs,
                                   disable_cuda_graph=model.disable_cuda_graph,
                                   decodes=decodes)
    runner.warmup()  # before the node registers: its first request runs at full speed
    return runner


def bind_request_socket(node: NodeArgs) -> tuple[zmq.Socket, str]:
    sock, endpoint = bind_pull(zmq.Context.instance(), node.endpoint(node.request_port))
    return sock, advertised(endpoint, node)


def advertised(endpoint: str, node: NodeArgs) -> str:
    """The endpoint as peers must dial it (bound on --host, reached on --advertise-host)."""
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://{node.advertise_host}:{port}"


class NodeProcess:
    """Runs a node's step() loop with its status server and registry link; stops on SIGTERM."""

    def __init__(self, node: NodeArgs, step: Callable[[], bool], health: Callable[[], dict]) -> None:
        self.node = node
        self.step = step
        self.health_extra = health
        self.stopping = threading.Event()
        self.registry: RegistrySet | None = None
        self.http = serve_status(node.host, node.http_port, self.health)
        self.http_url = f"http://{node.advertise_host}:{self.http.server_address[1]}"

    def health(self) -> dict[str, Any]:
        registered = self.registry is None or self.registry.is_registered
        body = {"status": "ok" if registered and not self.stopping.is_set() else "unavailable",
                "role": self.node.role, "node_id": self.node.node_id,
                "registered": registered}
        body.update(self.health_extra())
        return body

    def register(self, message: msg.RegisterNode, load: Callable[[], dict[str, Any]]) -> None:
        if self.node.bootstrap_urls:
            self.registry = RegistrySet(self.node.bootstrap_urls, message, load).start()

    def announce(self, **fields: Any) -> None:
        """One machine-readable line on stdout for launchers and tests."""
        info = {"role": self.node.role, "node_id": self.node.node_id, "http_url": self.http_url,
                **fields}
        sys.stdout.write(ready_line(info))
        sys.stdout.flush()

    def is_gateway_alive(self, gateway_id: str, now: float) -> bool:
        """Whether the gateway that sent a request is still there (always, without a registry)."""
        return self.registry is None or self.registry.is_gateway_alive(gateway_id, now)

    def run(self, drain: Callable[[], bool] | None = None,
            on_drain_timeout: Callable[[], None] | None = None) -> None:
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
                    time.sleep(0.0005)
        if self.registry is not None:
            self.registry.leave()  # no new requests; the gateway is still watched
        deadline = time.monotonic() + self.node.drain_timeout_s
        while drain is not None and not drain() and time.monotonic() < deadline:
            if not self.step():
                time.sleep(0.0005)
        if drain is not None and not drain() and on_drain_timeout is not None:
            logger.warning("drain timeout (%g s) passed; failing what is still running",
                           self.node.drain_timeout_s)
            on_drain_timeout()
            for _ in range(20):  # let the failures reach the gateway before we exit
                self.step()
                time.sleep(0.01)
        if self.registry is not None:
            self.registry.stop(deregister=False)
        self.http.shutdown()


def setup_logging(level: str, role: str) -> None:
    """Log lines to stderr; SIGUSR1 dumps every thread's stack there (a node that seems hung:
    ``kill -USR1 <pid>``; faulthandler answers even while a thread holds the GIL)."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    metrics.set_role(role)
