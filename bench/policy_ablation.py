"""Why the schedule policies exist: the real prefill scheduler under cache pressure, per policy.

The real ``PrefillScheduler`` (its SchedulePolicy, RadixCache and PrefillAdder, its zmq
request socket and KV senders) runs against a stand-in model and a real loopback KV
transfer into a stand-in decode side. Order and reuse do not depend on the logits, so
the stand-in's extend only charges time on a virtual clock from a cost model of the
built-in model's prefill: ``c + a * tokens + b * tokens * context`` per batch (measured
with --measure-cost on this machine, else the defaults below, measured on an Intel Xeon
with AVX-512 BF16/AMX, float32). The prefill KV pool is smaller than each workload's
working set, so the order decides what stays cached.

Workloads (token ids from fixed seeds, vocabulary 32000; ``sched-q1000`` is the shared
bench-data queue):
  few-templates    600 short requests on 8 templates of 768 tokens, one burst, pool of ~3
  system-batches   8 batches of 40 requests; 4 system prompts of 3072 tokens mixed in
                   every batch; pool of ~2 system prompts and a batch's questions
  many-tenants     48 tenants x 8 requests, 1024-token templates, interleaved; pool of ~6
  short-among-long 90 unique 6000-token prompts and 60 short 48-token ones among them,
                   arriving over time (TTFT of the short ones reported too)
  cached-long-vs-short  40 prompts of a cached 2048-token prefix + 64 new tokens among 40
                   of a cached 4096-token prefix + 6000 new ones, one burst (the seeds'
                   case against plain lpm)
  sched-q1000      bench-data/sched-workload.npz's q1000 queue (its cache sequences
                   inserted first), one burst
For each policy (fcfs, random, lpm, dfs-weight, hrrn, shortest-prefill-first, and the
opt-in lpm-length-aware = lpm with --lpm-length-aware, and dfs-weight-dedup-off = SGLang's
exact dfs-weight): prompt tokens computed / the minimum (every page-aligned shared prefix
computed once, the last token of each prompt always), the cache hit rate (1 - computed /
prompt tokens), TTFT p50/p99 in virtual seconds (arrival to the first token), and the
makespan. Prints a table per workload and one JSON line per (workload, policy).
A cost-aware in-batch dedup (wait only when the reused prefix is a good share of the
prompt) was tried and measured no different from SGLang's on every workload here: dedup
only reorders, and a deprioritized request still joins the round when the budget allows.
Usage: python bench/policy_ablation.py [--quick] [--measure-cost] [--workloads ...]
       [--policies ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import numpy as np
import torch
import zmq

from common import messages as msg
from common.config import ModelConfig, PrefillConfig
from common.ipc import bind_pull, close_pull, recv_messages
from common.kv_pool import KVLayout, KVPool, pages_needed
from common.radix_cache import RadixCache
from prefill_node.scheduler import PrefillScheduler
from transfer.kv_manager import KVManager
from transfer.kv_poll import KVPoll
from transfer.loopback_backend import LoopbackBackend

DATA = Path(__file__).resolve().parents[2] / "shared" / "bench-data" / "sched-workload.npz"
POLICIES = (
    "fcfs",
    "random",
    "lpm",
    "dfs-weight",
    "hrrn",
    "shortest-prefill-first",
    "lpm-length-aware",
    "dfs-weight-dedup-off",
)
# Opt-in variants beyond SGLang: the policy and the PrefillConfig fields they set.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "lpm-length-aware": ("lpm", {"lpm_length_aware": True}),
    "dfs-weight-dedup-off": ("dfs-weight", {"dfs_weight_dedup": "off"}),  # SGLang's exact one
}
PAGE = 16
VOCAB = 32000
LAYOUT = KVLayout(1, 1, 1, PAGE, "float32")  # the stand-in moves no real KV
# Seconds per batch: C + A * new tokens + B * new tokens * attended context.
COST_C, COST_A, COST_B = 0.02, 6.7e-4, 1.6e-7


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    arrivals: list[float]  # virtual seconds
    pool_pages: int
    warm: list[list[int]] = field(default_factory=list)  # cached before the run
    short_below: int = 0  # prompts shorter than this are "short" (their TTFT reported)


# ---- workloads -------------------------------------------------------------------------------


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def few_templates(scale: float) -> Workload:
    rng = random.Random(1)
    templates = [_tokens(rng, 768) for _ in range(8)]
    n = int(600 * scale)
    prompts = [templates[rng.randrange(8)] + _tokens(rng, rng.randrange(16, 96)) for _ in range(n)]
    return Workload("few-templates", prompts, [0.0] * n, pool_pages=3 * 768 // PAGE + 160)


def system_batches(scale: float) -> Workload:
    rng = random.Random(2)
    systems = [_tokens(rng, 3072) for _ in range(4)]
    prompts, arrivals = [], []
    for b in range(max(2, int(8 * scale))):
        for _ in range(40):
            prompts.append(systems[rng.randrange(4)] + _tokens(rng, rng.randrange(32, 256)))
            arrivals.append(b * 6.0)
    return Workload("system-batches", prompts, arrivals, pool_pages=2 * 3072 // PAGE + 400)


def many_tenants(scale: float) -> Workload:
    rng = random.Random(3)
    tenants = [_tokens(rng, 1024) for _ in range(48)]
    order = [t for t in range(48) for _ in range(max(2, int(8 * scale)))]
    rng.shuffle(order)
    prompts = [tenants[t] + _tokens(rng, rng.randrange(16, 128)) for t in order]
    arrivals = [i * 0.02 for i in range(len(prompts))]
    return Workload("many-tenants", prompts, arrivals, pool_pages=6 * 1024 // PAGE + 200)


def short_among_long(scale: float) -> Workload:
    rng = random.Random(4)
    kinds = ["long"] * int(90 * scale) + ["short"] * int(60 * scale)
    rng.shuffle(kinds)
    prompts = [_tokens(rng, 6000 if k == "long" else 48) for k in kinds]
    arrivals = [i * 0.5 for i in range(len(prompts))]
    return Workload(
        "short-among-long", prompts, arrivals, pool_pages=4 * 6000 // PAGE, short_below=1000
    )


def cached_long_vs_short(scale: float) -> Workload:
    rng = random.Random(5)
    short_prefix, long_prefix = _tokens(rng, 2048), _tokens(rng, 4096)
    kinds = ["short"] * int(40 * scale) + ["long"] * int(40 * scale)
    rng.shuffle(kinds)
    # The seeds' case: 2K cached + 64 to compute waits, under lpm, behind 4K cached + 6K.
    prompts = [
        short_prefix + _tokens(rng, 64) if k == "short" else long_prefix + _tokens(rng, 6000)
        for k in kinds
    ]
    return Workload(
        "cached-long-vs-short",
        prompts,
        [0.0] * len(prompts),
        pool_pages=(2048 + 4096) // PAGE + 2 * 6100 // PAGE + 64,
        warm=[short_prefix, long_prefix],
        short_below=3000,
    )


def sched_q1000(scale: float) -> Workload:
    data = np.load(DATA)
    n = 1000 if scale >= 1 else 128

    def seqs(prefix: str, count: int) -> list[list[int]]:
        tokens, offsets = data[f"{prefix}_tokens"], data[f"{prefix}_offsets"]
        return [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(count)]

    cache = seqs("cache", len(data["cache_offsets"]) - 1)
    prompts = seqs(f"q{n}", n)
    total_pages = sum(pages_needed(len(p), PAGE) for p in prompts + cache)
    return Workload(
        "sched-q1000" if n == 1000 else "sched-q128",
        prompts,
        [0.0] * n,
        pool_pages=max(total_pages // 24, 2400),
        warm=cache,
    )


WORKLOADS = {
    w.__name__.replace("_", "-"): w
    for w in (
        few_templates,
        system_batches,
        many_tenants,
        short_among_long,
        cached_long_vs_short,
        sched_q1000,
    )
}


# ---- the stand-ins -----------------------------------------------------------------------------


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StandInRunner:
    """What PrefillScheduler uses of a ModelRunner; extend charges the cost model's time."""

    def __init__(self, num_pages: int, clock: VirtualClock, cost: tuple[float, float, float]):
        self.pool = KVPool(LAYOUT, num_pages)
        self.layout = LAYOUT
        self.page_size = PAGE
        self.context_length = 1 << 20
        self.spec = SimpleNamespace(vocab_size=VOCAB)
        self.clock = clock
        self.cost = cost
        self.num_batches = 0

    def extend(self, reqs: Sequence[Any]) -> SimpleNamespace:
        c, a, b = self.cost
        new = sum(len(r.token_ids) for r in reqs)
        attended = sum(len(r.token_ids) * (r.prefix_len + len(r.token_ids) / 2) for r in reqs)
        self.clock.now += c + a * new + b * attended
        self.num_batches += 1
        return SimpleNamespace(logits=torch.zeros(len(reqs), 8))


