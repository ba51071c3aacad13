"""The gateway alone: how many streamed tokens/s and new requests/s one bootstrap process serves.

    python bench/gateway.py [--streams 8 32 128] [--tokens 64] [--duration 8] [--replicas 1 2]

R real bootstrap processes (API, registry, dispatcher; R = 1, then 2 replicas side by
side in one run), fed by stand-in prefill and decode nodes (processes of this file,
`--stand-in ROLE`) that register with every replica, speak the real CURVE zmq wire
protocol and stream tokens as fast as the gateways take them, with no model. The load
generator (this process) keeps S streaming /v1/completions requests open at all times,
spread evenly over the replicas:
  - stream phase: --tokens tokens per request (streamed tokens/s);
  - request phase: one token per request (new requests/s).
Added latency: the decode stand-in stamps each token's send time into its logprob, which
the gateway relays; the client subtracts it from the chunk's arrival (one clock: loopback).
Everything shares this machine's cores, so each process's CPU seconds are reported too,
and the throughput per gateway CPU-second (all replicas' CPU together): what tells
whether replicas scale. Prints a table, then one JSON line per row:
{"bench": "gateway", "replicas": R, "phase": ..., "streams": S, "tokens_per_s": ...,
 "requests_per_s": ..., "added_latency_p99_ms": ..., "gateway_cpu_s": ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_cluster import free_port, pct, wait_ready  # noqa: E402

TOKEN = "bench-gateway-token"
TOKEN_ID = 1000  # every streamed token; the gateway detokenizes it like any other


# ---- stand-in nodes (run as their own processes) ---------------------------------------------


def stand_in(role: str, registry_urls: list[str], node_id: str, base: float) -> None:
    """Register as `role` with every replica; a decode stand-in streams max_new_tokens
    tokens per GenerateReq, round-robin over its open requests, each as soon as the
    previous one was sent."""
    import zmq

    from common import messages as msg
    from common import socket_auth
    from common.ipc import PushPool, bind_pull, recv_messages
    from common.node.registry_set import RegistrySet

    socket_auth.configure(TOKEN)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock, endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    register = msg.RegisterNode(
        node_id=node_id,
        role=role,
        request_endpoint=endpoint,
        control_endpoint=endpoint,
        http_url="http://127.0.0.1:1",
        backend="fake",
        backend_metadata=b"\x00",
        kv_layout={"page_size": 16},
        num_pages=1 << 20,
        max_running_requests=0,
        protocol_version=msg.PROTOCOL_VERSION,
        auth_token=TOKEN,
    )
    registry = RegistrySet(registry_urls, register, dict).start()
    open_reqs: dict[str, list[Any]] = {}  # rid -> [GenerateReq, tokens left]
    with PushPool(ctx) as push:
        while True:
            timeout = 0 if open_reqs else 50
            if sock.poll(timeout):
                for m in recv_messages(sock, socket_name="stand_in", max_frames=4096):
                    if isinstance(m, msg.GenerateReq) and role == "decode":
                        open_reqs[m.rid] = [m, int(m.sampling.get("max_new_tokens", 1))]
                    elif isinstance(m, msg.AbortReq) and m.rid:
                        open_reqs.pop(m.rid, None)
            for rid, entry in list(open_reqs.items()):
                g, left = entry
                # The send time, in ms since the bench's base, rides in the logprob.
                stamp = -(time.time() - base) * 1e3
                push.send(
                    g.reply_endpoint,
                    msg.TokenChunk(
                        rid=rid, token_ids=[TOKEN_ID], logprobs=[stamp], top_logprobs=None
                    ),
                )
                entry[1] = left = left - 1
                if left <= 0:
                    n = int(g.sampling.get("max_new_tokens", 1))
                    push.send(
                        g.reply_endpoint,
                        msg.ReqFinished(
                            rid=rid,
                            finish_reason="length",
                            matched_stop=None,
                            num_prompt_tokens=len(g.input_ids),
                            num_output_tokens=n,
                            num_cached_tokens=0,
                        ),
                    )
                    del open_reqs[rid]
            if not registry.is_registered and registry.last_error:
                time.sleep(0.01)


# ---- the load generator -------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_stream(
    client: Any, url: str, tokens: int, base: float, stats: dict[str, list[float]], until: float
) -> None:
    body = {
        "model": "default",
        "prompt": "Hello there",
        "max_tokens": tokens,
        "stream": True,
        "logprobs": 0,
        "ignore_eos": True,
    }
    import httpx

    while time.monotonic() < until:
        start = time.monotonic()
        n = 0
        try:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    stats["errors"].append(r.status_code)
                    await r.aread()
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    now_ms = (time.time() - base) * 1e3
                    choice = json.loads(line[6:])["choices"]
                    if not choice or not choice[0].get("logprobs"):
                        continue
                    for lp in choice[0]["logprobs"]["token_logprobs"]:
                        stats["added_ms"].append(now_ms + lp)
                        if n == 0:
                            stats["ttft_ms"].append((time.monotonic() - start) * 1e3)
                        n += 1
        except httpx.TransportError as exc:  # counted: a dropped connection is a failure
            stats["errors"].append(f"{type(exc).__name__} after {n} tokens")
            continue
        stats["tokens"].append(n)
        stats["requests"].append(1.0)


async def run_phase(
    urls: list[str], streams: int, tokens: int, duration: float, base: float
) -> tuple[dict[str, list[float]], float]:
    import httpx

    stats: dict[str, list[float]] = {
        "added_ms": [],
        "ttft_ms": [],
        "tokens": [],
        "requests": [],
        "errors": [],
    }
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        start = time.monotonic()
        until = start + duration
        await asyncio.gather(
            *(
                one_stream(client, urls[i % len(urls)], tokens, base, stats, until)
                for i in range(streams)
            )
        )
        return stats, time.monotonic() - start


def run_cluster(replicas: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """R bootstrap replicas and the two stand-ins; one row per (phase, streams)."""
    env = {**os.environ, "PDSERVE_AUTH_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    base = time.time()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls, registries = [], []
    rows: list[dict[str, Any]] = []
    try:
        for i in range(replicas):
            api, registry = free_port(), free_port()
            profile = (
                ["-m", "cProfile", "-o", f"{args.profile_gateway}.{replicas}.{i}"]
                if args.profile_gateway
                else []
            )
            procs[f"gateway-{i}"] = subprocess.Popen(
                [
                    sys.executable,
                    *profile,
                    "-m",
                    "bootstrap",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(api),
                    "--disaggregation-bootstrap-port",
                    str(registry),
                    "--lease-timeout",
                    "30",
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            urls.append(f"http://127.0.0.1:{api}")
            registries.append(f"http://127.0.0.1:{registry}")
        for role in ("prefill", "decode"):
            procs[role] = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--stand-in",
                    role,
                    "--registry",
                    ",".join(registries),
                    "--node-id",
                    f"{role}-0",
                    "--base",
                    repr(base),
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        for url in urls:
            wait_ready(url)
        gateways = [name for name in procs if name.startswith("gateway")]
        for phase, tokens in (("stream", args.tokens), ("requests", 1)):
            for streams in args.streams:
                cpu0 = {name: cpu_seconds(p.pid) for name, p in procs.items()}
                own0 = time.process_time()
                stats, elapsed = asyncio.run(run_phase(urls, streams, tokens, args.duration, base))
                cpu = {name: round(cpu_seconds(p.pid) - cpu0[name], 2) for name, p in procs.items()}
                cpu["load_generator"] = round(time.process_time() - own0, 2)
                gateway_cpu = round(sum(cpu[g] for g in gateways), 2)
                if replicas == 1:
                    cpu["gateway"] = cpu.pop("gateway-0")
                num_tokens, num_reqs = sum(stats["tokens"]), len(stats["requests"])
                rows.append(
                    {
                        "bench": "gateway",
                        "replicas": replicas,
                        "phase": phase,
                        "streams": streams,
                        "tokens_per_request": tokens,
                        "tokens_per_s": round(num_tokens / elapsed, 1),
                        "requests_per_s": round(num_reqs / elapsed, 1),
                        "added_latency_p50_ms": round(pct(stats["added_ms"], 50), 2),
                        "added_latency_p99_ms": round(pct(stats["added_ms"], 99), 2),
                        "ttft_p99_ms": round(pct(stats["ttft_ms"], 99), 2),
                        "errors": len(stats["errors"]),
                        "error_kinds": sorted({str(e) for e in stats["errors"]})[:5],
                        "gateway_cpu_s": gateway_cpu,
                        "tokens_per_gateway_cpu_s": round(num_tokens / max(gateway_cpu, 1e-9), 1),
                        "requests_per_gateway_cpu_s": round(num_reqs / max(gateway_cpu, 1e-9), 1),
                        "cpu_s": cpu,
                        "seconds": round(elapsed, 2),
                    }
                )
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request, stream phase")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds per row")
    ap.add_argument(
        "--replicas",
        type=int,
        nargs="+",
        default=[1, 2],
        help="bootstrap replica counts to run, one cluster each, side by side",
    )
    ap.add_argument(
        "--profile-gateway",
        metavar="FILE",
        help="run the bootstrap process under cProfile, its stats written to FILE",
    )
    ap.add_argument("--stand-in", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--registry", help=argparse.SUPPRESS)
    ap.add_argument("--node-id", help=argparse.SUPPRESS)
    ap.add_argument("--base", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stand_in:
        stand_in(args.stand_in, args.registry.split(","), args.node_id, args.base)
        return
    from cpu_info import describe_cpu

    print(f"cpu: {describe_cpu()}")
    rows = []
    for replicas in args.replicas:
        rows += run_cluster(replicas, args)
    print(
        f"{'replicas':8} {'phase':9} {'streams':>7} {'tok/s':>9} {'req/s':>7} "
        f"{'add p50':>8} {'add p99':>8} "
        f"{'ttft p99':>9} {'gw cpu s':>9} {'tok/gw-cpu-s':>13} {'req/gw-cpu-s':>13}"
    )
    for r in rows:
        print(
            f"{r['replicas']:8d} {r['phase']:9} {r['streams']:7d} {r['tokens_per_s']:9.1f} "
            f"{r['requests_per_s']:7.1f} {r['added_latency_p50_ms']:8.2f} "
            f"{r['added_latency_p99_ms']:8.2f} "
            f"{r['ttft_p99_ms']:9.2f} {r['gateway_cpu_s']:9.2f} "
            f"{r['tokens_per_gateway_cpu_s']:13.1f} {r['requests_per_gateway_cpu_s']:13.1f}"
        )
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
