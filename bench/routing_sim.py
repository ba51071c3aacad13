"""Prefix-cache routing over many prefill nodes: the real cache, index and router on a simulated clock.

Real: each prefill node's RadixCache (prefill_node/radix_cache.py: LRU eviction of unlocked
leaves, locks, insert's duplicate pages) over a pool of --pool-pages pages; the chained page
hashes its events carry (common/page_hash.py); the gateway's KVIndex (bootstrap/kv_index.py)
built only from those events; bootstrap/router.py's Router.route for precise, affinity,
round-robin and random, and its choose_prefill_by_cache for the oracle.
Simulated: time (a discrete-event clock); a node's prefill: one request at a time, FIFO,
matched, allocated (evicting) and locked when it starts, as the real scheduler does at
admission, inserted into the cache and unlocked when it ends (the KV then leaves for decode;
decode is not modelled), TTFT = queueing + service; service = the cost model below; the
event path: a node's net cache changes of one step (a start or an end) go out as one batch
(seq from 1, with the node's queued tokens) that KVIndex.apply gets --event-delay-ms later;
a step without changes sends only its load (a keepalive). The node reports queued tokens as
PrefillScheduler.queued_tokens does (a waiting prompt counts whole, the running one less its
cached part; --node-load uncached counts waiting prompts less their cached prefix); the
gateway takes the max of that and its own routed-but-unfinished tokens (service.py).
The oracle matches the prompt on every node's cache (no delay) and knows each queue exactly
(the running request's remaining tokens, each waiting one's uncached tokens when routed).

Cost model (--fit, the default): the built-in model's extend timed on one thread for prompts
of 64..2048 tokens and two short extends after 2048 and 3968 cached tokens (median of 3),
least-squares fit of t = a + b*n (printed) and of t = a + b*n + c*n*(prefix + n/2), whose
attention term is kept when it explains >= 5% of a point's time (a hit on a long context
pays it). --cost a_ms,b_us[,c_ns] skips the fit.

Workloads (seeded; token ids uniform in [100, 49000); Poisson arrivals at --load of the
cluster's capacity if every request found its shared prefix cached; pool = 4 "units"):
  a  llm-d's shape: 150 tenants per 128 nodes, Zipf(1.1) popularity, each a --context-tokens
     context; a request = its tenant's context + a 50-100 token question; unit = context+100.
  b  multi-turn chat: conversations of 3-8 turns, a unique 200-800 token opening, then each
     turn = the previous prompt + a 30-70 token answer + a 30-70 token message, turns spaced
     by Exp(--think-s) (open loop); unit = the longest conversation.
  c  --templates templates sharing one 32-token header, bodies of 1000-2000 tokens, uniform
     popularity, + a 50-100 token question (affinity's 32-token key is the same for all);
     unit = mean template + 100.
  1000 nodes: workload a only, pool 64 pages, context 156 tokens (4 fit), a short run.
Statistics skip the first --warmup-frac of requests (by arrival) and count the rest.
Prints the CPU, the cost model, a table per workload and one JSON line per row, then the
targets: precise >= 95% of the oracle's hit rate everywhere; precise p90 TTFT >= 5x lower
than affinity's on a and c; precise routing p99 < 200 us at 128 nodes.
Usage: python bench/routing_sim.py [--quick] [--cost 20,670,0.16] [--nodes 8 32 128 1000]
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import json
import os
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

_HERE = os.path.dirname(os.path.abspath(__file__))
# bench/transfer.py would shadow the `transfer` package: keep bench/ off the path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np
import numpy.typing as npt

from bootstrap.kv_index import KVIndex
from bootstrap.router import (
    DEFAULT_AFFINITY_TOKENS,
    DEFAULT_EPSILON,
    DEFAULT_VIRTUAL_NODES,
    DecodeCandidate,
    HashRing,
    PrefillCandidate,
    Router,
    affinity_key,
    choose_prefill,
    choose_prefill_by_cache,
)
from common.page_hash import HashArray, prompt_hashes
from prefill_node.radix_cache import RadixCache, TreeNode

ROUTERS = ("oracle", "precise", "affinity", "round-robin", "random")
VOCAB_LO, VOCAB_HI = 100, 49000
DECODES = [DecodeCandidate("d0", 0)]
RAMP_FROM = 0.1  # the warm-up's arrival rate starts at this share of the full rate
Tokens = npt.NDArray[np.int32]


def _pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


# ---- the cost model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Cost:
    overhead_s: float
    s_per_token: float
    s_per_token_ctx: float = 0.0  # attention: per new token per token it attends to

    def service_s(self, prefix: int, computed: int) -> float:
        return (self.overhead_s + computed * self.s_per_token
                + self.s_per_token_ctx * computed * (prefix + computed / 2))

    def describe(self) -> str:
        return (f"t = {self.overhead_s * 1e3:.2f} ms + {self.s_per_token * 1e6:.1f} us/token"
                f" + {self.s_per_token_ctx * 1e9:.3f} ns * n * (prefix + n/2)")


def parse_cost(text: str) -> Cost:
    v = [float(x) for x in text.split(",")]
    return Cost(v[0] / 1e3, v[1] / 1e6, (v[2] if len(v) > 2 else 0.0) / 1e9)


def fit_cost(repeats: int = 3) -> Cost:
    """Time the built-in model's extend on one thread and fit the cost model (printed)."""
    import random

    import torch

    from common.model.runner import ExtendRequest, ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner.from_path(None, progress=False, dtype="float32",
                                   max_total_tokens=4096 + 64)
    runner.warmup()
    rng = random.Random(0)
    points = [(0, 64), (0, 256), (0, 1024), (0, 2048), (2048, 64), (3968, 128)]
    times = []
    for prefix, n in points:
        ids = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(prefix + n)]
        pages = runner.pool.allocator.allocate(_pages(prefix + n, runner.page_size))
        if prefix:
            runner.extend([ExtendRequest(ids[:prefix], 0, pages)])
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            runner.extend([ExtendRequest(ids[prefix:], prefix, pages)]).logits.argmax(-1).tolist()
            samples.append(time.perf_counter() - start)
        runner.pool.allocator.free(pages)
        times.append(statistics.median(samples))
    t = np.array(times)
    lin_rows = [i for i, (p, _) in enumerate(points) if p == 0]
    a, b = np.linalg.lstsq(np.array([[1.0, points[i][1]] for i in lin_rows]), t[lin_rows],
                           rcond=None)[0]
    full = np.array([[1.0, n, n * (p + n / 2)] for p, n in points])
    c0, c1, c2 = np.linalg.lstsq(full, t, rcond=None)[0]
    linear = Cost(max(float(a), 0.0), max(float(b), 1e-9))
    quad = Cost(max(float(c0), 0.0), max(float(c1), 1e-9), max(float(c2), 0.0))
    share = max(quad.s_per_token_ctx * n * (p + n / 2) / tm for (p, n), tm in zip(points, times))
    chosen = quad if share >= 0.05 else Cost(linear.overhead_s, linear.s_per_token)
    print(f"cost fit (built-in model, float32, 1 thread; median of {repeats}):")
    print(f"  {'prefix':>6} {'new':>5} {'ms':>9} {'linear ms':>10} {'resid':>7} "
          f"{'+attn ms':>9} {'resid':>7}")
    for (p, n), tm in zip(points, times):
        lin, qd = linear.service_s(0, n), quad.service_s(p, n)
        print(f"  {p:6d} {n:5d} {tm * 1e3:9.1f} {lin * 1e3:10.1f} {(tm - lin) / tm:+7.1%} "
              f"{qd * 1e3:9.1f} {(tm - qd) / tm:+7.1%}")
    print(f"  linear (prefix 0 points): {linear.describe()}")
    print(f"  with attention (all points): {quad.describe()}; its attention term is up to "
          f"{share:.0%} of a point -> using {'it' if chosen is quad else 'the linear fit'}")
    return chosen


