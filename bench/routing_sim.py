"""Prefix-cache routing over many prefill nodes, simulated: the real cache, KV index and router.

Real: each node's RadixCache (matching, locks, LRU eviction, insert's duplicate pages)
over a --pool-pages free list; the chained page hashes its events carry; the gateway's
KVIndex, fed only by those events; Router.route for precise, affinity, round-robin and
random; choose_prefill_by_cache (else choose_prefill) for the oracle. Simulated: time;
a node serves one request at a time, FIFO, matched, locked and given pages (evicting)
when it starts, as the scheduler admits it, inserted and unlocked when it ends (its KV
leaves for decode, not modelled); TTFT = queueing + service (the cost model). A request
ending ends a node step: its insert goes as one batch (seq from 1) with the node's queued
tokens, and a request starting sends its admission's evictions at once (as the
prefill loop flushes before the model runs), each applied to the KVIndex
--event-delay-ms later (no changes: the load alone). Queued tokens are what
PrefillScheduler.queued_tokens says after a step: the waiting prompts less the prefix
cached now (--node-load prompt: whole, as before that was fixed); the gateway adds what
it routed there since the node's last report (uncached as routed), and counts each
prompt it routed as held on its node until the node's events store it (KVIndex.expect;
the node's report counts a request waiting behind the one that stores its prefix as
computing it all: the index takes that off), as KVEventSubscriber does. The oracle sees
every cache at once and each queue exactly (the running prefill's remaining tokens by
elapsed time, each waiting one's uncached tokens as routed). Routing time: wall time of
building the candidates, overlaps() (precise) and route(), as service.py times it
(prompts are hashed on the gateway's tokenizer threads: not timed), with the gateway's
garbage-collection policy (common/gc_policy.py; --gc-gen0-threshold 0: Python's own);
each row gives its p50, p99, p99.9 and maximum.

Cost (--fit, default): the built-in model's extend on one thread, float32, for 64..2048
new tokens and for 64 and 128 after 2048 and 3968 cached ones (median of 3); least
squares of t = a + b*n (uncached points) and t = a + b*n + c*n*(prefix + n/2) (all),
the attention term kept when it is >= 5% of a point (a hit on a long context pays it).

Workloads (seeded; token ids uniform in [100, 49000); pool = 4 "units" a node):
  a  llm-d's shape: 150 tenants per 128 nodes, Zipf(1.1), a --context-tokens context
     each; a request = context + a 50-100 token question; unit = context + 100.
  b  chat: 3-8 turns, a unique 200-800 token opening, then previous prompt + a 30-70
     token answer + a 30-70 token message, Exp(--think-s) apart; unit = 1780 tokens.
  c  --templates templates behind one 32-token header (one affinity key), bodies of
     1000-2000 tokens, uniform, + a 50-100 token question; unit = mean template + 100.
  At 1000 nodes: a only, --small-pool pages, 4 contexts of 156 tokens.
Poisson arrivals at --load x what the cluster could serve if every shared prefix hit,
ramping up from 0 over --warmup-misses misses of the unit (caches fill without a
cold-start pile-up); requests of the ramp are not counted.

The sweep: one routing decision can tip a loaded cluster into recomputing (a tiny change
of the cost model used to), so every node count runs a neighbourhood of the cost model:
the fitted one times each of --scales, and moved by each of --perturbations (relative,
each term times 1 + r*u_i, u a random unit vector) in --directions directions, for each
of --seeds (which seed the workload too); from 128 nodes --seeds-large and
--directions-large (their runs are long). Prints the CPU, the fit, a line per run, the
worst run per node count (precise's hit rate / the oracle's; precise's - affinity's;
affinity's p90 TTFT / precise's), a table across the cost-model scales, one JSON line per
row and per worst case, and the targets on the worst cases (precise >= 95% of the
oracle's hit rate and >= affinity's; p90 TTFT >= 5x below affinity's on a and c; routing
p99 over every precise decision < 200 us at 128 nodes). The default grid takes about 20
minutes on one core; --quick (8 and 32 nodes, short runs and ramp, seed 0, the scales
and one 1% move) well under one.
Usage: python bench/routing_sim.py [--quick] [--cost 150,1300,1290] [--nodes 8 32 128 1000]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import runpy
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

_HERE = os.path.dirname(os.path.abspath(__file__))
# bench/transfer.py would shadow the `transfer` package: keep bench/ off the path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.append(_HERE)  # after the repo: its siblings, never over the packages

import numpy as np
from routing_nodes import Job, SimNode
from routing_report import Run, pct, print_scales, print_worst, verdict, worst_cases
from routing_workloads import (
    Cost,
    Request,
    Scale,
    Workload,
    _pages,
    chat,
    cost_neighbourhood,
    fit_cost,
    templates,
    tenants,
)

from bootstrap import router as rt
from bootstrap.kv_index import KVIndex
from common import gc_policy
from common.page_hash import prompt_hashes

ROUTERS = ("oracle", "precise", "affinity", "round-robin", "random")
DECODES = [rt.DecodeCandidate("d0", 0)]
SMALL_RUN_WARMUP = 5.0  # warm-up misses at 1000 nodes (a short run)
LARGE = 128  # from this many nodes the sweep runs --seeds-large (its runs are long)


@dataclass
class SimResult:
    ttft: list[float]
    cached: list[int]
    prompt: list[int]
    routed: list[str]  # the prefill node of each request
    route_s: list[float] = field(default_factory=list)
    index_mb: float = 0.0
    busy_s: float = 0.0
    nodes: list[SimNode] = field(default_factory=list)


def simulate(
    w: Workload,
    num_nodes: int,
    router_name: str,
    cost: Cost,
    *,
    page_size: int = 16,
    event_delay_s: float = 0.02,
    node_load: str = "uncached",
    seed: int = 0,
    verify_index: bool = False,
) -> SimResult:
    """Route and serve every request of `w`. verify_index: check that each batch leaves the
    index holding exactly the pages the node's cache held when it sent the batch."""
    node_ids = [f"p{i}" for i in range(num_nodes)]
    nodes = {nid: SimNode(nid, w.pool_pages, page_size, cost) for nid in node_ids}
    longest = max(sum(len(p) for p in r.parts) for r in w.requests)
    if _pages(longest, page_size) > w.pool_pages:
        raise ValueError(f"a {longest}-token prompt does not fit a {w.pool_pages}-page pool")
    index, uses_index = KVIndex(), router_name == "precise" or verify_index
    router = rt.Router(
        mode="precise" if router_name == "oracle" else router_name, seed=seed, page_size=page_size
    )
    ring = rt.HashRing(sorted(node_ids), rt.DEFAULT_VIRTUAL_NODES)  # the Router's own ring
    pending_n = dict.fromkeys(node_ids, 0)
    heap: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    n_req = len(w.requests)
    res = SimResult([0.0] * n_req, [0] * n_req, [0] * n_req, [""] * n_req)

    def push(t: float, kind: str, payload: Any) -> None:
        heapq.heappush(heap, (t, next(order), kind, payload))  # FIFO among equal times

    def publish(node: SimNode, now: float) -> None:
        if not uses_index:
            node.sink.net.clear()
            return
        queued = node.reported_tokens(node_load)
        if node.sink.net:
            node.seq += 1
            held = set(node.cache.page_hashes().tolist()) if verify_index else None
            push(
                now + event_delay_s,
                "batch",
                (node.node_id, node.seq, *node.sink.take(), queued, held),
            )
        else:
            push(now + event_delay_s, "load", (node.node_id, queued))

    def route(i: int, req: Request) -> None:
        arr = np.concatenate(req.parts)
        ids = arr.tolist()
        hashes = (
            prompt_hashes(cast("Sequence[int]", arr), page_size).tolist()  # numpy: faster
            if router_name == "precise"
            else []
        )
        tokens = arr.tobytes() if router_name == "oracle" else b""
        started = time.perf_counter()
        if router_name == "oracle":
            exact = {
                nid: k
                for nid, nd in nodes.items()
                if (k := len(nd.cache.match_prefix(tokens).page_ids))
            }
            cands = rt.PrefillLoads(
                node_ids,
                pending_n,
                {nid: nodes[nid].exact_tokens(req.arrival) for nid in node_ids},
            )
            key = rt.affinity_key(ids, None, rt.DEFAULT_AFFINITY_TOKENS, page_size)
            choice = rt.choose_prefill_by_cache(
                exact, cands, len(ids), page_size, ring, key
            ) or rt.choose_prefill(ring, key, cands, rt.DEFAULT_EPSILON)
            chosen, cached_pages = choice.node_id, exact.get(choice.node_id, 0)
        else:
            overlaps = index.overlaps(hashes, node_ids) if router_name == "precise" else None
            # KVEventSubscriber.queued_tokens (a copy); the service passes none else
            queued = dict(index.loads) if router_name == "precise" else {}
            cands = rt.PrefillLoads(node_ids, pending_n, queued)
            decision = router.route(ids, None, cands, DECODES, None, overlaps)
            chosen, cached_pages = decision.prefill_id, decision.cached_pages
        res.route_s.append(time.perf_counter() - started)
        uncached = max(1, len(ids) - cached_pages * page_size)  # as service.py dispatches
        pending_n[chosen] += 1
        index.sent(chosen, uncached)  # KVEventSubscriber.note_dispatched, as are the pages:
        if router_name == "precise":
            index.expect(chosen, hashes, page_size)
        res.routed[i] = chosen
        nodes[chosen].enqueue(Job(i, req, len(ids), uncached))
        if (end := nodes[chosen].start_next(req.arrival)) is not None:
            publish(nodes[chosen], req.arrival)  # admission's evictions, before the step
            push(end, "done", chosen)

    i = 0
    while i < n_req or heap:
        if i < n_req and (not heap or w.requests[i].arrival < heap[0][0]):
            route(i, w.requests[i])
            i += 1
            continue
        now, _, kind, payload = heapq.heappop(heap)
        if kind == "done":
            node = nodes[payload]
            job = node.finish()
            res.ttft[job.index] = now - job.request.arrival
            res.cached[job.index], res.prompt[job.index] = job.cached, job.num_tokens
            pending_n[node.node_id] -= 1
            publish(node, now)  # a step ends: its evictions, its insert, the queue
            if (end := node.start_next(now)) is not None:
                publish(node, now)  # admission's evictions go out before the step runs
                push(end, "done", node.node_id)
        elif kind == "batch":
            nid, seq, stored, removed, queued, held = payload
            state = index.apply(
                nid,
                "sim",
                seq,
                stored=stored,
                removed=removed,
                is_snapshot=False,
                queued_tokens=queued,
                max_pages=w.pool_pages,
            )
            assert held is None or state.hashes == held, f"{nid}: the index is not its cache"
        else:
            index.report_load(*payload)
    res.index_mb = index.memory_bytes() / 2**20 if router_name == "precise" else 0.0
    res.busy_s = sum(nd.busy_s for nd in nodes.values())
    res.nodes = list(nodes.values())
    return res


