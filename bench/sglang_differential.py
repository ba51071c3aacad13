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
on both.

--host-tier: every cached sequence is also copied to a host tier (write-through), and each
case then evicts a random number of device tokens (SGLang's own LRU eviction, in its
UnifiedRadixCache with HiCache's tree enabled, built over its CPU pools by its unit tests'
fixture); pdserve's HiRadixCache is brought to the same device/host split (the device
paths SGLang kept are touched, then the rest evicted to the host) and a case whose two
trees disagree on any cached sequence's device or host match is counted, not compared
(SGLang splits a node where an insert of its prefix ends, pdserve does not, so it cannot
always evict just the lower part).
Matches then continue through host-only nodes: SGLang counts those tokens in
num_matched_prefix_tokens (lpm, hrrn, shortest-prefill-first), places a request at its
last device node for dfs-weight and checks the in-batch dedup on the device part alone.

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
from prefill_node.hiradix_cache import HiRadixCache  # noqa: E402
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


def load_sglang_hicache(sg: dict[str, Any]) -> None:
    """Add SGLang's UnifiedRadixCache (HiCache's tree) to ``sg``, built by its unit tests'
    fixture over its CPU pools. The fixture's module asks for an accelerator and imports
    the test utilities (which need datasets): both are stood in for."""
    import unittest

    from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-not-found]
        EvictParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.unified_cache.components.base import (  # type: ignore[import-not-found]
        ComponentType,
    )

    test_utils = types.ModuleType("sglang.test.test_utils")
    test_utils.CustomTestCase = unittest.TestCase  # type: ignore[attr-defined]
    sys.modules.setdefault("sglang.test.test_utils", test_utils)
    from sglang.test.kits.unified_radix_cache import (  # type: ignore[import-not-found]
        fixtures,
    )
    from sglang.test.kits.unified_radix_cache.config import (  # type: ignore[import-not-found]
        CacheConfig,
    )

    fixtures.get_device = lambda: "cpu"
    sg.update(
        hicache_fixture=fixtures.build_fixture,
        hicache_config=CacheConfig,
        full=ComponentType.FULL,
        evict_params=EvictParams,
        match_params=MatchPrefixParams,
    )


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


