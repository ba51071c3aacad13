"""KV beyond the device pool: the prefill host tier and the decode prefix cache, real processes.

    python bench/kv_tiers.py [--workloads multi_turn shared_docs]
                             [--variants device_only host_tier decode_cache both]

Each (workload, variant) runs on a fresh cluster: bootstrap, one prefill node pinned to CPU 0,
one decode node pinned to CPU 1, float32, the built-in model. The prefill node's device pool
holds about --pool-share of the workload's working set (at least its longest prompt); the
host_tier variant adds --enable-hierarchical-cache (write_through, --hicache-ratio large
enough for the working set), decode_cache --disaggregation-decode-enable-radix-cache on the
decode node, both does both. Requests go one at a time (TTFT is then the prefill's own),
streamed through SGLang's /generate, --max-tokens out, token-id prompts (seeded, ids in
[100, vocab)):
  multi_turn   --conversations chats of --turns turns, taken round-robin (every other chat
               runs before a chat's next turn, so the device pool forgets it): turn 1 is a
               --opening-token opening, each next turn the previous prompt, the answer the
               model gave it, and a message of --turn-tokens tokens;
  shared_docs  --docs documents of --doc-tokens tokens, --questions questions each of
               --question-tokens tokens, in a seeded random order.
Reports per run: prompt tokens computed (the prefill node's pdserve_prefill_tokens_total),
TTFT p50/p99 (client), KV bytes moved per request (pdserve_kv_transfer_bytes_total of the
prefill node), host hit tokens, and the load-back cost per page beside what computing a
page costs here (pdserve_host_cache_load_seconds; the gateway's prefill_compute stage per
computed token). Then against device_only: host_tier's computed-token ratio and TTFT p50
speedup (targets: at most 0.5 and at least 2x), decode_cache's KV bytes ratio (target: at
most 0.3 on a 5-turn chat). One JSON line per run:
{"bench": "kv_tiers", "workload": ..., "variant": ..., "computed_tokens": ...,
 "ttft_p50_ms": ..., "ttft_p99_ms": ..., "kv_bytes_per_turn": ..., ...}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_info import describe_cpu  # noqa: E402
from local_cluster import (  # noqa: E402
    LOG_DIR,
    generate,
    metric_sums,
    metric_total,
    pct,
    pd_cluster,
)

VARIANTS = ("device_only", "host_tier", "decode_cache", "both")
HOST_TIER = ("host_tier", "both")
DECODE_CACHE = ("decode_cache", "both")
PAGE = 16
# A request: (its conversation, or None for a standalone prompt; the tokens it adds). A
# conversation's prompt is its last prompt, the answer to it, and the new tokens.
Turn = tuple[int | None, list[int]]


def multi_turn(args: argparse.Namespace, vocab: int) -> list[Turn]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    return [
        (c, tokens(args.turn_tokens if turn else args.opening))
        for turn in range(args.turns)
        for c in range(args.conversations)
    ]


def shared_docs(args: argparse.Namespace, vocab: int) -> list[Turn]:
    rng = random.Random(args.seed + 1)
    docs = [[rng.randrange(100, vocab) for _ in range(args.doc_tokens)] for _ in range(args.docs)]
    turns: list[Turn] = [
        (None, doc + [rng.randrange(100, vocab) for _ in range(args.question_tokens)])
        for doc in docs
        for _ in range(args.questions)
    ]
    rng.shuffle(turns)
    return turns


class Prompts:
    """Builds each request's prompt from the workload and the answers so far."""

    def __init__(self) -> None:
        self.chats: dict[int, list[int]] = {}

    def next(self, turn: Turn) -> list[int]:
        chat, tokens = turn
        if chat is None:
            return tokens
        self.chats[chat] = [*self.chats.get(chat, []), *tokens]
        return self.chats[chat]

    def answered(self, turn: Turn, output_ids: list[int]) -> None:
        if turn[0] is not None:
            self.chats[turn[0]] += output_ids


def estimated_prompts(turns: list[Turn], max_tokens: int) -> list[list[int]]:
    """The prompts with placeholder answers of max_tokens tokens (distinct per chat): their
    sizes and sharing, for sizing the pools before any answer exists."""
    prompts = Prompts()
    out = []
    for turn in turns:
        out.append(prompts.next(turn))
        prompts.answered(turn, [-1 - (turn[0] or 0)] * max_tokens)
    return out


WORKLOADS = {"multi_turn": multi_turn, "shared_docs": shared_docs}


def working_set(prompts: list[list[int]]) -> int:
    """Distinct tokens of the prompts' prefix tree, in whole pages: what caching all of it takes."""
    seen: set[tuple[int, ...]] = set()
    for p in prompts:
        for end in range(PAGE, len(p) + 1, PAGE):
            seen.add(tuple(p[:end]))
    return len(seen) * PAGE