def summarize(w: Workload, num_nodes: int, router_name: str, r: SimResult) -> dict[str, Any]:
    counted = [i for i, q in enumerate(w.requests) if q.arrival >= w.warmup_s]
    cached, prompt = sum(r.cached[i] for i in counted), sum(r.prompt[i] for i in counted)
    ttft = [r.ttft[i] for i in counted]
    span = w.requests[-1].arrival - w.requests[0].arrival
    return {
        "bench": "routing_sim",
        "workload": w.name,
        "nodes": num_nodes,
        "router": router_name,
        "hit_rate": round(cached / prompt, 4),
        "computed_tokens": prompt - cached,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p90_s": pct(ttft, 90),
        "ttft_p99_s": pct(ttft, 99),
        "route_us_p99": pct(r.route_s, 99, 1e6, 1),
        "route_us_p50": pct(r.route_s, 50, 1e6, 1),
        "route_us_p999": pct(r.route_s, 99.9, 1e6, 1),
        "route_us_max": pct(r.route_s, 100, 1e6, 1),
        "index_mb": round(r.index_mb, 3),
        "load": round(float(r.busy_s / num_nodes / span), 3),
        "requests": len(counted),
    }


def build_workloads(
    args: argparse.Namespace, cost: Cost, nodes: int, seed: int
) -> list[Callable[[], Workload]]:
    sc = Scale(nodes, cost, args.load, args.page_size, seed, args.warmup_misses, args.pool_pages)
    measured, num_tenants = args.requests_per_node * nodes, max(2, round(150 * nodes / 128))
    if nodes >= 1000:  # small pools: 4 short contexts fit
        small = Scale(
            nodes,
            cost,
            args.load,
            args.page_size,
            seed,
            min(args.warmup_misses, SMALL_RUN_WARMUP),
            args.small_pool,
        )
        ctx = args.small_pool * args.page_size // 4 - 100
        return [
            lambda: tenants(
                small, measured=args.requests_1000, context=ctx, num_tenants=num_tenants
            )
        ]
    make = {
        "a": lambda: tenants(
            sc, measured=measured, context=args.context_tokens, num_tenants=num_tenants
        ),
        "b": lambda: chat(
            sc, measured_conversations=args.conversations_per_node * nodes, think_s=args.think_s
        ),
        "c": lambda: templates(sc, measured=measured, num_templates=args.templates),
    }
    return [make[k] for k in args.workloads]