# ---- one run -----------------------------------------------------------------------------------

_ids = itertools.count()


def minimum_tokens(w: Workload) -> int:
    """Tokens a cache that never forgets computes: the unshared part of each prompt in
    arrival order, in whole pages, and always the last token."""
    tree = RadixCache(PAGE)
    for seq in w.warm:
        tree.insert(seq, list(range(len(seq) // PAGE)))
    total = 0
    for p in w.prompts:
        usable = min(tree.match_prefix(p).num_tokens, (len(p) - 1) // PAGE * PAGE)
        total += len(p) - usable
        tree.insert(p, list(range(len(p) // PAGE)))
    return total


def run(w: Workload, policy: str, cost: tuple[float, float, float]) -> dict[str, Any]:
    n = next(_ids)
    clock = VirtualClock()
    runner = StandInRunner(w.pool_pages, clock, cost)
    name, extra = VARIANTS.get(policy, (policy, {}))
    config = PrefillConfig(model=ModelConfig(page_size=PAGE), schedule_policy=name, **extra)
    ctx = zmq.Context.instance()
    kv = KVManager(
        f"ab-p{n}",
        "prefill",
        LoopbackBackend(f"ab-p{n}"),
        runner.pool,
        backend_kind="loopback",
        lease_s=1e6,
    )
    dpool = KVPool(LAYOUT, sum(pages_needed(len(p), PAGE) for p in w.prompts) + 64)
    decode = KVManager(
        f"ab-d{n}",
        "decode",
        LoopbackBackend(f"ab-d{n}"),
        dpool,
        backend_kind="loopback",
        lease_s=1e6,
    )
    req_sock, req_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    reply_sock, reply_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    sched = PrefillScheduler(config, runner, kv, req_sock, clock=clock)
    if sched.tree is not None:
        for seq in w.warm:  # the warm cache, as if earlier requests had left it (LRU)
            free = runner.pool.allocator.num_free_pages
            if free < len(seq) // PAGE:  # room for all of it, whatever stays matched
                sched.tree.evict(len(seq) // PAGE - free)
            own = sched.tree.match_prefix(seq).page_ids
            pages = runner.pool.allocator.allocate(len(seq) // PAGE - len(own))
            sched.tree.insert(seq, own + pages)
    push = ctx.socket(zmq.PUSH)
    push.connect(req_endpoint)
    order = sorted(range(len(w.prompts)), key=lambda i: w.arrivals[i])
    receivers: dict[int, Any] = {}
    waiting_meta: set[int] = set()
    done: dict[int, float] = {}
    nxt = 0
    wall = time.perf_counter()
    try:
        while len(done) < len(w.prompts):
            while nxt < len(order) and w.arrivals[order[nxt]] <= clock.now:
                i = order[nxt]
                nxt += 1
                push.send(
                    msg.encode(
                        msg.GenerateReq(
                            rid=f"r{i}",
                            room=i + 1,
                            input_ids=w.prompts[i],
                            sampling={"max_new_tokens": 1, "temperature": 0.0},
                            priority=None,
                            routing_key=None,
                            prefill_node_id="p",
                            decode_node_id="d",
                            reply_endpoint=reply_endpoint,
                            arrival_time=w.arrivals[i],
                            return_logprob=False,
                        )
                    )
                )
                receivers[i] = decode.create_receiver(i + 1, kv.control_endpoint)
                waiting_meta.add(i)
            did_work = sched.step()
            decode.poll()
            for i in list(waiting_meta):
                if receivers[i].poll() is KVPoll.WaitingForInput:
                    receivers[i].pages = dpool.allocator.allocate(
                        pages_needed(len(w.prompts[i]), PAGE)
                    )
                    receivers[i].send_metadata(receivers[i].pages)
                    waiting_meta.discard(i)
            for i, r in receivers.items():
                if i not in done and i not in waiting_meta:
                    state = r.poll()
                    if state is KVPoll.Success:
                        done[i] = clock.now
                        dpool.allocator.free(r.pages)
                    elif state is KVPoll.Failed:
                        raise RuntimeError(f"request {i} failed: {r.failure_reason}")
            for m in recv_messages(reply_sock):
                if isinstance(m, msg.ReqFailed):
                    raise RuntimeError(f"{m.rid} failed: {m.error}")
            if not did_work and not sched.states and nxt < len(order):
                clock.now = max(clock.now, w.arrivals[order[nxt]])  # idle until the next one
    finally:
        push.close(0)
        kv.close()
        decode.close()
        close_pull(reply_sock)
    ttft = [done[i] - w.arrivals[i] for i in range(len(w.prompts))]
    short = [t for i, t in enumerate(ttft) if len(w.prompts[i]) < w.short_below]
    total = sum(len(p) for p in w.prompts)
    computed = sched.processed_tokens
    out = {
        "computed": computed,
        "total": total,
        "hit_rate": 1 - computed / total,
        "ttft_p50": _pct(ttft, 50),
        "ttft_p99": _pct(ttft, 99),
        "makespan": clock.now,
        "batches": runner.num_batches,
        "wall_s": time.perf_counter() - wall,
    }
    if short:
        out["short_ttft_p50"], out["short_ttft_p99"] = _pct(short, 50), _pct(short, 99)
    return out


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ---- the cost model ----------------------------------------------------------------------------


def measure_cost() -> tuple[float, float, float]:
    """Fit c + a*n + b*n*ctx to the built-in model's extend times on this machine."""
    from common.model.runner import ExtendRequest, ModelRunner

    runner = ModelRunner.from_path(None, progress=False, page_size=PAGE, max_total_tokens=8192)
    rows, times = [], []
    for prefix, n in ((0, 64), (0, 256), (0, 1024), (1024, 256), (2048, 512), (0, 2048)):
        ids = list(range(100, 100 + prefix + n))
        pages = runner.pool.allocator.allocate(pages_needed(prefix + n, PAGE))
        if prefix:
            runner.extend([ExtendRequest(ids[:prefix], 0, pages)])
        best = float("inf")
        for _ in range(2):
            t = time.perf_counter()
            runner.extend([ExtendRequest(ids[prefix:], prefix, pages)])
            best = min(best, time.perf_counter() - t)
        runner.pool.allocator.free(pages)
        rows.append([1.0, n, n * (prefix + n / 2)])
        times.append(best)
    c, a, b = np.linalg.lstsq(np.array(rows), np.array(times), rcond=None)[0]
    return max(float(c), 0.0), max(float(a), 1e-6), max(float(b), 0.0)


def _cpu() -> str:
    # bench/ is off sys.path here (bench/transfer.py would shadow the package): load by path.
    spec = importlib.util.spec_from_file_location("cpu_info", os.path.join(_HERE, "cpu_info.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.describe_cpu())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller workloads")
    ap.add_argument("--measure-cost", action="store_true", help="fit the cost model here")
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--policies", nargs="*", default=list(POLICIES))
    args = ap.parse_args()
    cost = measure_cost() if args.measure_cost else (COST_C, COST_A, COST_B)
    print(f"cpu: {_cpu()}")
    print(f"cost model: {cost[0]:.4f} s + {cost[1]:.3g} s/token + {cost[2]:.3g} s/token/context")
    scale = 0.3 if args.quick else 1.0
    lines = []
    for name in args.workloads:
        w = WORKLOADS[name](scale)
        minimum = minimum_tokens(w)
        print(
            f"\n{w.name}: {len(w.prompts)} requests, {sum(map(len, w.prompts))} prompt tokens, "
            f"minimum {minimum}, pool {w.pool_pages} pages of {PAGE}"
        )
        print(
            f"{'policy':<24}{'computed/min':>13}{'hit rate':>10}{'ttft p50':>10}"
            f"{'ttft p99':>10}{'short p99':>10}{'makespan':>10}"
        )
        base = None
        for policy in args.policies:
            r = run(w, policy, cost)
            ratio = r["computed"] / minimum
            base = base or r
            print(
                f"{policy:<24}{ratio:>13.3f}{r['hit_rate']:>10.3f}{r['ttft_p50']:>10.2f}"
                f"{r['ttft_p99']:>10.2f}{r.get('short_ttft_p99', float('nan')):>10.2f}"
                f"{r['makespan']:>10.1f}"
            )
            line = {
                "bench": "policy_ablation",
                "workload": w.name,
                "policy": policy,
                "computed_over_min": round(ratio, 4),
                "hit_rate": round(r["hit_rate"], 4),
                "ttft_p50": round(r["ttft_p50"], 3),
                "ttft_p99": round(r["ttft_p99"], 3),
                "makespan_s": round(r["makespan"], 2),
                "computed_vs_fcfs": round(r["computed"] / base["computed"], 4),
            }
            if "short_ttft_p99" in r:
                line["short_ttft_p50"] = round(r["short_ttft_p50"], 3)
                line["short_ttft_p99"] = round(r["short_ttft_p99"], 3)
            lines.append(line)
    print()
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