def run(
    workload: str, variant: str, turns: list[Turn], args: argparse.Namespace, env: dict
) -> dict[str, Any]:
    estimate = estimated_prompts(turns, args.max_tokens)
    total = working_set(estimate)
    longest = max(map(len, estimate))
    # A prompt needs its pages, a page of overhead and its first token (the adder).
    pool = max(int(total * args.pool_share), -(-longest // PAGE) * PAGE + 2 * PAGE) // PAGE * PAGE
    prefill_args = [f"--max-total-tokens={pool}"]
    decode_args: list[str] = []
    if variant in DECODE_CACHE:
        decode_args.append("--disaggregation-decode-enable-radix-cache")
    if variant in HOST_TIER:
        ratio = 2 * total / pool + 1  # the whole working set fits the host tier
        prefill_args += ["--enable-hierarchical-cache", f"--hicache-ratio={ratio:.2f}"]
    with pd_cluster(prefill_args, decode_args, env, PAGE) as (url, prefill_url):

        def prefill_metric(name: str) -> float:
            return metric_total(prefill_url, name)

        names = (
            "pdserve_prefill_tokens_total",
            "pdserve_kv_transfer_bytes_total",
            "pdserve_host_cache_hit_tokens_total",
            "pdserve_host_cache_load_seconds_sum",
        )
        before = {n: prefill_metric(n) for n in names}
        compute_before = metric_sums(url).get("prefill_compute", 0.0)
        ttfts, prompt_tokens = [], 0
        prompts = Prompts()
        started = time.perf_counter()
        for turn in turns:
            ids = prompts.next(turn)
            prompt_tokens += len(ids)
            ttft, output_ids = generate(url, ids, args.max_tokens)
            prompts.answered(turn, output_ids)
            ttfts.append(ttft)
        seconds = time.perf_counter() - started
        delta = {n: prefill_metric(n) - before[n] for n in names}
        compute_s = metric_sums(url).get("prefill_compute", 0.0) - compute_before
    computed = int(delta["pdserve_prefill_tokens_total"])
    host_pages = delta["pdserve_host_cache_hit_tokens_total"] / PAGE
    return {
        "bench": "kv_tiers",
        "workload": workload,
        "variant": variant,
        "requests": len(turns),
        "prompt_tokens": prompt_tokens,
        "working_set_tokens": total,
        "device_pool_tokens": pool,
        "computed_tokens": computed,
        "host_hit_tokens": int(delta["pdserve_host_cache_hit_tokens_total"]),
        "ttft_p50_ms": round(pct(ttfts, 50) * 1e3, 1),
        "ttft_p99_ms": round(pct(ttfts, 99) * 1e3, 1),
        "kv_bytes_per_turn": round(delta["pdserve_kv_transfer_bytes_total"] / len(turns)),
        "load_us_per_page": (
            round(delta["pdserve_host_cache_load_seconds_sum"] / host_pages * 1e6, 1)
            if host_pages
            else None
        ),
        "compute_us_per_page": round(compute_s / computed * PAGE * 1e6, 1) if computed else None,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--pool-share", type=float, default=0.25)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--opening", type=int, default=400)
    ap.add_argument("--turn-tokens", type=int, default=60)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--question-tokens", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    refused = [v for v in args.variants if v not in VARIANTS]
    if refused:
        raise SystemExit(f"variants {refused}: choose from {VARIANTS}")
    vocab = 49152  # the built-in SmolLM2's
    print(f"cpu: {describe_cpu()}; node logs: {LOG_DIR}")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"),
    }
    rows = []
    for workload in args.workloads:
        turns = WORKLOADS[workload](args, vocab)
        for variant in args.variants:
            row = run(workload, variant, turns, args, env)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(
        f"\n{'workload':12} {'variant':12} {'computed':>9} {'host hit':>9} {'TTFT p50':>9} "
        f"{'p99 ms':>8} {'KV B/req':>10} {'load us/pg':>10} {'compute us/pg':>13}"
    )
    for r in rows:
        print(
            f"{r['workload']:12} {r['variant']:12} {r['computed_tokens']:9d} "
            f"{r['host_hit_tokens']:9d} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:8.1f} "
            f"{r['kv_bytes_per_turn']:10d} {r['load_us_per_page'] or 0:10.1f} "
            f"{r['compute_us_per_page'] or 0:13.1f}"
        )
    by = {(r["workload"], r["variant"]): r for r in rows}
    for workload in args.workloads:
        base = by.get((workload, "device_only"))
        if base is None:
            continue
        for variant in VARIANTS[1:]:
            row = by.get((workload, variant))
            if row is None:
                continue
            computed = row["computed_tokens"] / base["computed_tokens"]
            speedup = base["ttft_p50_ms"] / row["ttft_p50_ms"]
            kv_ratio = row["kv_bytes_per_turn"] / base["kv_bytes_per_turn"]
            line: dict[str, Any] = {
                "bench": "kv_tiers_ratio",
                "workload": workload,
                "variant": variant,
                "computed_ratio": round(computed, 3),
                "ttft_p50_speedup": round(speedup, 2),
                "kv_bytes_ratio": round(kv_ratio, 3),
            }
            if variant in HOST_TIER:
                line["computed_target_met"] = computed <= 0.5
                line["ttft_target_met"] = speedup >= 2.0
            if variant in DECODE_CACHE and workload == "multi_turn":
                line["kv_bytes_target_met"] = kv_ratio <= 0.3
            print(json.dumps(line))


if __name__ == "__main__":
    main()
