"""`pdserve launch` as a test fixture.

Start it on loopback, wait until it is up, find its children, stop it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.support.ports import free_port

STARTUP_TIMEOUT_S = 300.0


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def stop(proc: subprocess.Popen[str], grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


class Launch:
    """`pdserve launch` on loopback; skips the test when it does not come up."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.api_port, self.registry_port = free_port(), free_port()
        backend = "nixl" if importlib.util.find_spec("nixl._api") else "fake"
        argv = [
            sys.executable,
            "-m",
            "common.launch.cli",
            "launch",
            "--port",
            str(self.api_port),
            "--disaggregation-bootstrap-port",
            str(self.registry_port),
            "--disaggregation-transfer-backend",
            backend,
            "--dtype",  # the nodes' outputs are compared with transformers' float32 reference
            "float32",
            *extra,
        ]
        self.log: list[str] = []
        self.is_up = threading.Event()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=workdir,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if line.startswith("pdserve is up"):
                self.is_up.set()

    def wait_up(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.is_up.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                stop(self.proc)
                tail = "\n".join(self.log[-15:])
                pytest.skip(f"pdserve launch did not start here:\n{tail}")

    def targets(self) -> list[tuple[str, str]]:
        """(host:port, pod name) of every process's /metrics."""
        # The API's /nodes: the registry's wants the cluster token, which launch made up.
        nodes = get_json(f"http://127.0.0.1:{self.api_port}/nodes")["nodes"]
        out = [(f"127.0.0.1:{self.api_port}", "pdserve-bootstrap-0")]
        for node in nodes:
            out.append((urllib.parse.urlsplit(node["metrics_url"]).netloc, f"pdserve-{node['id']}"))
        return out

    def children(self) -> dict[str, int]:
        """The pid of each live child process, by name (bootstrap, prefill-0, decode-1, ...)."""
        out: dict[str, int] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != self.proc.pid or stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            args = [a.decode() for a in argv]
            if "--node-id" in args:
                out[args[args.index("--node-id") + 1]] = int(entry.name)
            elif "bootstrap" in args:
                out["bootstrap"] = int(entry.name)
        return out