def sweep(
    args: argparse.Namespace, center: Cost, log: Callable[[str], None] = print
) -> tuple[list[Run], dict[int, list[float]]]:
    """Every router over every workload, node count and cost model of the neighbourhood;
    returns the runs and, per node count, every precise routing time."""
    runs: list[Run] = []
    route_s: dict[int, list[float]] = {}
    for nodes in args.nodes:
        seeds, directions = (
            (args.seeds, args.directions)
            if nodes < LARGE
            else (args.seeds_large, args.directions_large)
        )
        cases = cost_neighbourhood(center, seeds, args.scales, args.perturbations, directions)
        for case in cases:
            for make in build_workloads(args, case.cost, nodes, case.seed):
                started, w, rows = time.perf_counter(), make(), {}
                for router_name in args.routers:
                    r = simulate(
                        w,
                        nodes,
                        router_name,
                        case.cost,
                        page_size=args.page_size,
                        event_delay_s=args.event_delay_ms / 1e3,
                        node_load=args.node_load,
                        seed=case.seed,
                    )
                    row = rows[router_name] = summarize(w, nodes, router_name, r)
                    row.update(
                        seed=case.seed,
                        scale=case.scale,
                        perturbation=case.perturbation,
                        cost=case.cost.short(),
                    )
                    if router_name == "precise":
                        route_s.setdefault(nodes, []).extend(r.route_s)
                run = Run(nodes, w.name, case, rows)
                runs.append(run)
                hits = " ".join(f"{k} {v['hit_rate']:.1%}" for k, v in rows.items())
                share = run.share()
                log(
                    f"[{w.name}@{nodes} {case.label}] {len(w.requests)} requests, "
                    f"{w.rate:.1f}/s: {hits}"
                    + (f" (share {share:.1%})" if share is not None else "")
                    + f" ({time.perf_counter() - started:.0f} s)"
                )
    return runs, route_s


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="8 and 32 nodes, short runs and ramp, seed 0, scales and one 1%% move, one "
        "repeat per fitted point",
    )
    ap.add_argument("--fit", action="store_true", help="fit the cost model (the default)")
    ap.add_argument(
        "--cost",
        type=Cost.parse,
        default=None,
        help="overhead_ms,us_per_token[,ns_per_token_ctx] instead of --fit",
    )
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128, 1000])
    ap.add_argument("--workloads", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    ap.add_argument(
        "--routers", nargs="+", default=["oracle", "precise", "affinity"], choices=ROUTERS
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="below 128 nodes")
    ap.add_argument("--seeds-large", type=int, nargs="+", default=[0], help="128+ nodes")
    ap.add_argument("--scales", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    ap.add_argument(
        "--perturbations",
        type=float,
        nargs="*",
        default=[1e-4, 1e-3, 1e-2, 1e-1],
        help="relative, each in --directions random directions per seed",
    )
    ap.add_argument("--directions", type=int, default=2, help="below 128 nodes")
    ap.add_argument("--directions-large", type=int, default=1, help="128+ nodes")
    ap.add_argument("--requests-per-node", type=int, default=80, help="counted, a and c")
    ap.add_argument("--conversations-per-node", type=int, default=12, help="counted, b")
    ap.add_argument("--requests-1000", type=int, default=3000, help="counted, 1000 nodes")
    ap.add_argument("--context-tokens", type=int, default=6000)
    ap.add_argument("--templates", type=int, default=8)
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument(
        "--load",
        type=float,
        default=0.5,
        help="share of the capacity if every shared prefix were cached",
    )
    ap.add_argument(
        "--warmup-misses",
        type=float,
        default=20.0,
        help="the ramp (not counted), in misses of the workload's unit",
    )
    ap.add_argument("--pool-pages", type=int, default=None, help="default: 4 units")
    ap.add_argument("--small-pool", type=int, default=64, help="pages a node at 1000 nodes")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--event-delay-ms", type=float, default=20.0)
    ap.add_argument("--node-load", choices=["prompt", "uncached"], default="uncached")
    ap.add_argument(
        "--gc-gen0-threshold",
        type=int,
        default=gc_policy.GEN0_THRESHOLD,
        help="as the gateway's flag (0: Python's own collection policy)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes = [n for n in args.nodes if n <= 32] or [8]
        args.requests_per_node, args.conversations_per_node = 25, 5
        args.warmup_misses = min(args.warmup_misses, 5.0)
        args.seeds, args.directions, args.perturbations = [0], 1, [1e-2]
    return args


def main() -> None:
    args = parse_args()
    wall = time.perf_counter()
    print(f"cpu: {runpy.run_path(os.path.join(_HERE, 'cpu_info.py'))['describe_cpu']()}")
    cost = (
        args.cost
        if args.cost is not None and not args.fit
        else fit_cost(repeats=1 if args.quick else 3)
    )
    print(f"cost model: {cost.describe()} (--cost {cost.short()})")
    print(
        f"sweep: scales {args.scales}; perturbations {args.perturbations} in "
        f"{args.directions} random directions, seeds {args.seeds} below {LARGE} nodes "
        f"({args.directions_large}, {args.seeds_large} from {LARGE}); event delay "
        f"{args.event_delay_ms} ms; node load {args.node_load}; ramp not counted",
        flush=True,
    )
    gc_policy.settle(args.gc_gen0_threshold)  # as the gateway's start-up (bootstrap/__main__)
    runs, route_s = sweep(args, cost, lambda line: print(line, flush=True))
    worst = worst_cases(runs, route_s)
    print_worst(worst)
    print_scales(runs)
    print()
    for run in runs:
        for row in run.rows.values():
            print(json.dumps(row))
    for w in worst:
        print(json.dumps(w))
    verdict(worst)
    print(f"total {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
