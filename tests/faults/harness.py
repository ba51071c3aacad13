"""A fault-test cluster on loopback: bootstrap, prefill and decode processes to kill and restart."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tests.faults import report
from tests.support.cluster import Proc, http, metric, start, wait_ready
from tests.support.ports import free_port
from tests.support.waits import wait_for

TOKEN = "faults-token"  # the cluster secret (registry, zmq CURVE keys)
API_KEY = "faults-api-key"  # what clients send
LEASE_S = 2.0
# The specified bound is lease + 1 s; this 2-core machine runs four torch processes, so
# allow 2 s more before calling it a hang.
SLACK_S = 2.0
OUTCOME_BOUND_S = LEASE_S + 1.0 + SLACK_S  # fault -> the client's outcome
PAGES_BOUND_S = LEASE_S + 1.0 + SLACK_S  # fault -> pdserve_kv_pages_held == 0
START_TIMEOUT_S = 180.0
# A restarted node may be refused (409) until its old instance's lease runs out (it asks
# again at most a second apart) and loads its model first on a busy 2-core machine.
HEALTHY_TIMEOUT_S = 60.0
HEAL_CHECK_S = 15.0  # a live node not healthy by then is restarted before the next case
HOST = "127.0.0.1"
MIGRATION_TIMEOUT_S = 1.0
CHUNK = 256  # --chunked-prefill-size of the prefill nodes: a ~2000-token prompt takes 8 chunks


def healthy_ids(status: int, body: Any) -> set[str]:
    """The ids a GET /nodes answer lists as healthy."""
    if status != 200 or not isinstance(body, dict):
        return set()
    return {n["id"] for n in body.get("nodes", []) if n.get("healthy")}


@dataclass
class Node:
    """One role process: how to start it again on the same ports and id, and its live Proc."""

    name: str
    module: str
    args: list[str]
    http_port: int
    proc: Proc | None = None
    is_stopped: bool = False  # SIGSTOPped and not yet continued

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.popen.poll() is None


@dataclass
class Cluster:
    """Bootstrap + prefill-0..N-1 + decode-0 with a short lease, fixed ports and fixed node ids."""

    num_prefill: int = 1
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    nodes: dict[str, Node] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.api_port, self.registry_port, reply = free_port(), free_port(), free_port()
        self.reply_endpoint = f"tcp://{HOST}:{reply}"
        self.api = f"http://{HOST}:{self.api_port}"
        self.registry = f"http://{HOST}:{self.registry_port}"
        self.nodes["bootstrap"] = Node(  # /metrics is served on the API port
            "bootstrap",
            "bootstrap",
            [
                "--host",
                HOST,
                "--port",
                str(self.api_port),
                "--disaggregation-bootstrap-port",
                str(self.registry_port),
                "--reply-port",
                str(reply),
                "--auth-token",
                TOKEN,
                "--api-key",
                API_KEY,
                "--lease-timeout",
                str(LEASE_S),
                # One decode node: a request that loses it finds no other pair to move to,
                # and its client hears so after this (within the cases' bound).
                "--migration-timeout",
                str(MIGRATION_TIMEOUT_S),
            ],
            self.api_port,
        )
        roles = [
            (f"prefill-{i}", "prefill_node", self.prefill_args) for i in range(self.num_prefill)
        ]
        roles.append(("decode-0", "decode_node", self.decode_args))
        for name, module, extra in roles:
            http_port = free_port()
            args = [
                "--host",
                HOST,
                "--port",
                str(http_port),
                "--request-port",
                str(free_port()),
                "--control-port",
                str(free_port()),
                "--node-id",
                name,
                "--bootstrap-url",
                self.registry,
                "--auth-token",
                TOKEN,
                "--max-total-tokens",
                "4096",
                "--lease-timeout",
                str(LEASE_S),
                *extra,
            ]
            self.nodes[name] = Node(name, module, args, http_port)

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> Cluster:
        start_nodes(self.nodes)
        self.wait_healthy()
        return self

    def close(self) -> None:
        stop_nodes(self.nodes)

    def proc(self, name: str) -> Proc:
        node = self.nodes[name]
        assert node.proc is not None, f"{name} was never started"
        return node.proc

    def kill9(self, name: str) -> float:
        """SIGKILL `name` and reap it; the monotonic time of the kill."""
        t = time.monotonic()
        report.fault(t)
        self.proc(name).kill()
        self.nodes[name].is_stopped = False
        return t

    def sigstop(self, name: str) -> float:
        t = time.monotonic()
        report.fault(t)
        self.proc(name).popen.send_signal(signal.SIGSTOP)
        self.nodes[name].is_stopped = True
        return t

    def sigcont(self, name: str) -> float:
        t = time.monotonic()
        self.proc(name).popen.send_signal(signal.SIGCONT)
        self.nodes[name].is_stopped = False
        return t

    def sigterm(self, name: str) -> float:
        t = time.monotonic()
        report.fault(t)
        self.proc(name).popen.send_signal(signal.SIGTERM)
        return t

    def wait_exit(self, name: str, timeout_s: float) -> int:
        """Wait for `name` to exit; its exit status. Kills it when it outlives `timeout_s`."""
        popen = self.proc(name).popen
        try:
            return popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(10)
            raise AssertionError(f"{name} did not exit within {timeout_s:g} s")

    def restart(self, name: str, extra: Iterable[str] = (), *, wait_healthy: bool = True) -> None:
        """Start `name` again on the same ports and node id (killing what is left of it);
        returns at its READY line, or once every node is healthy again (`wait_healthy`)."""
        node = self.nodes[name]
        if node.is_alive:
            self.kill9(name)
        node.proc = start(node.name, node.module, *node.args, *extra)
        node.is_stopped = False
        wait_ready([node.proc], START_TIMEOUT_S)
        if wait_healthy:
            self.wait_healthy()

    def heal(self) -> None:
        """Resume the paused, restart what is dead or unhealthy: the next case starts whole."""
        for name, node in self.nodes.items():
            if node.is_stopped:
                self.sigcont(name)
        dead = [name for name, node in self.nodes.items() if not node.is_alive]
        for name in sorted(dead, key=lambda n: n != "bootstrap"):  # the bootstrap first
            self.restart(name)
        try:
            self.wait_healthy(HEAL_CHECK_S)
        except AssertionError:
            for name in self.unhealthy_nodes():
                self.restart(name)
            self.wait_healthy()

    def unhealthy_nodes(self) -> list[str]:
        """Nodes the gateway does not list as healthy, or whose own /health says otherwise."""
        try:
            status, body = http("GET", self.api + "/nodes", token=API_KEY, timeout=5)
        except OSError:
            return ["bootstrap"]
        live = healthy_ids(status, body)
        bad = []
        for name, node in self.nodes.items():
            if name == "bootstrap":
                continue
            try:
                status, body = http("GET", node.http_url + "/health", timeout=5)
                is_ok = status == 200 and body.get("status") == "ok"
            except OSError:
                is_ok = False
            if name not in live or not is_ok:
                bad.append(name)
        return bad

    def wait_healthy(self, timeout_s: float = HEALTHY_TIMEOUT_S) -> float:
        """Every node is registered and healthy as the gateway sees it, and says so itself."""
        names = {n for n in self.nodes if n != "bootstrap"}
        seen: dict[str, object] = {}

        def healthy() -> bool:
            try:
                status, body = http("GET", self.api + "/nodes", token=API_KEY, timeout=5)
                live = healthy_ids(status, body)
                seen["registry"] = body
                if not names <= live:
                    return False
                for name in names:
                    status, body = http("GET", self.nodes[name].http_url + "/health", timeout=5)
                    seen[name] = body
                    if status != 200 or body.get("status") != "ok":
                        return False
                return True
            except OSError as exc:
                seen["error"] = repr(exc)
                return False

        try:
            return wait_for(healthy, timeout_s, "a healthy cluster", interval_s=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {seen}") from None

    # ---- observations ------------------------------------------------------------------

    def metric(self, name: str, metric_name: str, **labels: str) -> float:
        return metric(self.nodes[name].http_url, metric_name, **labels)

    def pages_held(self, name: str) -> float:
        return self.metric(name, "pdserve_kv_pages_held")

    def inflight(self) -> float:
        """Requests the gateway admitted and has not ended."""
        return self.metric("bootstrap", "pdserve_gateway_inflight_requests")

    def alive_nodes(self) -> list[str]:
        return [
            n
            for n, node in self.nodes.items()
            if n != "bootstrap" and node.is_alive and not node.is_stopped
        ]

    def wait_pages_zero(
        self, names: Iterable[str] | None = None, within_s: float = PAGES_BOUND_S
    ) -> float:
        """Seconds until every named (default: live) node holds no page; fails with what it saw."""
        targets = list(self.alive_nodes() if names is None else names)
        seen: dict[str, list[float | str]] = {n: [] for n in targets}

        def zero() -> bool:
            ok = True
            for n in targets:
                try:
                    value: float | str = self.pages_held(n)
                except (OSError, KeyError) as exc:
                    value = f"unreadable: {exc!r}"
                if not seen[n] or seen[n][-1] != value:
                    seen[n].append(value)
                ok = ok and value == 0
            return ok

        try:
            return wait_for(zero, within_s, "pdserve_kv_pages_held == 0", interval_s=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc} on {targets}; values seen: {seen}") from None


def start_nodes(nodes: dict[str, Node]) -> None:
    """Start every node's process and wait for all their READY lines."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # start() inherits os.environ
    for node in nodes.values():
        node.proc = start(node.name, node.module, *node.args)
    wait_ready([n.proc for n in nodes.values() if n.proc], START_TIMEOUT_S)


def stop_nodes(nodes: dict[str, Node]) -> None:
    """Stop every live node's process (a stopped one is continued first)."""
    for node in nodes.values():
        if node.proc is not None and node.is_alive:
            if node.is_stopped:
                node.proc.popen.send_signal(signal.SIGCONT)
            node.proc.stop(timeout=10)
