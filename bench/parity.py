"""Accuracy parity over a long run: the 500 natural-language prompts of
tests/data/parity_prompts.txt through a P/D pair (NIXL) and through a colocated node, each
output compared with the single-process float32 reference.

    python bench/parity.py [--num 500] [--max-new-tokens 32] [--concurrency 16]
                           [--modes pd colocated]

The setting is hostile on purpose: 64-token chunked prefill, prompts sharing preambles (cache
hits), a prefill pool that evicts and a decode pool that retracts. The prompts run in order,
``--concurrency`` at a time, on one cluster per mode, so the last requests meet whatever
the first hundreds left behind (the long-run decay users report). tests/support/parity.py
says how outputs are compared (token ids equal but for near ties; logprobs within 1e-3).
Prints per-100 windows and JSON lines {"bench": "parity", "mode": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_info import describe_cpu  # noqa: E402

from tests.support import parity  # noqa: E402
from tests.support.cluster import http, metric, pd_pair, start, wait_ready  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

PREFILL = ["--dtype", "float32", "--chunked-prefill-size", "64", "--max-total-tokens", "1024"]
DECODE = ["--dtype", "float32", "--max-total-tokens", "512", "--num-reserved-decode-tokens", "0"]
COLOCATED = [
    "--dtype", "float32", "--chunked-prefill-size", "64", "--max-total-tokens", "512",
    "--num-reserved-decode-tokens", "0",
]  # fmt: skip


def _colocated_cluster() -> tuple[str, str, list[Any]]:
    api, registry = free_port(), free_port()
    boot = start(
        "bootstrap", "bootstrap", "--host", "127.0.0.1", "--port", str(api),
        "--disaggregation-bootstrap-port", str(registry),
    )  # fmt: skip
    node = start(
        "colocated-0", "colocated_node", "--host", "127.0.0.1", "--port", "0",
        "--node-id", "colo", "--bootstrap-url", f"http://127.0.0.1:{registry}", *COLOCATED,
    )  # fmt: skip
    wait_ready([boot, node])
    url = f"http://127.0.0.1:{api}"
    deadline = time.monotonic() + 120
    while http("GET", url + "/ready")[0] != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the colocated node never became ready")
        time.sleep(0.2)
    return url, node.ready["http_url"], [boot, node]


def _run(
    mode: str, api: str, node_urls: list[str], args: argparse.Namespace, refs: list[Any]
) -> dict[str, Any]:
    prompts = parity.load_prompts(args.num)
    started = time.monotonic()
    served = parity.serve_all(api, prompts, args.max_new_tokens, args.concurrency)
    took = time.monotonic() - started
    windows = []
    for lo in range(0, len(prompts), 100):
        v = parity.compare(served[lo : lo + 100], refs[lo : lo + 100])
        windows.append(v)
        print(f"  {mode} requests {lo}-{lo + len(served[lo : lo + 100]) - 1}: {v.summary()}")
    whole = parity.compare(served, refs)
    for line in whole.mismatches[:5] + whole.errors[:5]:
        print(f"  {mode}: {line}")
    counters = {
        name: sum(_metric_or_0(u, f"pdserve_{name}_total") for u in node_urls)
        for name in ("retractions", "prefix_cache_hit_tokens")
    }
    return {
        "bench": "parity",
        "mode": mode,
        **whole.summary(),
        "first_100_ids_equal": windows[0].num_equal,
        "last_100_ids_equal": windows[-1].num_equal,
        "retractions": counters["retractions"],
        "cache_hit_tokens": counters["prefix_cache_hit_tokens"],
        "seconds": round(took, 1),
    }


def _metric_or_0(url: str, name: str) -> float:
    try:
        return metric(url, name)
    except KeyError:
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num", type=int, default=500)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--modes", nargs="+", default=["pd", "colocated"], choices=["pd", "colocated"])
    args = ap.parse_args()
    print(f"CPU: {describe_cpu()}")
    started = time.monotonic()
    refs = parity.references(parity.load_prompts(args.num), args.max_new_tokens)
    print(f"reference: {len(refs)} prompts in {time.monotonic() - started:.0f} s")
    results = []
    for mode in args.modes:
        if mode == "pd":
            with pd_pair(PREFILL, DECODE) as cluster:
                urls = [cluster["prefill"].ready["http_url"], cluster["decode"].ready["http_url"]]
                results.append(_run(mode, cluster["api"], urls, args, refs))
        else:
            api, url, procs = _colocated_cluster()
            try:
                results.append(_run(mode, api, [url], args, refs))
            finally:
                for p in procs:
                    p.stop()
    print()
    print(
        "| mode | requests | ids equal | parted at a near tie | mismatches | errors "
        "| max logprob diff | first/last 100 equal | retractions | cache-hit tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['mode']} | {r['requests']} | {r['ids_equal']} | {r['parted_at_near_tie']} "
            f"| {r['mismatches']} | {r['errors']} | {r['max_abs_logprob_diff']:.2e} "
            f"| {r['first_100_ids_equal']}/{r['last_100_ids_equal']} | {r['retractions']:.0f} "
            f"| {r['cache_hit_tokens']:.0f} |"
        )
    for r in results:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
