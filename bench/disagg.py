"""What disaggregation costs and buys on this machine: TTFT overhead and decode ITL under prefill load.

    python bench/disagg.py [--lengths 128 1024 2048] [--repeats 3] [--streams 8]

Runs a real cluster (bootstrap, one prefill and one decode process, NIXL or the fake
backend) with prefill pinned to CPU 0 and decode to CPU 1 (the gateway on CPU 1), float32.
  ttft_overhead: one streamed request at a time, max_tokens 1, a fresh random prompt each
    time (no cache hit). Against the same prompt through an in-process ModelRunner pinned
    to CPU 0 (extend + argmax, no server): the baseline is the model alone, not a colocated
    server (pdserve has no colocated mode yet). Median of --repeats, with the gateway's
    stage breakdown (pdserve_request_stage_seconds) of the same requests; non_compute_ms is
    the TTFT less the prefill node's own compute stage (what serving and disaggregation add).
  interference: --streams decode streams of --stream-tokens tokens, idle and while
    --load-tokens-token prompts arrive every --load-interval seconds; client-side ITL p50/p99.
Prints tables and JSON lines {"bench": "disagg", "test": ..., ...}.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_cluster import free_port, pct, wait_ready  # noqa: E402
TOKEN = "bench-disagg-token"
READY = "PDSERVE_READY "
CHAIN = ("receive", "tokenize", "route", "prefill_bootstrap_queue", "prefill_waiting_queue",
         "prefill_compute", "kv_transfer", "decode_first_token", "first_byte")


LOG_DIR = Path(tempfile.gettempdir()) / f"pdserve-disagg-{os.getpid()}"


def start(module: str, args: list[str], cpus: set[int], env: dict[str, str]) -> subprocess.Popen[str]:
    """One node process pinned to ``cpus``; its stderr (the log) goes to LOG_DIR/<module>.log."""
    usable = os.sched_getaffinity(0)
    pin = cpus & usable or usable
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOG_DIR / f"{module}.log", "w") as log:
        return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                                text=True, stdout=subprocess.PIPE, stderr=log,
                                preexec_fn=lambda: os.sched_setaffinity(0, pin))


def wait_line(proc: subprocess.Popen[str], timeout_s: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(READY):
            threading.Thread(target=lambda: [None for _ in proc.stdout or []], daemon=True).start()
            return dict(json.loads(line[len(READY):]))
        if not line and proc.poll() is not None:
            raise SystemExit(f"{proc.args} exited with {proc.returncode}")
    raise SystemExit(f"{proc.args} did not start")


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


def stream(url: str, body: dict[str, Any]) -> tuple[float, list[float]]:
    """(TTFT s, gaps between later chunks s) of one streamed completion."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    start = time.perf_counter()
    ttft, last, gaps = None, 0.0, []
    try:
        r = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code}: {exc.read()[:300]!r}") from None
    with r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:])["choices"]
            if not choices or not choices[0].get("text") and not choices[0].get("finish_reason"):
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
    return ttft or float("nan"), gaps


def ttft_overhead(url: str, lengths: list[int], repeats: int, vocab: int) -> list[dict[str, Any]]:
    import torch

    from common.kv_pool import pages_needed
    from common.model.runner import ExtendRequest, ModelRunner

    rng = random.Random(0)
    os.sched_setaffinity(0, {0} & os.sched_getaffinity(0) or os.sched_getaffinity(0))
    torch.set_num_threads(1)
    runner = ModelRunner.from_path(None, progress=False, dtype="float32",
                                   max_total_tokens=max(lengths) + 64)
    runner.warmup()  # as the nodes do before they register
    rows = []
    for n in lengths:
        disagg, local, stages = [], [], {s: [] for s in CHAIN}
        for _ in range(repeats):
            ids = [rng.randrange(100, vocab) for _ in range(n)]
            before = metric_sums(url)
            t, _ = stream(url, {"model": "default", "prompt": ids, "max_tokens": 1, "stream": True,
                                "temperature": 0})
            after = metric_sums(url)
            disagg.append(t)
            for s in CHAIN:
                stages[s].append(after.get(s, 0.0) - before.get(s, 0.0))
            pages = runner.pool.allocator.allocate(pages_needed(n, runner.page_size))
            start = time.perf_counter()
            runner.extend([ExtendRequest(ids, 0, pages)]).logits.argmax(-1).tolist()
            local.append(time.perf_counter() - start)
            runner.pool.allocator.free(pages)
        d_ms, l_ms = statistics.median(disagg) * 1e3, statistics.median(local) * 1e3
        compute_ms = statistics.median(stages["prefill_compute"]) * 1e3
        rows.append({"bench": "disagg", "test": "ttft_overhead", "prompt_tokens": n,
                     "inprocess_ms": round(l_ms, 1), "disagg_ms": round(d_ms, 1),
                     "overhead_ms": round(d_ms - l_ms, 1),
                     # the client's TTFT less the prefill node's own compute of the prompt
                     "non_compute_ms": round(d_ms - compute_ms, 1),
                     "transfer_ms": round(statistics.median(stages["kv_transfer"]) * 1e3, 2),
                     "stages_ms": {s: round(statistics.median(v) * 1e3, 2)
                                   for s, v in stages.items()}})
    return rows


