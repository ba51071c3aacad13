"""What disaggregation costs and buys here: TTFT overhead, decode ITL under prefill load, goodput.

    python bench/disagg.py [--lengths 128 1024 4096] [--repeats 3] [--streams 8]
                           [--modes disaggregated colocated] [--rates 0.25 0.5 1]

Both modes in one run, on the same two cores, each a real cluster behind the same gateway:
  disaggregated: one prefill and one decode process (NIXL, or the fake backend without
    it), prefill pinned to CPU 0, decode to CPU 1 (the gateway on CPU 1);
  colocated: one colocated process (python -m colocated_node: prefill and decode on one
    KV pool, chunked prefill alternating with decode steps) on both CPUs, two threads,
    chunks of --colocated-chunk tokens (512: each prefill step holds the batch up less).
All float32. Tests:
  ttft_overhead: one streamed request at a time, max_tokens 1, a fresh random prompt each
    time (no cache hit), the same prompts in both modes and through an in-process
    ModelRunner pinned to CPU 0 (the model alone). Median of --repeats, with the
    gateway's stage breakdown (pdserve_request_stage_seconds). overhead_ms is disaggregated
    less colocated TTFT; as the colocated process computes on two cores, the honest
    figure for what disaggregation adds is overhead_non_compute_ms: the difference of
    the two modes' TTFT less their own prefill compute stage.
  interference: --streams decode streams of --stream-tokens tokens, idle and while
    --load-tokens-token prompts arrive every --load-interval seconds; client-side ITL p50/p99.
  goodput: Poisson arrivals at each of --rates for --goodput-seconds (prompts of
    --goodput-prompt-tokens random tokens, --goodput-output-tokens out); a request is good
    when its TTFT <= --slo-ttft-ms and its mean time per output token <= --slo-tpot-ms.
Prints tables and JSON lines {"bench": "disagg", "test": ..., ...}.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_cluster import (  # noqa: E402
    LOG_DIR,
    free_port,
    metric_sums,
    pct,
    start,
    stop_all,
    stream,
    wait_line,
    wait_ready,
)

TOKEN = "bench-disagg-token"
CHAIN = (
    "receive",
    "tokenize",
    "route",
    "prefill_bootstrap_queue",
    "prefill_waiting_queue",
    "prefill_compute",
    "kv_transfer",
    "decode_first_token",
    "first_byte",
)


def measure_ttft(
    url: str, lengths: list[int], repeats: int, vocab: int
) -> dict[int, tuple[float, dict[str, float]]]:
    """Per prompt length: the median TTFT (s) and the median of each stage (s)."""
    rng = random.Random(0)  # the same prompts in every mode
    out = {}
    for n in lengths:
        ttfts: list[float] = []
        stages: dict[str, list[float]] = {s: [] for s in CHAIN}
        for _ in range(repeats):
            ids = [rng.randrange(100, vocab) for _ in range(n)]
            before = metric_sums(url)
            t, _ = stream(
                url,
                {
                    "model": "default",
                    "prompt": ids,
                    "max_tokens": 1,
                    "stream": True,
                    "temperature": 0,
                },
            )
            after = metric_sums(url)
            ttfts.append(t)
            for s in CHAIN:
                stages[s].append(after.get(s, 0.0) - before.get(s, 0.0))
        out[n] = (statistics.median(ttfts), {s: statistics.median(v) for s, v in stages.items()})
    return out


def inprocess_ttft(lengths: list[int], repeats: int, vocab: int) -> dict[int, float]:
    """The model alone on CPU 0: extend + argmax of the same prompts, median seconds."""
    import torch

    from common.kv_pool import pages_needed
    from common.model.runner import ExtendRequest, ModelRunner

    rng = random.Random(0)
    mask = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0} & mask or mask)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runner = ModelRunner.from_path(
        None, progress=False, dtype="float32", max_total_tokens=max(lengths) + 64
    )
    runner.warmup()  # as the nodes do before they register
    out = {}
    for n in lengths:
        times = []
        for _ in range(repeats):
            ids = [rng.randrange(100, vocab) for _ in range(n)]
            pages = runner.pool.allocator.allocate(pages_needed(n, runner.page_size))
            start = time.perf_counter()
            runner.extend([ExtendRequest(ids, 0, pages)]).logits.argmax(-1).tolist()
            times.append(time.perf_counter() - start)
            runner.pool.allocator.free(pages)
        out[n] = statistics.median(times)
    os.sched_setaffinity(0, mask)
    torch.set_num_threads(threads)
    return out


def ttft_rows(
    by_mode: dict[str, dict[int, tuple[float, dict[str, float]]]], local: dict[int, float]
) -> list[dict[str, Any]]:
    rows = []
    for n, l_s in local.items():
        row: dict[str, Any] = {
            "bench": "disagg",
            "test": "ttft_overhead",
            "prompt_tokens": n,
            "inprocess_ms": round(l_s * 1e3, 1),
        }
        for mode, key in (("disaggregated", "disagg"), ("colocated", "colocated")):
            if mode not in by_mode:
                continue
            t, stages = by_mode[mode][n]
            row[f"{key}_ms"] = round(t * 1e3, 1)
            # the client's TTFT less the node's own compute of the prompt
            row[f"{key}_non_compute_ms"] = round((t - stages["prefill_compute"]) * 1e3, 1)
            row[f"{key}_stages_ms"] = {s: round(v * 1e3, 2) for s, v in stages.items()}
            if mode == "disaggregated":
                row["transfer_ms"] = round(stages["kv_transfer"] * 1e3, 2)
        if "disagg_ms" in row and "colocated_ms" in row:
            row["overhead_ms"] = round(row["disagg_ms"] - row["colocated_ms"], 1)
            row["overhead_non_compute_ms"] = round(
                row["disagg_non_compute_ms"] - row["colocated_non_compute_ms"], 1
            )
        rows.append(row)
    return rows


def interference(
    url: str, mode: str, streams: int, tokens: int, load_tokens: int, interval: float, vocab: int
) -> list[dict[str, Any]]:
    rng = random.Random(1)
    out = {}
    errors: list[str] = []
    for loaded in (False, True):
        gaps: list[float] = []
        lock = threading.Lock()

        def one(i: int) -> None:
            _, g = stream(
                url,
                {
                    "model": "default",
                    "prompt": f"Story {i}: once upon a time",
                    "max_tokens": tokens,
                    "stream": True,
                    "ignore_eos": True,
                    "temperature": 0,
                },
            )
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
    row: dict[str, Any] = {
        "bench": "disagg",
        "test": "interference",
        "mode": mode,
        "streams": streams,
        "load_prompt_tokens": load_tokens,
        "load_interval_s": interval,
        "load_arrivals": out[True][1],
        "load_errors": errors,
        "itl_p50_idle_ms": round(pct(idle, 50) * 1e3, 1),
        "itl_p99_idle_ms": round(pct(idle, 99) * 1e3, 1),
        "itl_p50_loaded_ms": round(pct(loaded_gaps, 50) * 1e3, 1),
        "itl_p99_loaded_ms": round(pct(loaded_gaps, 99) * 1e3, 1),
    }
    row["ratio"] = round(row["itl_p99_loaded_ms"] / max(row["itl_p99_idle_ms"], 1e-9), 3)
    return [row]


def goodput(
    url: str,
    mode: str,
    rates: list[float],
    seconds: float,
    prompt_tokens: int,
    output_tokens: int,
    slo_ttft_s: float,
    slo_tpot_s: float,
    vocab: int,
) -> list[dict[str, Any]]:
    """Poisson arrivals per rate; requests meeting both SLOs per second, output tokens/s."""
    rows = []
    for rate in rates:
        rng = random.Random(int(rate * 1000))
        results: list[tuple[float, float, int] | None] = []
        lock = threading.Lock()

        def one(ids: list[int]) -> None:
            try:
                ttft, gaps = stream(
                    url,
                    {
                        "model": "default",
                        "prompt": ids,
                        "max_tokens": output_tokens,
                        "stream": True,
                        "ignore_eos": True,
                        "temperature": 0,
                    },
                )
                tpot = sum(gaps) / len(gaps) if gaps else 0.0
                got: tuple[float, float, int] | None = (ttft, tpot, len(gaps) + 1)
            except RuntimeError:
                got = None  # a failed request is never good
            with lock:
                results.append(got)

        threads, start = [], time.perf_counter()
        next_at = start
        while next_at - start < seconds:
            time.sleep(max(0.0, next_at - time.perf_counter()))
            ids = [rng.randrange(100, vocab) for _ in range(prompt_tokens)]
            threads.append(threading.Thread(target=one, args=(ids,), daemon=True))
            threads[-1].start()
            next_at += rng.expovariate(rate)
        for t in threads:
            t.join(600)
        elapsed = time.perf_counter() - start
        done = [r for r in results if r is not None]
        good = [r for r in done if r[0] <= slo_ttft_s and r[1] <= slo_tpot_s]
        rows.append(
            {
                "bench": "disagg",
                "test": "goodput",
                "mode": mode,
                "request_rate": rate,
                "requests": len(threads),
                "failed": len(results) - len(done),
                "slo_ttft_ms": slo_ttft_s * 1e3,
                "slo_tpot_ms": slo_tpot_s * 1e3,
                "goodput_rps": round(len(good) / elapsed, 3),
                "throughput_rps": round(len(done) / elapsed, 3),
                "output_tokens_per_s": round(sum(r[2] for r in done) / elapsed, 1),
                "ttft_p50_ms": round(pct([r[0] for r in done], 50) * 1e3, 1),
                "ttft_p99_ms": round(pct([r[0] for r in done], 99) * 1e3, 1),
                "tpot_p50_ms": round(pct([r[1] for r in done], 50) * 1e3, 1),
                "tpot_p99_ms": round(pct([r[1] for r in done], 99) * 1e3, 1),
            }
        )
    return rows


def run_mode(
    mode: str, args: Any, env: dict[str, str], vocab: int
) -> tuple[dict[int, tuple[float, dict[str, float]]], list[dict[str, Any]]]:
    """One cluster in ``mode``: its TTFT per length, and its interference and goodput rows."""
    backend = "nixl" if __import__("importlib").util.find_spec("nixl._api") else "fake"
    api, registry = free_port(), free_port()
    node = [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--bootstrap-url",
        f"http://127.0.0.1:{registry}",
        "--max-total-tokens",
        "32768",
        "--dtype",
        "float32",
    ]
    procs = [
        start(
            "bootstrap",
            [
                "--host",
                "127.0.0.1",
                "--port",
                str(api),
                "--disaggregation-bootstrap-port",
                str(registry),
            ],
            {1},
            env,
        )
    ]
    try:
        wait_line(procs[0])
        if mode == "disaggregated":
            node += ["--disaggregation-transfer-backend", backend]
            procs.append(start("prefill_node", [*node, "--node-id", "prefill-0"], {0}, env))
            procs.append(start("decode_node", [*node, "--node-id", "decode-0"], {1}, env))
        else:  # both cores, two threads; chunks small enough to keep decode steps coming
            procs.append(
                start(
                    "colocated_node",
                    [
                        *node,
                        "--node-id",
                        "colocated-0",
                        "--chunked-prefill-size",
                        str(args.colocated_chunk),
                    ],
                    {0, 1},
                    {**env, "OMP_NUM_THREADS": "2"},
                )
            )
        for p in procs[1:]:
            wait_line(p)
        url = f"http://127.0.0.1:{api}"
        wait_ready(url)
        stream(url, {"model": "default", "prompt": "warm up", "max_tokens": 2, "stream": True})
        ttft = measure_ttft(url, args.lengths, args.repeats, vocab)
        rows = interference(
            url, mode, args.streams, args.stream_tokens, args.load_tokens, args.load_interval, vocab
        )
        rows += goodput(
            url,
            mode,
            args.rates,
            args.goodput_seconds,
            args.goodput_prompt_tokens,
            args.goodput_output_tokens,
            args.slo_ttft_ms / 1e3,
            args.slo_tpot_ms / 1e3,
            vocab,
        )
        return ttft, rows
    finally:
        stop_all(procs)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["disaggregated", "colocated"],
        choices=["disaggregated", "colocated"],
    )
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=64)
    ap.add_argument("--load-tokens", type=int, default=2048)
    ap.add_argument("--load-interval", type=float, default=3.0)
    ap.add_argument(
        "--colocated-chunk",
        type=int,
        default=512,
        help="--chunked-prefill-size of the colocated process: how long one "
        "prefill step may hold up the decode batch",
    )
    ap.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    ap.add_argument("--goodput-seconds", type=float, default=30.0)
    ap.add_argument("--goodput-prompt-tokens", type=int, default=512)
    ap.add_argument("--goodput-output-tokens", type=int, default=32)
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=150.0)
    args = ap.parse_args()
    from cpu_info import describe_cpu

    print(f"cpu: {describe_cpu()}")
    print(f"node logs: {LOG_DIR}")
    env = {
        **os.environ,
        "PDSERVE_AUTH_TOKEN": TOKEN,
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"),
    }
    vocab = 49152
    by_mode, rows = {}, []
    for mode in args.modes:
        by_mode[mode], mode_rows = run_mode(mode, args, env, vocab)
        rows += mode_rows
    rows = ttft_rows(by_mode, inprocess_ttft(args.lengths, args.repeats, vocab)) + rows
    print(
        "ttft_overhead (in-process: the model alone on CPU 0; non-compute: TTFT less the "
        "prefill compute stage)"
    )
    print(
        f"{'tokens':>6} {'in-proc':>8} {'colocated':>10} {'disagg':>8} {'overhead':>9} "
        f"{'coloc n-c':>10} {'disagg n-c':>10} {'ovh n-c':>8} {'transfer':>9}"
    )
    for r in rows:
        if r["test"] == "ttft_overhead":
            print(
                f"{r['prompt_tokens']:6d} {r['inprocess_ms']:8.1f} "
                f"{r.get('colocated_ms', 0):10.1f} "
                f"{r.get('disagg_ms', 0):8.1f} {r.get('overhead_ms', 0):9.1f} "
                f"{r.get('colocated_non_compute_ms', 0):10.1f} "
                f"{r.get('disagg_non_compute_ms', 0):10.1f} "
                f"{r.get('overhead_non_compute_ms', 0):8.1f} {r.get('transfer_ms', 0):9.2f}"
            )
    for r in rows:
        if r["test"] == "interference":
            print(
                f"interference {r['mode']} ({r['streams']} streams, a {r['load_prompt_tokens']}"
                f"-token prompt every {r['load_interval_s']} s, {r['load_arrivals']} arrived, "
                f"{len(r['load_errors'])} failed): ITL p50/p99 idle "
                f"{r['itl_p50_idle_ms']}/{r['itl_p99_idle_ms']} ms, loaded "
                f"{r['itl_p50_loaded_ms']}/{r['itl_p99_loaded_ms']} ms, p99 ratio {r['ratio']}"
            )
    print(
        f"{'goodput mode':22} {'rate':>5} {'reqs':>5} {'fail':>4} {'good/s':>7} {'done/s':>7} "
        f"{'out tok/s':>9} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9}"
    )
    for r in rows:
        if r["test"] == "goodput":
            print(
                f"{r['mode']:22} {r['request_rate']:5.2f} {r['requests']:5d} {r['failed']:4d} "
                f"{r['goodput_rps']:7.3f} {r['throughput_rps']:7.3f} "
                f"{r['output_tokens_per_s']:9.1f} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:9.1f} "
                f"{r['tpot_p50_ms']:9.1f} {r['tpot_p99_ms']:9.1f}"
            )
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
