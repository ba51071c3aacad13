"""Chaos, as an operator would try it: two gateway replicas, 2 prefill + 2 decode nodes,
streaming clients, and a fault every few seconds for minutes.

The faults cycle over every role: kill -9 of a decode node, of a prefill node and of a
gateway replica (each started again on the same ports a moment later), and SIGSTOP of a
node or a replica past two leases (then SIGCONT). One fault at a time, so some pair is
always whole. Clients stream greedy /generate requests of natural-language prompts
through the replicas in turn (the next one when a replica refuses the connection, as a
Service in front of them would) and every output is checked against the single-process
float32 reference (tests/support/parity.py).

What counts: a stream through a gateway replica that was killed or stopped while it ran
may drop (the client's to retry; docs/operations.md); every other stream must complete
with its reference's tokens: an error there is an error from a node fault. A stream that
neither ends nor errors within ``HANG_S`` is hung. At the end every node holds no page
and a fresh request through each replica succeeds.

Used by tests/faults/test_chaos.py (about 3 minutes in `make test`) and bench/chaos.py
(the 10-minute run).
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tests.faults.harness import (
    API_KEY,
    HOST,
    START_TIMEOUT_S,
    TOKEN,
    Node,
    healthy_ids,
    start_nodes,
    stop_nodes,
)
from tests.support import parity
from tests.support.cluster import http as call
from tests.support.cluster import metric, start, wait_ready
from tests.support.ports import free_port
from tests.support.waits import wait_for

LEASE_S = 2.0
HANG_S = 120.0  # a stream silent this long (no token, no end) is hung
STOP_S = 2 * LEASE_S + 1.0  # a SIGSTOP lasts past two leases
RESTART_AFTER_S = 1.0  # a killed process is started again this long after
PAGES_BOUND_S = 30.0  # abandoned work: nodes idle within this (SMG's bar)
# (action, role) in the order the faults come; targets alternate between the two of a role.
SCHEDULE = [
    ("kill9", "decode"),
    ("kill9", "prefill"),
    ("sigstop", "decode"),
    ("kill9", "gateway"),
    ("sigstop", "prefill"),
    ("sigstop", "gateway"),
]


@dataclass
class ChaosCluster:
    num_gateways: int = 2
    num_prefill: int = 2
    num_decode: int = 2
    node_args: list[str] = field(default_factory=list)  # both roles
    prefill_args: list[str] = field(default_factory=list)  # prefill nodes only
    nodes: dict[str, Node] = field(default_factory=dict)
    apis: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        registries = []
        for i in range(self.num_gateways):
            api, registry = free_port(), free_port()
            self.apis.append(f"http://{HOST}:{api}")
            registries.append(f"http://{HOST}:{registry}")
            args = [
                "--host", HOST, "--port", str(api),
                "--disaggregation-bootstrap-port", str(registry),
                "--reply-port", str(free_port()),
                "--auth-token", TOKEN, "--api-key", API_KEY,
                "--lease-timeout", str(LEASE_S),
            ]  # fmt: skip
            self.nodes[f"gateway-{i}"] = Node(f"gateway-{i}", "bootstrap", args, api)
        for role, module, num, extra in (
            ("prefill", "prefill_node", self.num_prefill, self.prefill_args),
            ("decode", "decode_node", self.num_decode, []),
        ):
            for i in range(num):
                port = free_port()
                urls = [a for r in registries for a in ("--bootstrap-url", r)]
                args = [
                    "--host", HOST, "--port", str(port),
                    "--request-port", str(free_port()), "--control-port", str(free_port()),
                    "--node-id", f"{role}-{i}", *urls,
                    "--auth-token", TOKEN, "--lease-timeout", str(LEASE_S),
                    "--dtype", "float32", "--max-total-tokens", "4096",
                    *self.node_args, *extra,
                ]  # fmt: skip
                self.nodes[f"{role}-{i}"] = Node(f"{role}-{i}", module, args, port)

    def start(self) -> ChaosCluster:
        start_nodes(self.nodes)
        self.wait_healthy()
        return self

    def close(self) -> None:
        stop_nodes(self.nodes)

    def names(self, role: str) -> list[str]:
        return sorted(n for n in self.nodes if n.startswith(role + "-"))

    def kill9(self, name: str) -> None:
        node = self.nodes[name]
        assert node.proc is not None
        if node.is_stopped:
            node.proc.popen.send_signal(signal.SIGCONT)
            node.is_stopped = False
        node.proc.popen.kill()
        node.proc.popen.wait(10)

    def restart(self, name: str) -> None:
        node = self.nodes[name]
        node.proc = start(node.name, node.module, *node.args)
        wait_ready([node.proc], START_TIMEOUT_S)

    def sigstop(self, name: str) -> None:
        node = self.nodes[name]
        assert node.proc is not None
        node.proc.popen.send_signal(signal.SIGSTOP)
        node.is_stopped = True

    def sigcont(self, name: str) -> None:
        node = self.nodes[name]
        assert node.proc is not None
        node.proc.popen.send_signal(signal.SIGCONT)
        node.is_stopped = False

    def heal(self) -> None:
        for name, node in self.nodes.items():
            if node.is_stopped:
                self.sigcont(name)
            if not node.is_alive:
                self.restart(name)
        self.wait_healthy()

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        """Every replica lists every node as healthy."""
        want = {n for n in self.nodes if not n.startswith("gateway-")}

        def whole() -> bool:
            for api in self.apis:
                try:
                    status, body = call("GET", api + "/nodes", token=API_KEY, timeout=5)
                except OSError:
                    return False
                if not want <= healthy_ids(status, body):
                    return False
            return True

        try:
            wait_for(whole, timeout_s, "every replica sees every node healthy", interval_s=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.describe()}") from None

    def describe(self) -> str:
        """What each replica lists and each process last said (for a failed wait)."""
        out = []
        for api in self.apis:
            try:
                status, body = call("GET", api + "/nodes", token=API_KEY, timeout=5)
                rows = body.get("nodes", []) if isinstance(body, dict) else []
                seen = {n["id"]: (n.get("healthy"), n.get("last_heartbeat_s_ago")) for n in rows}
                out.append(f"{api}: {status} {seen}")
            except OSError as exc:
                out.append(f"{api}: {exc!r}")
        for name, node in self.nodes.items():
            state = "stopped" if node.is_stopped else "alive" if node.is_alive else "dead"
            lines = node.proc.lines[-12:] if node.proc is not None else []
            out.append(f"--- {name} ({state})\n" + "".join(lines))
        return "\n".join(out)

    def pages_held(self) -> dict[str, float]:
        return {
            n: metric(node.http_url, "pdserve_kv_pages_held")
            for n, node in self.nodes.items()
            if not n.startswith("gateway-")
        }


@dataclass
class StreamResult:
    prompt: int
    gateway: int
    started: float
    ended: float = 0.0
    kind: str = "pending"  # completed | error | hung
    answer: parity.Answer | None = None
    error: str = ""
    reconnects: int = 0  # replicas that refused the connection before one took it


def stream_generate(
    apis: list[str], first: int, prompt: str, max_new_tokens: int, result: StreamResult
) -> None:
    """One streamed greedy /generate with logprobs; the next replica if one refuses us."""
    body = json.dumps(
        {
            "text": prompt,
            "stream": True,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
    )
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    last: dict[str, Any] | None = None
    try:
        for k in range(len(apis)):
            g = (first + k) % len(apis)
            host, port = apis[g].rsplit(":", 1)
            conn = http.client.HTTPConnection(host[len("http://") :], int(port), timeout=HANG_S)
            try:
                conn.request("POST", "/generate", body, headers)
            except ConnectionRefusedError:
                result.reconnects += 1
                conn.close()
                continue
            result.gateway = g
            try:
                resp = conn.getresponse()
                if resp.status != 200:
                    result.kind = "error"
                    result.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
                    return
                for raw in resp:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        result.kind, result.error = "error", json.dumps(event["error"])[:300]
                        return
                    last = event
            finally:
                conn.close()
            break
        else:
            result.kind, result.error = "error", "every replica refused the connection"
            return
        if last is None or last["meta_info"]["finish_reason"] is None:
            result.kind, result.error = "error", "the stream ended without a finish"
            return
        logprobs = [float(x[0]) for x in last["meta_info"].get("output_token_logprobs") or []]
        result.kind, result.answer = "completed", parity.Answer(last["output_ids"], logprobs)
    except TimeoutError:
        result.kind, result.error = "hung", f"silent for {HANG_S:.0f} s"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        result.kind, result.error = "error", f"{type(exc).__name__}: {exc}"
    finally:
        result.ended = time.monotonic()


@dataclass
class FaultRecord:
    action: str
    target: str
    at: float
    until: float = 0.0  # when the target ran (or was reachable) again


@dataclass
class ChaosReport:
    streams: int = 0
    completed_equal: int = 0
    parted_at_near_tie: int = 0
    different: list[str] = field(default_factory=list)
    node_fault_errors: list[str] = field(default_factory=list)
    gateway_fault_drops: int = 0
    hung: list[str] = field(default_factory=list)
    reconnects: int = 0
    faults: list[FaultRecord] = field(default_factory=list)
    pages_held_at_end: dict[str, float] = field(default_factory=dict)
    pages_zero_s: float = 0.0
    fresh_ok: int = 0
    fresh_total: int = 0
    migrations: float = 0.0  # counted by the replicas alive at the end (a restart resets)

    def summary(self) -> dict[str, Any]:
        return {
            "streams": self.streams,
            "completed_equal": self.completed_equal,
            "parted_at_near_tie": self.parted_at_near_tie,
            "different_outputs": len(self.different),
            "errors_from_node_faults": len(self.node_fault_errors),
            "dropped_with_their_gateway": self.gateway_fault_drops,
            "hung": len(self.hung),
            "reconnects": self.reconnects,
            "faults": len(self.faults),
            "faults_by_kind": _count(f"{f.action} {f.target.split('-')[0]}" for f in self.faults),
            "pages_held_at_end": sum(self.pages_held_at_end.values()),
            "pages_zero_after_s": round(self.pages_zero_s, 2),
            "fresh_requests_ok": f"{self.fresh_ok}/{self.fresh_total}",
            "migrations_counted": self.migrations,
        }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def run_chaos(
    cluster: ChaosCluster,
    prompts: list[str],
    refs: list[parity.Answer],
    *,
    duration_s: float,
    fault_every_s: float,
    num_clients: int = 6,
    max_new_tokens: int = 48,
    log: Any = print,
) -> ChaosReport:
    report = ChaosReport()
    results: list[StreamResult] = []
    lock = threading.Lock()
    stop = threading.Event()
    started = time.monotonic()

    def client(c: int) -> None:
        n = c
        while not stop.is_set():
            i = n % len(prompts)
            r = StreamResult(prompt=i, gateway=n % len(cluster.apis), started=time.monotonic())
            with lock:
                results.append(r)
            stream_generate(cluster.apis, r.gateway, prompts[i], max_new_tokens, r)
            n += num_clients

    def faults() -> None:
        k = 0
        while not stop.wait(max(0.0, started + (k + 1) * fault_every_s - time.monotonic())):
            if time.monotonic() - started > duration_s - 5:
                return
            action, role = SCHEDULE[k % len(SCHEDULE)]
            target = cluster.names(role)[(k // len(SCHEDULE)) % len(cluster.names(role))]
            rec = FaultRecord(action, target, time.monotonic())
            report.faults.append(rec)
            log(f"[chaos +{rec.at - started:.0f}s] {action} {target}")
            if action == "kill9":
                cluster.kill9(target)
                time.sleep(RESTART_AFTER_S)
                cluster.restart(target)
            else:
                cluster.sigstop(target)
                time.sleep(STOP_S)
                cluster.sigcont(target)
            rec.until = time.monotonic()
            k += 1

    clients = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(num_clients)]
    faulting = threading.Thread(target=faults, daemon=True)
    for t in clients:
        t.start()
    faulting.start()
    time.sleep(duration_s)
    stop.set()
    faulting.join(START_TIMEOUT_S)
    for t in clients:
        t.join(HANG_S + 30)
    _classify(report, results, refs, started)
    cluster.heal()
    ended = time.monotonic()
    try:
        wait_for(
            lambda: not any(cluster.pages_held().values()),
            PAGES_BOUND_S,
            "no node holds a page",
            interval_s=0.2,
        )
    except AssertionError:
        pass
    report.pages_zero_s = time.monotonic() - ended
    report.pages_held_at_end = cluster.pages_held()
    for g, api in enumerate(cluster.apis):
        r = StreamResult(prompt=0, gateway=g, started=time.monotonic())
        stream_generate([api], 0, prompts[0], max_new_tokens, r)
        report.fresh_total += 1
        same = r.answer is not None and parity.compare([r.answer], refs[:1]).is_ok
        report.fresh_ok += int(r.kind == "completed" and same)
        try:
            report.migrations += metric(api, "pdserve_migrations_total")
        except (KeyError, OSError):
            pass
    return report


def _classify(
    report: ChaosReport, results: list[StreamResult], refs: list[parity.Answer], run_started: float
) -> None:
    gateway_faults = [f for f in report.faults if f.target.startswith("gateway-")]
    for r in results:
        if r.ended == 0.0:
            r.kind, r.error = "hung", "its client thread never returned"
        report.streams += 1
        report.reconnects += r.reconnects
        name = f"gateway-{r.gateway}"
        hit_gateway = any(
            f.target == name and f.at <= r.ended and r.started <= f.until for f in gateway_faults
        )
        if r.kind == "completed" and r.answer is not None:
            verdict = parity.compare([r.answer], [refs[r.prompt]])
            if verdict.is_ok:
                report.completed_equal += verdict.num_equal
                report.parted_at_near_tie += verdict.num_tie_parts
            else:
                report.different.append(f"prompt {r.prompt}: {verdict.mismatches}")
        elif hit_gateway:
            report.gateway_fault_drops += 1
        elif r.kind == "hung":
            report.hung.append(f"prompt {r.prompt} via {name}: {r.error}")
        else:
            report.node_fault_errors.append(
                f"prompt {r.prompt} via {name}, sent at +{r.started - run_started:.1f}s of the "
                f"run, answered {r.ended - r.started:.1f}s later: {r.error}"
            )
