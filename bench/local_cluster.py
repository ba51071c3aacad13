"""What the benchmarks that start a cluster on loopback share: ports, processes pinned to
cores, readiness, streaming a completion, metrics, percentiles."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.ready import parse_ready  # noqa: E402
from tests.support.ports import free_port  # noqa: E402  (re-exported to the benches)


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    """Until the gateway's /ready says a prefill and a decode node are registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"the gateway at {url} did not become ready")


def pct(values: list[float], q: int) -> float:
    """The q-th percentile (1-99); the one value, or NaN, for fewer than two."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


LOG_DIR = Path(tempfile.gettempdir()) / f"pdserve-bench-{os.getpid()}"


def start(
    module: str, args: list[str], cpus: set[int], env: dict[str, str]
) -> subprocess.Popen[str]:
    """One node process pinned to ``cpus``; its stderr (the log) goes to LOG_DIR/<module>.log."""
    usable = os.sched_getaffinity(0)
    pin = cpus & usable or usable
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOG_DIR / f"{module}.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=log,
            preexec_fn=lambda: os.sched_setaffinity(0, pin),
        )


def wait_line(proc: subprocess.Popen[str], timeout_s: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        info = parse_ready(line)
        if info is not None:
            threading.Thread(target=lambda: [None for _ in proc.stdout or []], daemon=True).start()
            return info
        if not line and proc.poll() is not None:
            raise SystemExit(f"{proc.args!r} exited with {proc.returncode}")
    raise SystemExit(f"{proc.args!r} did not start")


def metric_total(url: str, name: str) -> float:
    """The sum of every sample of metric ``name`` (all labels) on a process's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_sums(url: str) -> dict[str, float]:
    """sum of pdserve_request_stage_seconds per stage on the gateway's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("pdserve_request_stage_seconds_sum{"):
            head, value = line.rsplit(" ", 1)
            stage = head.split('stage="', 1)[1].split('"', 1)[0]
            out[stage] = out.get(stage, 0.0) + float(value)
    return out


def sse_objects(url: str, body: dict[str, Any]) -> Iterator[tuple[float, dict[str, Any]]]:
    """(seconds since the request, object) for each JSON event of a streamed POST."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    try:
        r = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:300]!r}") from None
    with r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                yield time.perf_counter() - start, json.loads(line[6:])


def stream(url: str, body: dict[str, Any]) -> tuple[float, list[float]]:
    """(TTFT s, gaps between later chunks s) of one streamed completion."""
    ttft, last, gaps = None, 0.0, []
    for at, obj in sse_objects(url + "/v1/completions", body):
        choices = obj["choices"]
        if not choices or not choices[0].get("text") and not choices[0].get("finish_reason"):
            continue
        if ttft is None:
            ttft = at
        else:
            gaps.append(at - last)
        last = at
    return ttft or float("nan"), gaps


def generate(url: str, ids: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """(TTFT s, output token ids) of one streamed greedy /generate request."""
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    ttft, output_ids = None, []
    for at, obj in sse_objects(url + "/generate", body):
        if obj.get("output_ids") and ttft is None:
            ttft = at
        output_ids = obj.get("output_ids", output_ids)
    if len(output_ids) != max_tokens:
        raise RuntimeError(f"{len(output_ids)} tokens out, {max_tokens} asked for")
    return ttft or float("nan"), output_ids


@contextlib.contextmanager
def pd_cluster(
    prefill_args: list[str], decode_args: list[str], env: dict[str, str], page_size: int = 16
) -> Iterator[tuple[str, str]]:
    """A bootstrap, one prefill node pinned to CPU 0 and one decode node pinned to CPU 1
    on loopback (float32, the built-in model), ready and warmed by one request:
    (the API's URL, the prefill node's HTTP URL). Stopped on leaving."""
    api, registry = free_port(), free_port()
    node = [
        "--host=127.0.0.1",
        "--port=0",
        f"--bootstrap-url=http://127.0.0.1:{registry}",
        "--dtype=float32",
        f"--page-size={page_size}",
    ]
    boot = ["--host=127.0.0.1", f"--port={api}", f"--disaggregation-bootstrap-port={registry}"]
    procs = [start("bootstrap", boot, {1}, env)]
    try:
        wait_line(procs[0])
        procs.append(start("prefill_node", [*node, "--node-id=prefill-0", *prefill_args], {0}, env))
        procs.append(start("decode_node", [*node, "--node-id=decode-0", *decode_args], {1}, env))
        prefill_url = wait_line(procs[1])["http_url"]
        wait_line(procs[2])
        url = f"http://127.0.0.1:{api}"
        wait_ready(url)
        generate(url, [7, 8, 9], 2)
        yield url, prefill_url
    finally:
        stop_all(procs)


def stop_all(procs: list[subprocess.Popen[str]], timeout_s: float = 20.0) -> None:
    """Terminate the processes (last started first), then kill any still running."""
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