def interference(url: str, streams: int, tokens: int, load_tokens: int, interval: float,
                 vocab: int) -> list[dict[str, Any]]:
    rng = random.Random(1)
    out = {}
    errors: list[str] = []
    for loaded in (False, True):
        gaps: list[float] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            _, g = stream(url, {"model": "default", "prompt": f"Story {i}: once upon a time",
                                "max_tokens": tokens, "stream": True, "ignore_eos": True,
                                "temperature": 0})
            with lock:
                gaps.extend(g)

        def load(ids: list[int]) -> None:
            try:
                stream(url, {"model": "default", "prompt": ids, "max_tokens": 1, "stream": True})
            except RuntimeError as exc:  # counted: a load request that failed
                with lock:
                    errors.append(str(exc)[:200])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
        for t in threads:
            t.start()
        loaders: list[threading.Thread] = []
        while any(t.is_alive() for t in threads):
            if loaded:
                ids = [rng.randrange(100, vocab) for _ in range(load_tokens)]
                loaders.append(threading.Thread(target=load, args=(ids,), daemon=True))
                loaders[-1].start()
            time.sleep(interval)
        for t in loaders:  # before the cluster stops: their prompts are served or fail now
            t.join(600)
        out[loaded] = (gaps, len(loaders))
    idle, loaded_gaps = out[False][0], out[True][0]
    row = {"bench": "disagg", "test": "interference", "mode": "disaggregated", "streams": streams,
           "load_prompt_tokens": load_tokens, "load_interval_s": interval,
           "load_arrivals": out[True][1], "load_errors": errors,
           "itl_p50_idle_ms": round(pct(idle, 50) * 1e3, 1),
           "itl_p99_idle_ms": round(pct(idle, 99) * 1e3, 1),
           "itl_p50_loaded_ms": round(pct(loaded_gaps, 50) * 1e3, 1),
           "itl_p99_loaded_ms": round(pct(loaded_gaps, 99) * 1e3, 1)}
    row["ratio"] = round(row["itl_p99_loaded_ms"] / max(row["itl_p99_idle_ms"], 1e-9), 3)
    return [row]


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--load-tokens", type=int, default=2048)
    ap.add_argument("--load-interval", type=float, default=3.0)
    args = ap.parse_args()
    from cpu_info import describe_cpu

    print(f"cpu: {describe_cpu()}")
    print(f"node logs: {LOG_DIR}")
    backend = "nixl" if __import__("importlib").util.find_spec("nixl._api") else "fake"
    env = {**os.environ, "PDSERVE_AUTH_TOKEN": TOKEN, "OMP_NUM_THREADS": "1",
           "OMP_WAIT_POLICY": "PASSIVE", "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm")}
    api, registry = free_port(), free_port()
    node = ["--host", "127.0.0.1", "--port", "0", "--bootstrap-url",
            f"http://127.0.0.1:{registry}", "--max-total-tokens", "32768", "--dtype", "float32",
            "--disaggregation-transfer-backend", backend]
    procs = [start("bootstrap", ["--host", "127.0.0.1", "--port", str(api),
                                 "--disaggregation-bootstrap-port", str(registry)], {1}, env)]
    try:
        wait_line(procs[0])
        procs.append(start("prefill_node", [*node, "--node-id", "prefill-0"], {0}, env))
        procs.append(start("decode_node", [*node, "--node-id", "decode-0"], {1}, env))
        for p in procs[1:]:
            wait_line(p)
        url = f"http://127.0.0.1:{api}"
        wait_ready(url)
        vocab = 49152
        stream(url, {"model": "default", "prompt": "warm up", "max_tokens": 2, "stream": True})
        rows = ttft_overhead(url, args.lengths, args.repeats, vocab)
        rows += interference(url, args.streams, args.stream_tokens, args.load_tokens,
                             args.load_interval, vocab)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    print(f"ttft_overhead (backend {backend}; in-process runner on the prefill core as baseline)")
    print(f"{'tokens':>6} {'in-proc ms':>10} {'disagg ms':>10} {'overhead':>9} "
          f"{'non-compute':>11} {'transfer':>9}  stages (ms)")
    for r in rows:
        if r["test"] == "ttft_overhead":
            stages = " ".join(f"{k}={v}" for k, v in r["stages_ms"].items())
            print(f"{r['prompt_tokens']:6d} {r['inprocess_ms']:10.1f} {r['disagg_ms']:10.1f} "
                  f"{r['overhead_ms']:9.1f} {r['non_compute_ms']:11.1f} {r['transfer_ms']:9.2f}  "
                  f"{stages}")
    for r in rows:
        if r["test"] == "interference":
            print(f"interference ({r['streams']} streams, a {r['load_prompt_tokens']}-token prompt "
                  f"every {r['load_interval_s']} s, {r['load_arrivals']} arrived, "
                  f"{len(r['load_errors'])} failed): ITL p50/p99 idle "
                  f"{r['itl_p50_idle_ms']}/{r['itl_p99_idle_ms']} ms, loaded "
                  f"{r['itl_p50_loaded_ms']}/{r['itl_p99_loaded_ms']} ms, p99 ratio {r['ratio']}")
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
