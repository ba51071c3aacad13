"""Open-loop serving benchmark: Poisson arrivals of streaming requests against a running gateway.

    python bench/serving.py --url http://127.0.0.1:8000 --request-rate 4 --num-prompts 100 \
        --max-tokens 64 --slo-ttft-ms 500 --slo-tpot-ms 50

Arrivals follow a Poisson process at --request-rate (inf: all at once) whatever the server
does (open loop). Each request streams /v1/completions with a synthetic prompt (optionally
sharing a prefix, to exercise prefix affinity) and ignore_eos, so it produces --max-tokens
tokens. Reports TTFT, inter-token latency (between streamed chunks), TPOT, end-to-end
latency, throughput and goodput (requests per second meeting both SLOs); the last stdout
line is one JSON object. Only loopback URLs unless --allow-remote; bounded by
--num-prompts and --max-duration.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import random
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

WORDS = [
    "the",
    "cache",
    "page",
    "prefill",
    "decode",
    "token",
    "stream",
    "model",
    "layer",
    "batch",
    "queue",
    "room",
    "node",
    "transfer",
    "request",
    "latency",
    "memory",
    "kernel",
    "prompt",
    "answer",
    "system",
    "user",
    "value",
    "key",
    "head",
    "vector",
    "radix",
    "tree",
]


@dataclass
class Result:
    """One request as the client saw it."""

    is_ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def make_prompts(num: int, words: int, shared_words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(shared_words))
    return [
        (shared + " " if shared else "") + " ".join(rng.choice(WORDS) for _ in range(words))
        for _ in range(num)
    ]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    prompt: str,
    args: argparse.Namespace,
    headers: dict[str, str],
) -> Result:
    body = {
        "model": "default",
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "stream": True,
        "temperature": 0.0,
        "ignore_eos": args.ignore_eos,
        "stream_options": {"include_usage": True},
    }
    result = Result()
    start = time.perf_counter()
    last: float | None = None
    num_chunks = 0
    try:
        async with client.stream(
            "POST", url + "/v1/completions", json=body, headers=headers, timeout=args.timeout
        ) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))[:200]
                    return result
                if event.get("usage"):
                    result.num_output_tokens = int(event["usage"]["completion_tokens"])
                choices = event.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                num_chunks += 1
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return result
    result.e2e_s = time.perf_counter() - start
    result.num_output_tokens = result.num_output_tokens or num_chunks
    result.is_ok = last is not None
    if not result.is_ok:
        result.error = "no tokens"
    return result


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """Send the requests, wait for them (bounded by --max-duration), return the summary."""
    url = args.url.rstrip("/")
    token = args.api_key or os.environ.get("PDSERVE_AUTH_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    prompts = make_prompts(args.num_prompts, args.prompt_words, args.shared_prefix_words, args.seed)
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits) as client:
        tasks: list[asyncio.Task[Result]] = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, prompt, args, headers)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        done, pending = await asyncio.wait(tasks, timeout=args.max_duration)
        for task in pending:
            task.cancel()
        duration = time.perf_counter() - start
    results = [t.result() for t in done if not t.cancelled() and t.exception() is None]
    return summarize(results, len(prompts), duration, args)


def summarize(
    results: list[Result], num_sent: int, duration: float, args: argparse.Namespace
) -> dict[str, Any]:
    ok = [r for r in results if r.is_ok]
    ttft = [r.ttft_s * 1000 for r in ok]
    itl = [x * 1000 for r in ok for x in r.itl_s]
    tpot = [t * 1000 for r in ok if (t := r.tpot_s) is not None]
    e2e = [r.e2e_s * 1000 for r in ok]
    good = [
        r
        for r in ok
        if (args.slo_ttft_ms is None or r.ttft_s * 1000 <= args.slo_ttft_ms)
        and (args.slo_tpot_ms is None or (r.tpot_s or 0.0) * 1000 <= args.slo_tpot_ms)
    ]
    errors = sorted({r.error for r in results if not r.is_ok})

    def mean(v: list[float]) -> float:
        return sum(v) / len(v) if v else 0.0

    duration = max(duration, 1e-9)
    return {
        "bench": "serving",
        "url": args.url,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "num_prompts": num_sent,
        "completed": len(ok),
        "failed": num_sent - len(ok),
        "duration_s": round(duration, 3),
        "ttft_mean_ms": round(mean(ttft), 3),
        "ttft_p50_ms": round(percentile(ttft, 50), 3),
        "ttft_p99_ms": round(percentile(ttft, 99), 3),
        "itl_mean_ms": round(mean(itl), 3),
        "itl_p50_ms": round(percentile(itl, 50), 3),
        "itl_p99_ms": round(percentile(itl, 99), 3),
        "tpot_mean_ms": round(mean(tpot), 3),
        "tpot_p50_ms": round(percentile(tpot, 50), 3),
        "tpot_p99_ms": round(percentile(tpot, 99), 3),
        "e2e_mean_ms": round(mean(e2e), 3),
        "e2e_p50_ms": round(percentile(e2e, 50), 3),
        "e2e_p99_ms": round(percentile(e2e, 99), 3),
        "request_throughput_rps": round(len(ok) / duration, 3),
        "output_tokens_per_s": round(sum(r.num_output_tokens for r in ok) / duration, 3),
        "goodput_rps": round(len(good) / duration, 3),
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        "errors": errors[:5],
    }


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    try:
        return all(
            ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None)
        )
    except (OSError, ValueError):
        return False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000", help="the gateway")
    add("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    add("--num-prompts", type=int, default=100)
    add("--max-tokens", type=int, default=64)
    add("--prompt-words", type=int, default=64, help="random words per prompt")
    add("--shared-prefix-words", type=int, default=0, help="words every prompt starts with")
    add("--slo-ttft-ms", type=float, default=None)
    add("--slo-tpot-ms", type=float, default=None)
    add("--no-ignore-eos", dest="ignore_eos", action="store_false")
    add("--timeout", type=float, default=300.0, help="per request, seconds")
    add("--max-duration", type=float, default=900.0, help="whole run, seconds")
    add("--seed", type=int, default=0)
    add("--api-key", default=None, help="default: $PDSERVE_AUTH_TOKEN")
    add("--allow-remote", action="store_true", help="allow a non-loopback --url")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1 or args.request_rate <= 0:
        print(
            "serving: --num-prompts, --max-tokens and --request-rate must be > 0", file=sys.stderr
        )
        return 2
    if not args.allow_remote and not is_loopback(args.url):
        print(
            f"serving: {args.url} is not a loopback address; pass --allow-remote", file=sys.stderr
        )
        return 2
    summary = asyncio.run(run_bench(args))
    for key in (
        "completed",
        "failed",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "tpot_mean_ms",
        "e2e_p99_ms",
        "output_tokens_per_s",
        "goodput_rps",
    ):
        print(f"{key:>22}: {summary[key]}", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if summary["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
