"""pdserve's waiting-queue orders against SGLang's own calc_priority, on identical inputs.

    bash bench/fetch_sglang.sh /tmp/sglang      # once: SGLang 0.5.23's wheel and the few
                                                # modules its import needs (no CUDA)
    python bench/sglang_differential.py --sglang /tmp/sglang [--cases 2000] [--seed 0]

Each case (seeded): a page size (1, 2 or 4), a few cached sequences over a small
vocabulary (so prompts share prefixes), inserted page-aligned into both radix caches
(SGLang's RadixCache.create_simulated, pdserve's RadixCache), and a waiting queue of 2-8
prompts (extensions and cuts of the cached ones, or fresh; some past the in-batch dedup's
32-token thresholds), each with an arrival counter for hrrn, and a processed-token
counter. Both calc_priority run on the same queue; the orders (request ids) are compared
per policy: fcfs, lpm, dfs-weight, hrrn and shortest-prefill-first. SGLang's dfs-weight
does not apply its in-batch dedup, so pdserve runs with dfs_weight_dedup off
(--dfs-weight-dedup on shows its default's departure); the dedup thresholds are 32 tokens
on both. Host-tier hits are not covered (SGLang's HiRadixCache needs its memory pools).

Prints per policy the cases that agree (and in how many SGLang's order is not the
arrival order: a comparison of untouched queues would prove nothing), the first
disagreements (cache, queue, both orders), and one JSON line per policy:
{"bench": "sglang_differential", ...}.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import types
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.kv_pool import PageAllocator  # noqa: E402
from common.radix_cache import RadixCache  # noqa: E402
from prefill_node.request import Req  # noqa: E402
from prefill_node.schedule_policy import SchedulePolicy  # noqa: E402

POLICIES = ("fcfs", "lpm", "dfs-weight", "hrrn", "shortest-prefill-first")
SGLANG_VERSION = "0.5.23"


def load_sglang(root: Path) -> dict[str, Any]:
    """SGLang's policy, cache and request classes, imported from ``root`` (fetch_sglang.sh's
    layout) on this torch; its vision imports get placeholders (never called here)."""
    sys.path[:0] = [str(root / "sglang"), str(root / "deps")]
    import transformers.image_utils  # noqa: F401  (decides torchvision is absent first)

    class _Placeholder(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        sys.modules.setdefault(name, _Placeholder(name))
    import sglang  # type: ignore[import-not-found]
    from sglang.srt.managers import schedule_policy  # type: ignore[import-not-found]
    from sglang.srt.managers.schedule_batch import Req as SReq  # type: ignore[import-not-found]
    from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-not-found]
        InsertParams,
    )
    from sglang.srt.mem_cache.radix_cache import (  # type: ignore[import-not-found]
        RadixCache as SRadixCache,
    )
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import (  # type: ignore[import-not-found]
        SamplingParams,
    )

    # What the scheduler publishes at start-up, as a prefill node's (the only reads here).
    schedule_policy.get_disagg = lambda: types.SimpleNamespace(disaggregation_mode="prefill")
    schedule_policy.get_memory = lambda: types.SimpleNamespace(radix_eviction_policy="lru")
    version = getattr(sglang, "__version__", "?")
    if version != SGLANG_VERSION:
        print(f"warning: SGLang {version}, not {SGLANG_VERSION}", file=sys.stderr)
    return {
        "version": version,
        "policy": schedule_policy.SchedulePolicy,
        "req": SReq,
        "cache": SRadixCache,
        "key": RadixKey,
        "insert": InsertParams,
        "sampling": SamplingParams,
    }


def random_case(rng: random.Random) -> dict[str, Any]:
    page = rng.choice([1, 2, 4])
    vocab = rng.choice([3, 6, 50])

    def seq(lo: int, hi: int) -> list[int]:
        return [rng.randrange(1, vocab + 1) for _ in range(rng.randrange(lo, hi + 1))]

    longest = rng.choice([24, 24, 80])  # 80: past the in-batch dedup's 32-token thresholds
    cached = [seq(1, longest) for _ in range(rng.randrange(0, 5))]
    queue = []
    for _ in range(rng.randrange(2, 9)):
        if cached and rng.random() < 0.7:
            base = rng.choice(cached)
            prompt = base[: rng.randrange(0, len(base) + 1)] + seq(0, 10)
        else:
            prompt = seq(1, longest)
        queue.append(prompt or seq(1, 3))
    processed = rng.randrange(0, 400)
    arrivals = sorted(rng.randrange(0, processed + 1) for _ in queue)
    return {
        "page": page,
        "cached": cached,
        "queue": queue,
        "processed": processed,
        "arrivals": arrivals,
    }


def pdserve_order(
    case: dict[str, Any], policy: str, dfs_weight_dedup: bool
) -> tuple[list[str], bool]:
    """The order, and whether the in-batch dedup held a request back."""
    page = case["page"]
    alloc = PageAllocator(4096)
    tree = RadixCache(page, alloc)
    for tokens in case["cached"]:
        aligned = tokens[: len(tokens) // page * page]
        if not aligned:
            continue
        held = tree.match_prefix(aligned).page_ids
        pages = held + alloc.allocate(len(aligned) // page - len(held))
        present = tree.insert(aligned, pages) // page
        alloc.free(pages[len(held) : present])
    queue = []
    for i, (tokens, arrived) in enumerate(zip(case["queue"], case["arrivals"], strict=True)):
        r = Req(f"r{i}", i, list(tokens), max_new_tokens=16)
        r.enter_waiting_queue(float(i), arrived)
        queue.append(r)
    SchedulePolicy(policy, tree, dfs_weight_dedup=dfs_weight_dedup).calc_priority(
        queue, None, case["processed"]
    )
    return [r.rid for r in queue], any(r.is_deprioritized for r in queue)


def sglang_order(sg: dict[str, Any], case: dict[str, Any], policy: str) -> list[str]:
    import torch

    page = case["page"]
    tree = sg["cache"].create_simulated(page_size=page)
    for tokens in case["cached"]:
        aligned = tokens[: len(tokens) // page * page]
        if aligned:
            key = sg["key"](token_ids=array("q", aligned), extra_key=None)
            tree.insert(sg["insert"](key=key, value=torch.arange(len(aligned))))
    queue = []
    for i, (tokens, arrived) in enumerate(zip(case["queue"], case["arrivals"], strict=True)):
        r = sg["req"](f"r{i}", "", array("q", tokens), sg["sampling"](max_new_tokens=16))
        r.arrival_processed_tokens = arrived
        r.time_stats.wait_queue_entry_time = float(i)
        queue.append(r)
    sg["policy"](policy, tree, False, False, False).calc_priority(queue, None, case["processed"])
    return [r.rid for r in queue]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang", type=Path, required=True, help="fetch_sglang.sh's folder")
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--show", type=int, default=3, help="disagreements printed per policy")
    ap.add_argument(
        "--dfs-weight-dedup",
        choices=["on", "off"],
        default="off",
        help="pdserve's flag (on: its default, which departs from SGLang on purpose)",
    )
    args = ap.parse_args()
    sg = load_sglang(args.sglang)
    rng = random.Random(args.seed)
    cases = [random_case(rng) for _ in range(args.cases)]
    print(f"SGLang {sg['version']} against pdserve, {len(cases)} cases, seed {args.seed}")
    for policy in args.policies:
        same, shown, moved, held = 0, 0, 0, 0
        for case in cases:
            ours, dedup = pdserve_order(case, policy, args.dfs_weight_dedup == "on")
            held += dedup
            theirs = sglang_order(sg, case, policy)
            moved += theirs != sorted(theirs, key=lambda rid: int(rid[1:]))
            if ours == theirs:
                same += 1
            elif shown < args.show:
                shown += 1
                print(f"  {policy}: {json.dumps(case)}\n    pdserve {ours}\n    sglang  {theirs}")
        rate = same / len(cases)
        print(
            f"{policy:>24}: {same}/{len(cases)} orders equal ({rate:.1%}); SGLang reordered "
            f"the queue in {moved} of them, the in-batch dedup held a request back in {held}",
            flush=True,
        )
        row = {
            "bench": "sglang_differential",
            "sglang": sg["version"],
            "policy": policy,
            "cases": len(cases),
            "equal": same,
            "rate": round(rate, 4),
            "reordered": moved,
            "seed": args.seed,
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
