"""Start pdserve role processes on loopback for integration tests and read their READY lines."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from common.ready import parse_ready


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    ready: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    argv: list[str] = field(default_factory=list)  # how to start it again

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.poll()

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait(10)


# The tests compare token ids with transformers' float32 reference; --dtype auto would pick
# bfloat16 on a CPU with AMX or AVX512-BF16.
NODE_MODULES = ("prefill_node", "decode_node")


def start(name: str, module: str, *args: str) -> Proc:
    if module in NODE_MODULES and "--dtype" not in args:
        args = (*args, "--dtype", "float32")
    proc = Proc(name, None, argv=[sys.executable, "-m", module, *args])  # type: ignore[arg-type]
    _spawn(proc)
    return proc


def _spawn(proc: Proc) -> None:
    """Run proc.argv; a thread collects its output lines and its READY line."""
    popen = subprocess.Popen(
        proc.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    proc.popen, proc.ready = popen, {}

    def read() -> None:
        assert popen.stdout is not None
        for line in popen.stdout:
            info = parse_ready(line)
            if info is not None and not proc.ready and proc.popen is popen:
                proc.ready.update(info)
            proc.lines.append(line)
            del proc.lines[:-200]

    threading.Thread(target=read, daemon=True).start()


def respawn(proc: Proc) -> None:
    """Start a process that exited (or was killed) again, with the same arguments."""
    _spawn(proc)


def wait_ready(procs: list[Proc], timeout: float = 300.0, *, restarts: int = 1) -> None:
    """Wait for every READY line. A process that exits fails at once. One that is still
    silent at the deadline has its threads' stacks dumped (SIGUSR1) into a warning and is
    started again, at most `restarts` times in all; then it fails with its last lines.

    (Seen once in CI: a decode node stalled for 180 s right after "joining bootstrap
    replica", its registry thread silent too. A clean-clone run showed the same, and its
    warning the cause: the node was ready, but its READY line had a log write appended
    before the newline (stderr shares the pipe), json.loads raised and the reading thread
    died. common.ready now writes the line in one call and reads only its JSON object. The
    restart stays for a start-up that really stalls.)"""
    deadline = time.monotonic() + timeout
    for p in procs:
        while not p.ready:
            if p.popen.poll() is not None:
                raise RuntimeError(
                    f"{p.name} exited ({p.popen.returncode}):\n" + "".join(p.lines[-30:])
                )
            if time.monotonic() > deadline:
                p.popen.send_signal(signal.SIGUSR1)  # the node dumps its threads' stacks
                time.sleep(2.0)
                tail = "".join(p.lines[-80:])
                if restarts <= 0:
                    raise RuntimeError(f"{p.name} did not start:\n" + tail)
                restarts -= 1
                warnings.warn(
                    f"{p.name} did not start within {timeout:g} s and is started "
                    f"again; its last lines and stacks:\n{tail}",
                    stacklevel=2,
                )
                p.popen.kill()
                p.popen.wait(10)
                _spawn(p)
                deadline = time.monotonic() + timeout
            time.sleep(0.1)


def http(
    method: str, url: str, body: Any = None, token: str | None = None, timeout: float = 30.0
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def metric(http_url: str, name: str, **labels: str) -> float:
    """Sum of a metric's samples on a node's /metrics whose labels include `labels`."""
    with urllib.request.urlopen(http_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total, found = total + float(value), True
    if not found:
        raise KeyError(f"{name}{labels} not exported by {http_url}")
    return total


def start_bootstrap(api: int, registry: int, *args: str) -> Proc:
    """A bootstrap serving the API on port ``api`` and the registry on ``registry``."""
    return start(
        "bootstrap",
        "bootstrap",
        "--host",
        "127.0.0.1",
        "--port",
        str(api),
        "--disaggregation-bootstrap-port",
        str(registry),
        *args,
    )


def wait_healthy(
    api_url: str, num_nodes: int, token: str | None = None, timeout: float = 120.0
) -> None:
    """Until the gateway's /nodes lists ``num_nodes`` healthy nodes."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = http("GET", api_url + "/nodes", token=token)
        nodes = body.get("nodes", []) if status == 200 and isinstance(body, dict) else []
        if sum(1 for n in nodes if n.get("healthy")) == num_nodes:
            return
        assert time.monotonic() < deadline, f"nodes never registered: {body}"
        time.sleep(0.2)


@contextlib.contextmanager
def pd_pair(
    prefill_args: list[str],
    decode_args: list[str],
    num_decode: int = 1,
    bootstrap_args: tuple[str, ...] = (),
) -> Iterator[dict[str, Any]]:
    """A bootstrap, one prefill node `prefill-0` and decode nodes `decode-0`.. on loopback,
    all healthy at the gateway: {"api": its URL, "prefill": Proc, "decode": Proc (the
    first), "decodes": [Proc, ...]}."""
    from tests.support.ports import free_port

    api, registry = free_port(), free_port()
    url = f"http://127.0.0.1:{registry}"
    boot = start_bootstrap(api, registry, *bootstrap_args)
    node_args = ["--host", "127.0.0.1", "--port", "0", "--bootstrap-url", url]
    prefill = start("prefill", "prefill_node", *node_args, "--node-id", "prefill-0", *prefill_args)
    decodes = [
        start(f"decode-{i}", "decode_node", *node_args, "--node-id", f"decode-{i}", *decode_args)
        for i in range(num_decode)
    ]
    procs = [boot, prefill, *decodes]
    try:
        wait_ready(procs)
        wait_healthy(f"http://127.0.0.1:{api}", 1 + num_decode)
        yield {
            "api": f"http://127.0.0.1:{api}",
            "prefill": prefill,
            "decode": decodes[0],
            "decodes": decodes,
        }
    finally:
        for p in procs:
            p.stop()


@contextlib.contextmanager
def colocated(
    node_args: tuple[str, ...] = (), bootstrap_args: tuple[str, ...] = ()
) -> Iterator[dict[str, Any]]:
    """A bootstrap and one colocated node `colo` on loopback, ready at the gateway (both
    halves registered): {"api": its URL, "node": Proc}. Pass an --auth-token to both."""
    from tests.support.ports import free_port

    api, registry = free_port(), free_port()
    boot = start_bootstrap(api, registry, *bootstrap_args)
    node = start(
        "colocated-0",
        "colocated_node",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--node-id",
        "colo",
        "--bootstrap-url",
        f"http://127.0.0.1:{registry}",
        *node_args,
    )
    try:
        wait_ready([boot, node])
        url = f"http://127.0.0.1:{api}"
        deadline = time.monotonic() + 60
        while http("GET", url + "/ready")[0] != 200:
            assert time.monotonic() < deadline, "the colocated node never registered both halves"
            time.sleep(0.1)
        yield {"api": url, "node": node}
    finally:
        node.stop()
        boot.stop()