def add_host_eviction(rng: random.Random, case: dict[str, Any]) -> None:
    """--host-tier: how many device tokens the case evicts to the host (SGLang's LRU picks
    which, whole nodes; 0 in a fifth of the cases, all of them in another fifth)."""
    total = sum(len(t) // case["page"] * case["page"] for t in case["cached"])
    some = [rng.randrange(0, total + 1) for _ in range(3)]
    case["evict"] = rng.choice([0, total, *some])


class _HostPages:
    """pdserve's host page store without the copies (the orders read only the tree)."""

    def __init__(self, num_pages: int) -> None:
        self.allocator = PageAllocator(num_pages)

    def backup(self, device_pages: list[int], host_pages: list[int]) -> None:
        pass

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        pass


def pdserve_tree(case: dict[str, Any], device_paths: list[list[int]] | None) -> RadixCache:
    """The case's cache in pdserve. With device_paths (--host-tier): a HiRadixCache that
    wrote every node through to the host, then kept on the device only those paths (SGLang's
    split after its eviction)."""
    page = case["page"]
    alloc = PageAllocator(4096)
    if device_paths is None:
        tree = RadixCache(page, alloc)
    else:
        tree = HiRadixCache(page, alloc, _HostPages(4096), "write_through")
    for tokens in case["cached"]:
        aligned = tokens[: len(tokens) // page * page]
        if not aligned:
            continue
        held = tree.match_prefix(aligned).page_ids
        pages = held + alloc.allocate(len(aligned) // page - len(held))
        present = tree.insert(aligned, pages) // page
        alloc.free(pages[len(held) : present])
    if device_paths is not None:
        for path in device_paths:
            tree.touch(path)
        kept = {tuple(p[: (i + 1) * page]) for p in device_paths for i in range(len(p) // page)}
        if tree.num_pages > len(kept):
            tree.evict(tree.num_pages - len(kept))
    return tree


def pdserve_order(
    case: dict[str, Any],
    policy: str,
    dfs_weight_dedup: bool,
    device_paths: list[list[int]] | None = None,
) -> tuple[list[str], bool]:
    """The order, and whether the in-batch dedup held a request back."""
    tree = pdserve_tree(case, device_paths)
    queue = []
    for i, (tokens, arrived) in enumerate(zip(case["queue"], case["arrivals"], strict=True)):
        r = Req(f"r{i}", i, list(tokens), max_new_tokens=16)
        r.enter_waiting_queue(float(i), arrived)
        queue.append(r)
    SchedulePolicy(policy, tree, dfs_weight_dedup=dfs_weight_dedup).calc_priority(
        queue, None, case["processed"]
    )
    return [r.rid for r in queue], any(r.is_deprioritized for r in queue)


def sglang_tree(sg: dict[str, Any], case: dict[str, Any]) -> Any:
    """The case's cache in SGLang: the simulated RadixCache, or (--host-tier) the
    UnifiedRadixCache with HiCache's tree, every node copied to the host (write-through),
    then ``case["evict"]`` device tokens evicted by its LRU."""
    import torch

    page = case["page"]
    host = "evict" in case
    if host:
        cfg = sg["hicache_config"](  # small pools: the orders read only the tree
            page_size=page,
            kv_size=2048,
            max_context_len=512,
            num_layers=1,
            full_attention_layer_ids=(0,),
            head_num=1,
            head_dim=8,
        )
        tree, alloc, _ = sg["hicache_fixture"](cfg)
        tree.tree_core.set_hicache_enabled()
    else:
        tree = sg["cache"].create_simulated(page_size=page)
    for tokens in case["cached"]:
        aligned = tokens[: len(tokens) // page * page]
        if aligned:
            key = sg["key"](token_ids=array("q", aligned), extra_key=None)
            value = alloc.alloc(len(aligned)) if host else torch.arange(len(aligned))
            tree.insert(sg["insert"](key=key, value=value))
    if host:
        core, full = tree.tree_core, sg["full"]
        for node in _sglang_nodes(tree):
            core.set_component_host_value_raw(
                node, full, core.get_component_device_value(node, full).clone()
            )
            core.update_duplicate_tracking(node)
        tree.evict(sg["evict_params"](num_tokens=case["evict"]))
    return tree


def _sglang_nodes(tree: Any) -> list[Any]:
    core, root = tree.tree_core, tree.root_node_handle()
    nodes, stack = [], [root]
    while stack:
        node = stack.pop()
        if node != root:
            nodes.append(node)
        stack.extend(core.get_child_node_ids(node))
    return nodes


def sglang_device_paths(sg: dict[str, Any], tree: Any) -> list[list[int]]:
    """The token paths of the device tier's leaves: what stayed on the device."""
    core, full = tree.tree_core, sg["full"]
    paths: list[list[int]] = []

    def walk(node: Any, prefix: list[int]) -> None:
        on_device = [
            c
            for c in core.get_child_node_ids(node)
            if core.get_component_device_value(c, full) is not None
        ]
        for c in on_device:
            walk(c, prefix + list(core.get_node_token_ids(c)))
        if not on_device and prefix:
            paths.append(prefix)

    walk(tree.root_node_handle(), [])
    return paths


def same_tiers(sg: dict[str, Any], case: dict[str, Any], sgl: Any, ours: RadixCache) -> bool:
    """Whether both trees match every cached sequence alike, device and host tokens."""
    page = case["page"]
    for tokens in case["cached"]:
        aligned = tokens[: len(tokens) // page * page]
        key = sg["key"](token_ids=array("q", aligned), extra_key=None)
        theirs = sgl.match_prefix(sg["match_params"](key=key))
        match = ours.match_prefix(aligned)
        if (theirs.device_prefix_len, theirs.host_hit_length) != (
            match.num_tokens,
            match.host_tokens,
        ):
            return False
    return True


def host_tier_cases(
    sg: dict[str, Any], cases: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[list[list[int]] | None], int, int]:
    """The cases whose device/host split pdserve reproduces, with SGLang's device paths;
    how many of them have a queued prompt that matches into the host tier; how many were
    left out."""
    kept: list[dict[str, Any]] = []
    paths: list[list[list[int]] | None] = []
    num_hit = 0
    for case in cases:
        sgl = sglang_tree(sg, case)
        device_paths = sglang_device_paths(sg, sgl)
        ours = pdserve_tree(case, device_paths)
        if not same_tiers(sg, case, sgl, ours):
            continue
        kept.append(case)
        paths.append(device_paths)
        num_hit += any(ours.match_prefix(list(t)).host_tokens for t in case["queue"])
    return kept, paths, num_hit, len(cases) - len(kept)


def sglang_order(sg: dict[str, Any], case: dict[str, Any], policy: str) -> list[str]:
    tree = sglang_tree(sg, case)
    queue = []
    for i, (tokens, arrived) in enumerate(zip(case["queue"], case["arrivals"], strict=True)):
        r = sg["req"](f"r{i}", "", array("q", tokens), sg["sampling"](max_new_tokens=16))
        r.arrival_processed_tokens = arrived
        r.time_stats.wait_queue_entry_time = float(i)
        queue.append(r)
    sg["policy"](policy, tree, "evict" in case, False, False).calc_priority(
        queue, None, case["processed"]
    )
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
    ap.add_argument(
        "--host-tier",
        action="store_true",
        help="a host tier under both caches, each case evicting some device tokens to it",
    )
    args = ap.parse_args()
    sg = load_sglang(args.sglang)
    rng = random.Random(args.seed)
    cases = [random_case(rng) for _ in range(args.cases)]
    paths: list[list[list[int]] | None] = [None] * len(cases)
    tiers = "device only"
    if args.host_tier:
        load_sglang_hicache(sg)
        for case in cases:
            add_host_eviction(rng, case)
        cases, paths, num_hit, num_skipped = host_tier_cases(sg, cases)
        tiers = (
            f"device + host tier: {num_hit} cases with a host hit in the queue, "
            f"{num_skipped} whose trees could not be made alike left out"
        )
    print(f"SGLang {sg['version']} against pdserve, {len(cases)} cases, seed {args.seed}, {tiers}")
    for policy in args.policies:
        same, shown, moved, held = 0, 0, 0, 0
        for case, device_paths in zip(cases, paths, strict=True):
            ours, dedup = pdserve_order(case, policy, args.dfs_weight_dedup == "on", device_paths)
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
            "host_tier": args.host_tier,
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