# ---- workloads ---------------------------------------------------------------------------------


class Request(NamedTuple):
    arrival: float
    parts: tuple[Tokens, ...]  # the prompt is their concatenation (shared arrays, no copies)


@dataclass
class Workload:
    name: str
    requests: list[Request]
    pool_pages: int
    rate: float  # requests per second at full rate
    warmup_s: float  # requests arriving before are not counted
    note: str


@dataclass(frozen=True)
class Scale:
    nodes: int
    cost: Cost
    load: float = 0.7
    page_size: int = 16
    seed: int = 0
    warmup_misses: float = 5.0  # the warm-up lasts this many misses of the workload's unit
    pool_pages: int | None = None  # None: 4 units

    def ideal_s(self, n: int, shared: int) -> float:
        """Service time when the request's shared prefix is cached (whole pages; the last
        token is computed)."""
        ps = self.page_size
        cached = min(shared // ps, (n - 1) // ps) * ps
        return self.cost.service_s(cached, n - cached)

    def pool(self, unit_tokens: int) -> int:
        return self.pool_pages or 4 * _pages(unit_tokens, self.page_size)

    def warmup_s(self, unit_tokens: int) -> float:
        return self.warmup_misses * self.cost.service_s(0, unit_tokens)


def _tokens(rng: np.random.Generator, n: int) -> Tokens:
    return rng.integers(VOCAB_LO, VOCAB_HI, n, dtype=np.int32)


def _arrivals(rng: np.random.Generator, rate: float, warmup_s: float,
              measured: int) -> list[float]:
    """Poisson arrivals whose rate ramps linearly from RAMP_FROM * rate to rate over
    warmup_s (so caches fill without a cold-start pile-up), then ~measured more at rate."""
    warm = rate * warmup_s * (1 + RAMP_FROM) / 2  # expected arrivals during the ramp
    u = np.cumsum(rng.exponential(1.0, int(warm) + measured))
    if warmup_s <= 0:
        return (u / rate).tolist()
    a, b = rate * (1 - RAMP_FROM) / (2 * warmup_s), rate * RAMP_FROM  # ramp: a t^2 + b t = u
    ramp = (np.sqrt(b * b + 4 * a * u) - b) / (2 * a)
    return np.where(u < warm, ramp, warmup_s + (u - warm) / rate).tolist()


def tenants(s: Scale, *, measured: int, context: int, num_tenants: int) -> Workload:
    rng = np.random.default_rng(s.seed)
    contexts = [_tokens(rng, context) for _ in range(num_tenants)]
    ideal = statistics.fmean(s.ideal_s(context + q, context) for q in range(50, 101))
    rate, warmup_s = s.load * s.nodes / ideal, s.warmup_s(context + 100)
    arrivals = _arrivals(rng, rate, warmup_s, measured)
    weight = 1.0 / np.arange(1, num_tenants + 1) ** 1.1
    who = rng.choice(num_tenants, size=len(arrivals), p=weight / weight.sum())
    reqs = [Request(t, (contexts[k], _tokens(rng, int(rng.integers(50, 101)))))
            for t, k in zip(arrivals, who)]
    return Workload("a", reqs, s.pool(context + 100), rate, warmup_s,
                    f"{num_tenants} tenants x {context}-token context, Zipf 1.1")


def _conversation(rng: np.random.Generator) -> list[int]:
    """Prompt lengths of a conversation's turns: an opening, then + answer + message each."""
    adds = [int(rng.integers(200, 801))] + [int(rng.integers(30, 71) + rng.integers(30, 71))
                                            for _ in range(int(rng.integers(2, 8)))]
    return np.cumsum(adds).tolist()  # type: ignore[no-any-return]


def chat(s: Scale, *, measured_conversations: int, think_s: float) -> Workload:
    rng = np.random.default_rng(s.seed)
    pilot = [_conversation(np.random.default_rng(s.seed + 1)) for _ in range(2000)]
    work = statistics.fmean(sum(s.ideal_s(n, prev) for n, prev in zip(c, [0] + c[:-1]))
                            for c in pilot)
    rate = s.load * s.nodes / work  # conversations started per second
    longest = 800 + 7 * 140
    warmup_s = s.warmup_s(longest)
    reqs = []
    for start in _arrivals(rng, rate, warmup_s, measured_conversations):
        lengths = _conversation(rng)
        stream = _tokens(rng, lengths[-1])
        gaps = np.concatenate([[0.0], rng.exponential(think_s, len(lengths) - 1)])
        reqs += [Request(start + float(t), (stream[:n],))
                 for t, n in zip(np.cumsum(gaps), lengths)]
    reqs.sort(key=lambda r: r.arrival)
    return Workload("b", reqs, s.pool(longest), len(reqs) / reqs[-1].arrival, warmup_s,
                    f"conversations of 3-8 turns, think {think_s} s")


def templates(s: Scale, *, measured: int, num_templates: int) -> Workload:
    rng = np.random.default_rng(s.seed)
    header = _tokens(rng, 32)
    bodies = [np.concatenate([header, _tokens(rng, int(n))])
              for n in np.linspace(1000, 2000, num_templates)]
    ideal = statistics.fmean(s.ideal_s(len(b) + q, len(b)) for b in bodies for q in range(50, 101))
    mean_body = int(statistics.fmean(len(b) for b in bodies))
    rate, warmup_s = s.load * s.nodes / ideal, s.warmup_s(mean_body + 100)
    arrivals = _arrivals(rng, rate, warmup_s, measured)
    which = rng.integers(0, num_templates, len(arrivals))
    reqs = [Request(t, (bodies[k], _tokens(rng, int(rng.integers(50, 101)))))
            for t, k in zip(arrivals, which)]
    return Workload("c", reqs, s.pool(mean_body + 100), rate, warmup_s,
                    f"{num_templates} templates sharing a 32-token header")


# ---- one prefill node --------------------------------------------------------------------------


class FreeList:
    """The node's page pool: the radix cache frees evicted pages into it."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num: int) -> list[int]:
        if num > len(self._free):
            raise RuntimeError(f"asked for {num} pages, {len(self._free)} free")
        out = [self._free.pop() for _ in range(num)]
        for p in out:
            self._is_free[p] = False
        return out

    def free(self, pages: Sequence[int]) -> None:
        for p in pages:
            if self._is_free[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._is_free[p] = True
            self._free.append(p)


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
        stored = [h for h, is_stored in self.net.items() if is_stored]
        removed = [h for h, is_stored in self.net.items() if not is_stored]
        self.net.clear()
        return np.array(stored, dtype=np.uint64), np.array(removed, dtype=np.uint64)


@dataclass
class Job:
    index: int
    request: Request
    num_tokens: int
    gateway_tokens: int  # what the gateway added to its pending count for the node
    oracle_tokens: int  # its uncached tokens when routed (the oracle's queue)
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
        self.num_waiting_tokens = 0
        self.num_waiting_oracle = 0
        self.max_cached_pages = 0

    def enqueue(self, job: Job) -> None:
        self.waiting.append(job)
        self.num_waiting_tokens += job.num_tokens
        self.num_waiting_oracle += job.oracle_tokens

    def start_next(self, now: float) -> float | None:
        """Admit the head of the queue when idle; returns when it ends."""
        if self.running is not None or not self.waiting:
            return None
        job = self.waiting.popleft()
        self.num_waiting_tokens -= job.num_tokens
        self.num_waiting_oracle -= job.oracle_tokens
        ps, n = self.page_size, job.num_tokens
        job.tokens = np.concatenate(job.request.parts).tobytes()
        match = self.cache.match_prefix(job.tokens)
        num_cached = min(len(match.page_ids), (n - 1) // ps)  # the last token is computed
        if num_cached:
            self.cache.inc_lock_ref(match.last_node)  # before evict: our prefix stays
            job.locked = match.last_node
        need = _pages(n, ps) - num_cached
        if need > self.allocator.num_free:
            self.cache.evict(need - self.allocator.num_free)
        job.pages = match.page_ids[:num_cached] + self.allocator.allocate(need)
        job.cached, job.start = num_cached * ps, now
        service = self.cost.service_s(job.cached, n - job.cached)
        job.end = now + service
        self.busy_s += service
        self.running = job
        return job.end

    def finish(self) -> Job:
        """The running request's prefill is done: cache its prompt, free what is not cached."""
        job, ps = self.running, self.page_size
        assert job is not None
        self.running = None
        already = self.cache.insert(job.tokens, job.pages) // ps
        num_cached, whole = job.cached // ps, job.num_tokens // ps
        self.allocator.free(job.pages[num_cached:already] + job.pages[whole:])
        if job.locked is not None:
            self.cache.dec_lock_ref(job.locked)
        self.max_cached_pages = max(self.max_cached_pages, self.cache.num_pages)
        job.tokens, job.pages, job.locked = b"", [], None
        return job

    def reported_tokens(self, node_load: str) -> int:
        """What the node puts in its events as queued_tokens (PrefillScheduler.queued_tokens)."""
        running = 0 if self.running is None else self.running.num_tokens - self.running.cached
        if node_load == "prompt":
            return running + self.num_waiting_tokens
        ps = self.page_size
        return running + sum(
            j.num_tokens - min(len(self.cache.match_prefix(np.concatenate(j.request.parts)
                                                           .tobytes()).page_ids),
                               (j.num_tokens - 1) // ps) * ps for j in self.waiting)

    def exact_tokens(self, now: float) -> int:
        """The oracle's view of the queue: tokens still to compute."""
        left = 0.0
        if (job := self.running) is not None and job.end > job.start:
            left = (job.num_tokens - job.cached) * (job.end - now) / (job.end - job.start)
        return int(left) + self.num_waiting_oracle


# ---- the simulation ----------------------------------------------------------------------------


@dataclass
class SimResult:
    ttft: list[float]
    cached: list[int]
    prompt: list[int]
    route_s: list[float]
    routed: list[str]
    index_mb: float
    busy_s: float
    nodes: list[SimNode]


def simulate(w: Workload, num_nodes: int, router_name: str, cost: Cost, *, page_size: int = 16,
             event_delay_s: float = 0.02, node_load: str = "prompt", gateway_load: str = "max",
             seed: int = 0,
             verify_index: bool = False) -> SimResult:
    """Route and serve every request of ``w``; verify_index checks (delay 0) that the index's
    overlaps equal each node's real cache match at every routing."""
    node_ids = [f"p{i}" for i in range(num_nodes)]
    nodes = {nid: SimNode(nid, w.pool_pages, page_size, cost) for nid in node_ids}
    longest = max(sum(len(p) for p in r.parts) for r in w.requests)
    if _pages(longest, page_size) > w.pool_pages:
        raise ValueError(f"a {longest}-token prompt does not fit a {w.pool_pages}-page pool")
    index = KVIndex()
    router = Router(mode="precise" if router_name == "oracle" else router_name, seed=seed,
                    page_size=page_size)
    ring = HashRing(sorted(node_ids), DEFAULT_VIRTUAL_NODES)
    pending_n = dict.fromkeys(node_ids, 0)
    pending_tokens = dict.fromkeys(node_ids, 0)
    routed_tokens = dict.fromkeys(node_ids, 0)  # uncached tokens ever routed to the node
    seen = dict.fromkeys(node_ids, 0)  # routed_tokens when its last delivered report was made
    heap: list[tuple[float, int, str, Any]] = []
    order = 0
    uses_index = router_name == "precise" or verify_index
    n_req = len(w.requests)
    res = SimResult([0.0] * n_req, [0] * n_req, [0] * n_req, [], [""] * n_req, 0.0, 0.0, [])

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal order
        order += 1
        heapq.heappush(heap, (t, order, kind, payload))

    def publish(node: SimNode, now: float) -> None:
        if not uses_index:
            node.sink.net.clear()
            return
        queued, mark = node.reported_tokens(node_load), routed_tokens[node.node_id]
        if node.sink.net:
            node.seq += 1
            push(now + event_delay_s, "batch",
                 (node.node_id, node.seq, *node.sink.take(), queued, mark))
        else:
            push(now + event_delay_s, "load", (node.node_id, queued, mark))

    def start(node: SimNode, now: float) -> None:
        end = node.start_next(now)
        if end is not None:
            publish(node, now)
            push(end, "done", node.node_id)

    def route(i: int, req: Request) -> None:
        arr = np.concatenate(req.parts)
        ids = arr.tolist()
        hashes = prompt_hashes(ids, page_size).tolist() if router_name == "precise" else []
        tokens = arr.tobytes() if router_name == "oracle" or verify_index else b""
        if verify_index:
            real = {nid: k for nid, nd in nodes.items()
                    if (k := len(nd.cache.match_prefix(tokens).page_ids))}
            got = index.overlaps(prompt_hashes(ids, page_size).tolist(), node_ids)
            assert got == real, f"request {i}: index {got} != caches {real}"
        started = time.perf_counter()
        if router_name == "oracle":
            overlaps = {nid: k for nid, nd in nodes.items()
                        if (k := len(nd.cache.match_prefix(tokens).page_ids))}
            cands = [PrefillCandidate(nid, pending_n[nid], nodes[nid].exact_tokens(req.arrival))
                     for nid in node_ids]
            key = affinity_key(ids, None, DEFAULT_AFFINITY_TOKENS, page_size)
            choice = (choose_prefill_by_cache(overlaps, cands, len(ids), page_size, ring, key)
                      or choose_prefill(ring, key, cands, DEFAULT_EPSILON))
            chosen, cached_pages = choice.node_id, overlaps.get(choice.node_id, 0)
        else:
            overlaps = index.overlaps(hashes, node_ids) if router_name == "precise" else None
            cands = [PrefillCandidate(nid, pending_n[nid], gateway_tokens(nid))
                     for nid in node_ids]
            decision = router.route(ids, None, cands, DECODES, None, overlaps)
            chosen, cached_pages = decision.prefill_id, decision.cached_pages
        res.route_s.append(time.perf_counter() - started)
        uncached = max(1, len(ids) - cached_pages * page_size)
        pending_n[chosen] += 1
        pending_tokens[chosen] += uncached
        routed_tokens[chosen] += uncached
        res.routed[i] = chosen
        nodes[chosen].enqueue(Job(i, req, len(ids), uncached, uncached))
        start(nodes[chosen], req.arrival)

    def gateway_tokens(nid: str) -> int:
        state = index.node(nid)
        reported = state.queued_tokens if state is not None else 0
        if gateway_load == "max":  # service.py's _queued_tokens
            return max(reported, pending_tokens[nid])
        return reported + routed_tokens[nid] - seen[nid]  # + what the report had not seen

    i = 0
    while i < n_req or heap:
        if heap and (i >= n_req or heap[0][0] <= w.requests[i].arrival):
            now, _, kind, payload = heapq.heappop(heap)
            if kind == "done":
                node = nodes[payload]
                job = node.finish()
                res.ttft[job.index] = now - job.request.arrival
                res.cached[job.index], res.prompt[job.index] = job.cached, job.num_tokens
                pending_n[node.node_id] -= 1
                pending_tokens[node.node_id] -= job.gateway_tokens
                if node.waiting:
                    start(node, now)
                else:
                    publish(node, now)
            elif kind == "batch":
                nid, seq, stored, removed, queued, seen[nid] = payload
                index.apply(nid, "sim", seq, stored=stored, removed=removed, is_snapshot=False,
                            queued_tokens=queued, max_pages=w.pool_pages)
            else:
                nid, queued, seen[nid] = payload
                index.report_load(nid, queued)
        else:
            route(i, w.requests[i])
            i += 1
    res.index_mb = index.memory_bytes() / 2**20 if router_name == "precise" else 0.0
    res.busy_s = sum(nd.busy_s for nd in nodes.values())
    res.nodes = list(nodes.values())
    return res


# ---- the report --------------------------------------------------------------------------------


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(w: Workload, num_nodes: int, router_name: str, r: SimResult) -> dict[str, Any]:
    counted = [i for i, q in enumerate(w.requests) if q.arrival >= w.warmup_s]
    cached, prompt = sum(r.cached[i] for i in counted), sum(r.prompt[i] for i in counted)
    ttft = [r.ttft[i] for i in counted]
    span = w.requests[-1].arrival - w.requests[0].arrival
    return {"bench": "routing_sim", "workload": w.name, "nodes": num_nodes,
            "router": router_name, "hit_rate": round(cached / prompt, 4),
            "computed_tokens": prompt - cached, "ttft_p50_s": round(_pct(ttft, 50), 4),
            "ttft_p90_s": round(_pct(ttft, 90), 4), "ttft_p99_s": round(_pct(ttft, 99), 4),
            "route_us_p99": round(_pct(r.route_s, 99) * 1e6, 1),
            "index_mb": round(r.index_mb, 3),
            "offered_load": round(r.busy_s / num_nodes / span, 3), "requests": len(counted)}


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'nodes':>5} {'router':11} {'hit':>6} {'%orc':>5} {'computed':>11} {'p50 s':>8} "
          f"{'p90 s':>8} {'p99 s':>8} {'aff/p90':>7} {'route p99':>9} {'idx MB':>7} {'load':>5}")
    for r in rows:
        peers = {x["router"]: x for x in rows if x["nodes"] == r["nodes"]}
        orc, aff = peers.get("oracle"), peers.get("affinity")
        vs_orc = f"{r['hit_rate'] / orc['hit_rate']:5.0%}" if orc and orc["hit_rate"] else "    -"
        vs_aff = (f"{aff['ttft_p90_s'] / r['ttft_p90_s']:7.2f}" if aff and r["ttft_p90_s"]
                  else "      -")
        print(f"{r['nodes']:5d} {r['router']:11} {r['hit_rate']:6.1%} {vs_orc} "
              f"{r['computed_tokens']:11d} {r['ttft_p50_s']:8.3f} {r['ttft_p90_s']:8.3f} "
              f"{r['ttft_p99_s']:8.3f} {vs_aff} {r['route_us_p99']:7.0f}us "
              f"{r['index_mb']:7.2f} {r['offered_load']:5.2f}")


def verdict(rows: list[dict[str, Any]]) -> None:
    def by(router: str) -> dict[tuple[str, int], dict[str, Any]]:
        return {(r["workload"], r["nodes"]): r for r in rows if r["router"] == router}

    precise, oracle, aff = by("precise"), by("oracle"), by("affinity")
    print("targets:")
    for key, p in sorted(precise.items()):
        if key in oracle:
            o = oracle[key]["hit_rate"]
            ok = p["hit_rate"] >= 0.95 * o
            print(f"  {'MET ' if ok else 'MISS'} hit rate {key[0]}@{key[1]}: precise "
                  f"{p['hit_rate']:.1%} = {p['hit_rate'] / o:.1%} of oracle's {o:.1%} (>= 95%)")
    for key, p in sorted(precise.items()):
        if key in aff and key[0] in ("a", "c"):
            ratio = aff[key]["ttft_p90_s"] / p["ttft_p90_s"]
            print(f"  {'MET ' if ratio >= 5 else 'MISS'} p90 TTFT {key[0]}@{key[1]}: affinity "
                  f"{aff[key]['ttft_p90_s']:.3f} s / precise {p['ttft_p90_s']:.3f} s = "
                  f"{ratio:.2f}x (>= 5x)")
    for key, p in sorted(precise.items()):
        if key[1] == 128:
            print(f"  {'MET ' if p['route_us_p99'] < 200 else 'MISS'} routing p99 "
                  f"{key[0]}@128: precise {p['route_us_p99']:.0f} us (< 200 us)")


def _cpu() -> str:
    spec = importlib.util.spec_from_file_location("cpu_info", os.path.join(_HERE, "cpu_info.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.describe_cpu())


def build_workloads(args: argparse.Namespace, cost: Cost, nodes: int
                    ) -> list[Callable[[], Workload]]:
    sc = Scale(nodes, cost, args.load, args.page_size, args.seed, args.warmup_misses,
               args.pool_pages)
    measured = args.requests_per_node * nodes
    num_tenants = max(2, round(150 * nodes / 128))
    if nodes >= 1000:  # a small pool: 4 short contexts fit
        small = Scale(nodes, cost, args.load, args.page_size, args.seed, args.warmup_misses,
                      args.small_pool)
        ctx = args.small_pool * args.page_size // 4 - 100
        return [lambda: tenants(small, measured=args.requests_1000, context=ctx,
                                num_tenants=num_tenants)]
    out = {"a": lambda: tenants(sc, measured=measured, context=args.context_tokens,
                                num_tenants=num_tenants),
           "b": lambda: chat(sc, measured_conversations=args.conversations_per_node * nodes,
                             think_s=args.think_s),
           "c": lambda: templates(sc, measured=measured, num_templates=args.templates)}
    return [out[k] for k in args.workloads]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 and 32 nodes, short runs")
    ap.add_argument("--cost", type=parse_cost, default=None,
                    help="overhead_ms,us_per_token[,ns_per_token_ctx]; skips the fit")
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128, 1000])
    ap.add_argument("--workloads", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    ap.add_argument("--routers", nargs="+", default=list(ROUTERS), choices=ROUTERS)
    ap.add_argument("--requests-per-node", type=int, default=60, help="workloads a and c")
    ap.add_argument("--conversations-per-node", type=int, default=12, help="workload b")
    ap.add_argument("--requests-1000", type=int, default=6000, help="the 1000-node run")
    ap.add_argument("--context-tokens", type=int, default=6000)
    ap.add_argument("--templates", type=int, default=8)
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--pool-pages", type=int, default=None, help="default: 4 units per workload")
    ap.add_argument("--small-pool", type=int, default=64, help="pages per node at 1000 nodes")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--event-delay-ms", type=float, default=20.0)
    ap.add_argument("--node-load", choices=["prompt", "uncached"], default="prompt",
                    help="queued tokens a node reports: waiting prompts whole (as "
                    "PrefillScheduler.queued_tokens), or less their cached prefix")
    ap.add_argument("--gateway-load", choices=["max", "since"], default="max",
                    help="max(report, pending) as service.py, or report + what the gateway "
                    "routed after the report was made (an alternative)")
    ap.add_argument("--warmup-misses", type=float, default=5.0,
                    help="warm-up (ramp, not counted) in misses of the workload's unit")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.nodes = [n for n in args.nodes if n <= 32] or [8]
        args.requests_per_node, args.conversations_per_node = 25, 5
    wall = time.perf_counter()
    print(f"cpu: {_cpu()}")
    cost = args.cost if args.cost is not None else fit_cost()
    print(f"cost model: {cost.describe()}")
    rows: dict[str, list[dict[str, Any]]] = {}
    for nodes in args.nodes:
        for make in build_workloads(args, cost, nodes):
            w = make()
            print(f"[{w.name}@{nodes}] {w.note}; {len(w.requests)} requests; pool "
                  f"{w.pool_pages} pages; {w.rate:.1f} req/s after a {w.warmup_s:.0f} s ramp",
                  flush=True)
            for router_name in args.routers:
                started = time.perf_counter()
                r = simulate(w, nodes, router_name, cost, page_size=args.page_size,
                             event_delay_s=args.event_delay_ms / 1e3, node_load=args.node_load,
                             gateway_load=args.gateway_load, seed=args.seed)
                row = summarize(w, nodes, router_name, r)
                row["wall_s"] = round(time.perf_counter() - started, 1)
                rows.setdefault(w.name, []).append(row)
                print(f"  {router_name:11} hit {row['hit_rate']:.1%} p90 {row['ttft_p90_s']:.3f}"
                      f" s ({row['wall_s']} s)", flush=True)
    for name, table in rows.items():
        print(f"\nworkload {name} (requests of the warm-up ramp not counted; "
              f"event delay {args.event_delay_ms} ms; node load '{args.node_load}')")
        print_table(table)
    print()
    for table in rows.values():
        for row in table:
            print(json.dumps(row))
    verdict([r for t in rows.values() for r in t])
    print(f"total {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()
