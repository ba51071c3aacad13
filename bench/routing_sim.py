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
it routed there since the node's last report (uncached as routed), as
KVEventSubscriber.queued_tokens does. The oracle sees
every cache at once and each queue exactly (the running prefill's remaining tokens by
elapsed time, each waiting one's uncached tokens as routed). Routing time: wall time of
building the candidates, overlaps() (precise) and route(), as service.py times it
(prompts are hashed on the gateway's tokenizer threads: not timed).

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
cold-start pile-up); requests of the ramp are not counted. Prints the CPU, the fit, a
table per workload, one JSON line per row and the targets (precise >= 95% of the oracle's
hit rate; p90 TTFT >= 5x below affinity's on a and c; routing p99 < 200 us at 128 nodes).
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
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

_HERE = os.path.dirname(os.path.abspath(__file__))
# bench/transfer.py would shadow the `transfer` package: keep bench/ off the path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.append(_HERE)  # after the repo: its siblings, never over the packages

import numpy as np
from routing_workloads import (
    Cost,
    Request,
    Scale,
    Workload,
    _pages,
    chat,
    fit_cost,
    templates,
    tenants,
)

from bootstrap import router as rt
from bootstrap.kv_index import KVIndex
from common.page_hash import HashArray, prompt_hashes
from prefill_node.radix_cache import RadixCache, TreeNode

ROUTERS = ("oracle", "precise", "affinity", "round-robin", "random")
DECODES = [rt.DecodeCandidate("d0", 0)]
SMALL_RUN_WARMUP = 5.0  # warm-up misses at 1000 nodes (a short run)


class FreeList:
    """A node's page pool (the radix cache frees evicted pages into it)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages, self.free_pages = num_pages, set(range(num_pages))

    def allocate(self, num: int) -> list[int]:
        return [self.free_pages.pop() for _ in range(num)]  # KeyError: out of pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if p in self.free_pages:
                raise RuntimeError(f"page {p} freed twice")
            self.free_pages.add(p)


class EventSink:
    """The cache's CacheEvents: the net change since the last batch, as the publisher keeps it."""

    def __init__(self) -> None:
        self.net: dict[int, bool] = {}  # page hash -> stored (True) or removed (False)

    def stored(self, hashes: HashArray) -> None:
        self.net.update(dict.fromkeys(hashes.tolist(), True))

    def removed(self, hashes: HashArray) -> None:
        self.net.update(dict.fromkeys(hashes.tolist(), False))

    def cleared(self) -> None:
        raise RuntimeError("the simulation never resets a cache")

    def take(self) -> tuple[HashArray, HashArray]:
        """The batch: (stored, removed), and a fresh start."""
        net, self.net = self.net, {}
        return tuple(
            np.array([h for h, s in net.items() if s is is_stored], dtype=np.uint64)
            for is_stored in (True, False)
        )  # type: ignore[return-value]


@dataclass
class Job:
    index: int
    request: Request
    num_tokens: int
    uncached_at_route: int  # what the gateway counts as pending (and the oracle as queued)
    tokens: bytes = b""
    pages: list[int] = field(default_factory=list)
    locked: TreeNode | None = None
    cached: int = 0
    start: float = 0.0
    end: float = 0.0


class SimNode:
    def __init__(self, node_id: str, pool_pages: int, page_size: int, cost: Cost) -> None:
        self.node_id, self.page_size, self.cost = node_id, page_size, cost
        self.allocator = FreeList(pool_pages)
        self.sink = EventSink()
        self.cache = RadixCache(page_size, self.allocator, events=self.sink)
        self.waiting: deque[Job] = deque()
        self.running: Job | None = None
        self.seq = 0
        self.busy_s = 0.0
        self.num_waiting_tokens = self.num_waiting_uncached = self.max_cached_pages = 0

    def enqueue(self, job: Job) -> None:
        self.waiting.append(job)
        self.num_waiting_tokens += job.num_tokens
        self.num_waiting_uncached += job.uncached_at_route

    def start_next(self, now: float) -> float | None:
        """When idle, admit the head of the queue (match, lock, allocate); returns its end."""
        if self.running is not None or not self.waiting:
            return None
        job = self.running = self.waiting.popleft()
        self.num_waiting_tokens -= job.num_tokens
        self.num_waiting_uncached -= job.uncached_at_route
        ps, n = self.page_size, job.num_tokens
        job.tokens = np.concatenate(job.request.parts).tobytes()
        match = self.cache.match_prefix(job.tokens)
        num_cached = min(len(match.page_ids), (n - 1) // ps)  # the last token is computed
        if num_cached:
            self.cache.inc_lock_ref(match.last_node)  # before evicting: the prefix stays
            job.locked = match.last_node
        need = _pages(n, ps) - num_cached
        if need > len(self.allocator.free_pages):
            self.cache.evict(need - len(self.allocator.free_pages))
        job.pages = match.page_ids[:num_cached] + self.allocator.allocate(need)
        job.cached, job.start = num_cached * ps, now
        service = self.cost.service_s(job.cached, n - job.cached)
        job.end, self.busy_s = now + service, self.busy_s + service
        return job.end

    def finish(self) -> Job:
        """The prefill is done: cache the prompt's pages, free duplicates and the partial page."""
        job, ps = self.running, self.page_size
        assert job is not None
        self.running = None
        already = self.cache.insert(job.tokens, job.pages) // ps
        self.allocator.free(
            job.pages[job.cached // ps : already] + job.pages[job.num_tokens // ps :]
        )
        if job.locked is not None:
            self.cache.dec_lock_ref(job.locked)
        self.max_cached_pages = max(self.max_cached_pages, self.cache.num_pages)
        job.tokens, job.pages, job.locked = b"", [], None
        return job

    def reported_tokens(self, node_load: str) -> int:
        """PrefillScheduler.queued_tokens: the one under way, and the waiting prompts less
        what the cache holds now ("prompt": whole, as before that was fixed)."""
        if node_load == "prompt":
            return self.num_waiting_tokens
        ps, job = self.page_size, self.running  # the one under way: all of it left
        running = job.num_tokens - job.cached if job is not None else 0
        return running + sum(
            j.num_tokens
            - ps
            * min(
                (j.num_tokens - 1) // ps,
                len(self.cache.match_prefix(np.concatenate(j.request.parts).tobytes()).page_ids),
            )
            for j in self.waiting
        )

    def exact_tokens(self, now: float) -> int:
        """The oracle's queue: the running prefill's remaining tokens, the waiting ones'."""
        left = 0.0
        if (job := self.running) is not None and job.end > job.start:
            left = (job.num_tokens - job.cached) * (job.end - now) / (job.end - job.start)
        return int(left) + self.num_waiting_uncached


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
    since_report = dict.fromkeys(node_ids, 0)  # the subscriber's tokens sent since a report
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

    def queued_tokens(nid: str) -> int:
        if not uses_index:  # the service passes none: only precise routing reads them
            return 0
        state = index.node(nid)  # KVEventSubscriber.queued_tokens
        return (state.queued_tokens if state else 0) + since_report[nid]

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
            cands = [
                rt.PrefillCandidate(nid, pending_n[nid], nodes[nid].exact_tokens(req.arrival))
                for nid in node_ids
            ]
            key = rt.affinity_key(ids, None, rt.DEFAULT_AFFINITY_TOKENS, page_size)
            choice = rt.choose_prefill_by_cache(
                exact, cands, len(ids), page_size, ring, key
            ) or rt.choose_prefill(ring, key, cands, rt.DEFAULT_EPSILON)
            chosen, cached_pages = choice.node_id, exact.get(choice.node_id, 0)
        else:
            overlaps = index.overlaps(hashes, node_ids) if router_name == "precise" else None
            queued = {nid: queued_tokens(nid) for nid in node_ids}  # queued_tokens_of
            cands = rt.prefill_candidates(node_ids, pending_n.__getitem__, queued)
            decision = router.route(ids, None, cands, DECODES, None, overlaps)
            chosen, cached_pages = decision.prefill_id, decision.cached_pages
        res.route_s.append(time.perf_counter() - started)
        uncached = max(1, len(ids) - cached_pages * page_size)  # as service.py dispatches
        pending_n[chosen] += 1
        since_report[chosen] += uncached
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
            since_report[nid] = 0
        else:
            index.report_load(*payload)
            since_report[payload[0]] = 0
    res.index_mb = index.memory_bytes() / 2**20 if router_name == "precise" else 0.0
    res.busy_s = sum(nd.busy_s for nd in nodes.values())
    res.nodes = list(nodes.values())
    return res


def _pct(values: Sequence[float], q: float, scale: float = 1.0, digits: int = 4) -> float:
    return round(float(np.percentile(values, q)) * scale, digits) if values else float("nan")


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
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "route_us_p99": _pct(r.route_s, 99, 1e6, 1),
        "route_us_p50": _pct(r.route_s, 50, 1e6, 1),
        "index_mb": round(r.index_mb, 3),
        "load": round(r.busy_s / num_nodes / span, 3),
        "requests": len(counted),
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        f"{'nodes':>5} {'router':11} {'hit':>6} {'%orc':>5} {'computed':>11} {'p50 s':>8} "
        f"{'p90 s':>8} {'p99 s':>8} {'aff/p90':>8} {'route us p50/p99':>16} {'idx MB':>7} "
        f"{'load':>5}"
    )
    for r in rows:
        peers = {x["router"]: x for x in rows if x["nodes"] == r["nodes"]}
        orc, aff = peers.get("oracle"), peers.get("affinity")
        vs_orc = f"{r['hit_rate'] / orc['hit_rate']:5.0%}" if orc else "    -"
        vs_aff = f"{aff['ttft_p90_s'] / r['ttft_p90_s']:8.2f}" if aff else "       -"
        print(
            f"{r['nodes']:5d} {r['router']:11} {r['hit_rate']:6.1%} {vs_orc} "
            f"{r['computed_tokens']:11d} {r['ttft_p50_s']:8.2f} {r['ttft_p90_s']:8.2f} "
            f"{r['ttft_p99_s']:8.2f} {vs_aff} {r['route_us_p50']:8.0f}/{r['route_us_p99']:<7.0f} "
            f"{r['index_mb']:7.2f} {r['load']:5.2f}"
        )


def verdict(rows: list[dict[str, Any]]) -> None:
    by = {(r["workload"], r["nodes"], r["router"]): r for r in rows}
    checks: list[tuple[bool, str]] = []
    for (wl, n, router), p in sorted(by.items()):
        if router != "precise":
            continue
        if (o := by.get((wl, n, "oracle"))) is not None:
            share = p["hit_rate"] / o["hit_rate"]
            text = (
                f"hit rate {wl}@{n}: precise {p['hit_rate']:.1%} is {share:.1%} of the "
                f"oracle's {o['hit_rate']:.1%} (>= 95%)"
            )
            checks.append((share >= 0.95, text))
        if (a := by.get((wl, n, "affinity"))) is not None and wl in ("a", "c"):
            x = a["ttft_p90_s"] / p["ttft_p90_s"]
            text = (
                f"p90 TTFT {wl}@{n}: affinity {a['ttft_p90_s']:.2f} s / precise "
                f"{p['ttft_p90_s']:.2f} s = {x:.2f}x (>= 5x)"
            )
            checks.append((x >= 5, text))
        if n == 128:
            text = f"routing p99 {wl}@128: precise {p['route_us_p99']:.0f} us (< 200 us)"
            checks.append((p["route_us_p99"] < 200, text))
    print(f"targets: {sum(ok for ok, _ in checks)} of {len(checks)} met")
    for ok, text in checks:
        print(f"  {'MET ' if ok else 'MISS'} {text}")


def build_workloads(
    args: argparse.Namespace, cost: Cost, nodes: int
) -> list[Callable[[], Workload]]:
    sc = Scale(
        nodes, cost, args.load, args.page_size, args.seed, args.warmup_misses, args.pool_pages
    )
    measured, num_tenants = args.requests_per_node * nodes, max(2, round(150 * nodes / 128))
    if nodes >= 1000:  # small pools: 4 short contexts fit
        small = Scale(
            nodes,
            cost,
            args.load,
            args.page_size,
            args.seed,
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="8 and 32 nodes, short runs, one repeat per fitted point",
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
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
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
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.nodes = [n for n in args.nodes if n <= 32] or [8]
        args.requests_per_node, args.conversations_per_node = 25, 5
    wall = time.perf_counter()
    print(f"cpu: {runpy.run_path(os.path.join(_HERE, 'cpu_info.py'))['describe_cpu']()}")
    cost = (
        args.cost
        if args.cost is not None and not args.fit
        else fit_cost(repeats=1 if args.quick else 3)
    )
    print(f"cost model: {cost.describe()}")
    rows: dict[str, list[dict[str, Any]]] = {}
    for nodes in args.nodes:
        for make in build_workloads(args, cost, nodes):
            w = make()
            print(
                f"[{w.name}@{nodes}] {w.note}; {len(w.requests)} requests; pool {w.pool_pages}"
                f" pages; {w.rate:.1f}/s after a {w.warmup_s:.0f} s ramp",
                flush=True,
            )
            for router_name in args.routers:
                started = time.perf_counter()
                r = simulate(
                    w,
                    nodes,
                    router_name,
                    cost,
                    page_size=args.page_size,
                    event_delay_s=args.event_delay_ms / 1e3,
                    node_load=args.node_load,
                    seed=args.seed,
                )
                row = summarize(w, nodes, router_name, r)
                row["wall_s"] = round(time.perf_counter() - started, 1)
                rows.setdefault(w.name, []).append(row)
                print(
                    f"  {router_name:11} hit {row['hit_rate']:.1%} p90 {row['ttft_p90_s']:.2f} s"
                    f" ({row['wall_s']} s)",
                    flush=True,
                )
    for name, table in rows.items():
        print(
            f"\nworkload {name}: ramp not counted; event delay {args.event_delay_ms} ms; node "
            f"load {args.node_load}; %orc = hit rate / "
            f"oracle's, aff/p90 = affinity's p90 TTFT / this row's"
        )
        print_table(table)
    print()
    for table in rows.values():
        for row in table:
            print(json.dumps(row))
    verdict([r for t in rows.values() for r in t])
    print(f"total {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
