"""n samples of one prompt against n separate requests of it, on real processes.

    python bench/n_samples.py [--n 8] [--prompt-tokens 512] [--max-tokens 32] [--rounds 3]

A fresh cluster per decode variant (bootstrap; one prefill node pinned to CPU 0, one
decode node pinned to CPU 1; float32, the built-in model): ``plain`` and ``decode_cache``
(--disaggregation-decode-enable-radix-cache). In each, side by side, round after round:
``one`` sends one completion (what a prompt costs alone), ``separate`` --n concurrent
completions of one prompt (n=1 each), ``n`` one completion with n=--n; every round a new
seeded random prompt of --prompt-tokens token ids, so no cache carries from one to the
next; sampled (temperature 0.8, a seed).
Reports per mode: prompt tokens the prefill node computed (pdserve_prefill_tokens_total),
KV bytes it moved (pdserve_kv_transfer_bytes_total), both per round, and output tokens per
second (the client's), then n against separate and against --n times ``one`` (what n
requests that share nothing cost: the target is 1/n of it).
One JSON line per (variant, mode): {"bench": "n_samples", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_info import describe_cpu  # noqa: E402
from local_cluster import LOG_DIR, metric_total, pd_cluster  # noqa: E402

VARIANTS = ("plain", "decode_cache")
MODES = ("one", "separate", "n")
PAGE = 16
COMPUTED = "pdserve_prefill_tokens_total"
MOVED = "pdserve_kv_transfer_bytes_total"


def complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


def one_round(url: str, mode: str, ids: list[int], args: argparse.Namespace) -> int:
    """Output tokens of one round of ``mode``."""
    body = {
        "model": "default",
        "prompt": ids,
        "max_tokens": args.max_tokens,
        "temperature": 0.8,
        "seed": 7,
        "ignore_eos": True,
    }
    if mode in ("one", "n"):
        n = args.n if mode == "n" else 1
        return int(complete(url, {**body, "n": n})["usage"]["completion_tokens"])
    counts: list[int] = []

    def send(i: int) -> None:
        counts.append(complete(url, {**body, "seed": 7 + i})["usage"]["completion_tokens"])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(args.n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if len(counts) != args.n:
        raise RuntimeError(f"{args.n - len(counts)} requests failed")
    return sum(counts)


def run(variant: str, args: argparse.Namespace, env: dict[str, str]) -> list[dict[str, Any]]:
    decode_args: list[str] = []
    if variant == "decode_cache":
        decode_args.append("--disaggregation-decode-enable-radix-cache")
    rng = random.Random(args.seed)
    rows = []
    with pd_cluster([], decode_args, env, PAGE) as (url, prefill_url):
        totals = {m: {"computed": 0.0, "bytes": 0.0, "tokens": 0, "seconds": 0.0} for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                ids = [rng.randrange(100, 49152) for _ in range(args.prompt_tokens)]
                computed = metric_total(prefill_url, COMPUTED)
                moved = metric_total(prefill_url, MOVED)
                started = time.perf_counter()
                tokens = one_round(url, mode, ids, args)
                t = totals[mode]
                t["seconds"] += time.perf_counter() - started
                t["tokens"] += tokens
                t["computed"] += metric_total(prefill_url, COMPUTED) - computed
                t["bytes"] += metric_total(prefill_url, MOVED) - moved
        for mode in MODES:
            t = totals[mode]
            rows.append(
                {
                    "bench": "n_samples",
                    "variant": variant,
                    "mode": mode,
                    "n": args.n,
                    "prompt_tokens": args.prompt_tokens,
                    "computed_tokens_per_round": round(t["computed"] / args.rounds),
                    "kv_bytes_per_round": round(t["bytes"] / args.rounds),
                    "output_tokens_per_s": round(t["tokens"] / t["seconds"], 1),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"cpu: {describe_cpu()}; node logs: {LOG_DIR}")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "UCX_TLS": os.environ.get("UCX_TLS", "tcp,self,sm"),
    }
    rows = [row for variant in args.variants for row in run(variant, args, env)]
    for row in rows:
        print(json.dumps(row), flush=True)
    head = f"{'computed/round':>15} {'KV bytes/round':>15} {'out tok/s':>10}"
    print(f"\n{'variant':13} {'mode':9} {head}")
    for r in rows:
        print(
            f"{r['variant']:13} {r['mode']:9} {r['computed_tokens_per_round']:15d} "
            f"{r['kv_bytes_per_round']:15d} {r['output_tokens_per_s']:10.1f}"
        )
    by = {(r["variant"], r["mode"]): r for r in rows}
    for variant in args.variants:
        one, sep, n = (by[(variant, m)] for m in MODES)
        # What n requests that share nothing cost: n times one request's prompt.
        unshared_computed = args.n * max(1, one["computed_tokens_per_round"])
        unshared_bytes = args.n * max(1, one["kv_bytes_per_round"])
        line = {
            "bench": "n_samples_ratio",
            "variant": variant,
            "n_vs_separate_computed": round(
                n["computed_tokens_per_round"] / max(1, sep["computed_tokens_per_round"]), 3
            ),
            "n_vs_separate_kv_bytes": round(
                n["kv_bytes_per_round"] / max(1, sep["kv_bytes_per_round"]), 3
            ),
            "n_computed_vs_unshared": round(n["computed_tokens_per_round"] / unshared_computed, 3),
            "n_kv_bytes_vs_unshared": round(n["kv_bytes_per_round"] / unshared_bytes, 3),
            "n_vs_separate_tokens_per_s": round(
                n["output_tokens_per_s"] / max(1e-9, sep["output_tokens_per_s"]), 2
            ),
        }
        print(json.dumps(line))


if __name__ == "__main__":
    main()
