"""bench/routing_sim.py's inputs: the prefill cost model fitted on this machine and the workloads.

Cost: the built-in model's extend on one thread, float32, fitted as t = a + b*n (+ an
attention term c*n*(prefix + n/2) when it matters); see routing_sim.py's docstring.
Workloads (a) tenants with long shared contexts, (b) multi-turn chat, (c) templates behind
one 32-token header: seeded, Poisson arrivals ramping up over a warm-up. The sweep's cost
models: the fitted one scaled and perturbed in random directions (cost_neighbourhood).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

VOCAB_LO, VOCAB_HI = 100, 49000
Tokens = npt.NDArray[np.int32]


def _pages(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class Cost:
    overhead_s: float
    s_per_token: float
    s_per_token_ctx: float = 0.0  # attention: per new token per token it attends to

    def service_s(self, prefix: int, computed: int) -> float:
        return (
            self.overhead_s
            + computed * self.s_per_token
            + self.s_per_token_ctx * computed * (prefix + computed / 2)
        )

    @staticmethod
    def parse(text: str) -> Cost:
        v = [float(x) for x in text.split(",")]
        return Cost(v[0] / 1e3, v[1] / 1e6, (v[2] if len(v) > 2 else 0.0) / 1e9)

    def describe(self) -> str:
        return (
            f"t = {self.overhead_s * 1e3:.1f} ms + {self.s_per_token * 1e6:.1f} us * n + "
            f"{self.s_per_token_ctx * 1e9:.1f} ns * n * (prefix + n/2)"
        )

    def short(self) -> str:
        """What --cost takes: overhead_ms,us_per_token,ns_per_token_ctx."""
        return (
            f"{self.overhead_s * 1e3:.6g},{self.s_per_token * 1e6:.6g},"
            f"{self.s_per_token_ctx * 1e9:.6g}"
        )

    def times(self, factors: Sequence[float]) -> Cost:
        """Each term multiplied by its factor."""
        a, b, c = factors
        return Cost(self.overhead_s * a, self.s_per_token * b, self.s_per_token_ctx * c)


@dataclass(frozen=True)
class CostCase:
    """One cost model of the sweep: the fitted one scaled, or moved by a relative
    ``perturbation`` in a random direction (drawn from ``seed``, which seeds the workload
    too)."""

    seed: int
    scale: float
    perturbation: float
    cost: Cost

    @property
    def label(self) -> str:
        moved = f" moved {self.perturbation:.2%}" if self.perturbation else ""
        return f"seed {self.seed} x{self.scale:g}{moved}"


def cost_neighbourhood(
    center: Cost,
    seeds: Sequence[int],
    scales: Sequence[float],
    perturbations: Sequence[float],
    directions: int = 1,
) -> list[CostCase]:
    """Per seed: ``center`` at each scale, then ``center`` with its three terms times
    (1 + r * u_i) for each r in ``perturbations`` and ``directions`` random unit vectors u."""
    cases = []
    for seed in seeds:
        cases += [CostCase(seed, k, 0.0, center.times((k, k, k))) for k in scales]
        rng = np.random.default_rng([seed, 0xC057])
        for r in perturbations:
            for _ in range(directions):
                u = rng.normal(size=3)
                u /= np.linalg.norm(u)
                cases.append(CostCase(seed, 1.0, r, center.times(tuple(1 + r * u))))
    return cases


def fit_cost(repeats: int) -> Cost:
    """Time the built-in model's extend on one thread and fit the cost model (printed)."""
    import random

    import torch

    from common.model.runner import ExtendRequest, ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner.from_path(
        None, progress=False, dtype="float32", max_total_tokens=4096 + 64
    )
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
    t, cold = np.array(times), [i for i, (p, _) in enumerate(points) if p == 0]
    a, b = np.linalg.lstsq(np.array([[1.0, points[i][1]] for i in cold]), t[cold], rcond=None)[0]
    rows = np.array([[1.0, n, n * (p + n / 2)] for p, n in points])
    c0, c1, c2 = np.linalg.lstsq(rows, t, rcond=None)[0]
    linear, quad = Cost(float(a), float(b)), Cost(float(c0), float(c1), float(c2))  # as fitted
    share = max(quad.s_per_token_ctx * n * (p + n / 2) / tm for (p, n), tm in zip(points, times))
    used = quad if share >= 0.05 else linear
    print(
        f"cost fit (built-in model, float32, 1 thread, median of {repeats}):\n"
        f"  {'prefix':>6} {'new':>5} {'ms':>8} {'linear':>8} {'resid':>7} {'+attn':>8} "
        f"{'resid':>7}"
    )
    for (p, n), tm in zip(points, times):
        lin, qd = linear.service_s(0, n), quad.service_s(p, n)
        print(
            f"  {p:6d} {n:5d} {tm * 1e3:8.1f} {lin * 1e3:8.1f} {(tm - lin) / tm:+7.1%} "
            f"{qd * 1e3:8.1f} {(tm - qd) / tm:+7.1%}"
        )
    print(
        f"  linear, uncached points: {linear.describe()}\n  with attention, all points: "
        f"{quad.describe()}\n  the attention term is up to {share:.0%} of a point: using "
        f"{'it' if used is quad else 'the linear fit'}"
    )
    return Cost(
        max(used.overhead_s, 0.0), max(used.s_per_token, 1e-9), max(used.s_per_token_ctx, 0.0)
    )  # no negative terms


class Request(NamedTuple):
    arrival: float
    parts: tuple[Tokens, ...]  # the prompt is their concatenation (shared arrays, no copies)


@dataclass
class Workload:
    name: str
    requests: list[Request]
    pool_pages: int
    rate: float  # requests per second after the ramp
    warmup_s: float  # requests arriving before are not counted
    note: str


@dataclass(frozen=True)
class Scale:
    nodes: int
    cost: Cost
    load: float = 0.5
    page_size: int = 16
    seed: int = 0
    warmup_misses: float = 20.0  # the ramp lasts this many misses of the workload's unit
    pool_pages: int | None = None  # None: 4 units

    def ideal_s(self, n: int, shared: int) -> float:
        """Service time with the shared prefix cached (whole pages; the last token computed)."""
        cached = min(shared // self.page_size, (n - 1) // self.page_size) * self.page_size
        return self.cost.service_s(cached, n - cached)

    def pool(self, unit_tokens: int) -> int:
        return self.pool_pages or 4 * _pages(unit_tokens, self.page_size)

    def warmup_s(self, unit_tokens: int) -> float:
        return self.warmup_misses * self.cost.service_s(0, unit_tokens)

    def arrivals(
        self, rng: np.random.Generator, rate: float, warmup_s: float, measured: int
    ) -> list[float]:
        """Poisson arrivals at a rate ramping linearly from 0 to `rate` over warmup_s
        (cumulative rate inverted), then about `measured` more at `rate`."""
        warm = rate * warmup_s / 2  # expected arrivals during the ramp
        u = np.cumsum(rng.exponential(1.0, int(warm) + measured))
        if warmup_s <= 0:
            return list(u / rate)
        ramp = np.sqrt(np.minimum(u, warm) * 2 * warmup_s / rate)
        return list(np.where(u < warm, ramp, warmup_s + (u - warm) / rate))


def _tokens(rng: np.random.Generator, n: int) -> Tokens:
    return rng.integers(VOCAB_LO, VOCAB_HI, n, dtype=np.int32)


def tenants(s: Scale, *, measured: int, context: int, num_tenants: int) -> Workload:
    rng = np.random.default_rng(s.seed)
    contexts = [_tokens(rng, context) for _ in range(num_tenants)]
    rate = (
        s.load * s.nodes / statistics.fmean(s.ideal_s(context + q, context) for q in range(50, 101))
    )
    warmup_s = s.warmup_s(context + 100)
    arrivals = s.arrivals(rng, rate, warmup_s, measured)
    weight = 1.0 / np.arange(1, num_tenants + 1) ** 1.1
    who = rng.choice(num_tenants, size=len(arrivals), p=weight / weight.sum())
    reqs = [
        Request(t, (contexts[k], _tokens(rng, int(rng.integers(50, 101)))))
        for t, k in zip(arrivals, who)
    ]
    return Workload(
        "a",
        reqs,
        s.pool(context + 100),
        rate,
        warmup_s,
        f"{num_tenants} tenants x {context}-token context, Zipf 1.1",
    )


def _conversation(rng: np.random.Generator) -> list[int]:
    """Prompt lengths of a conversation's turns."""
    adds = [int(rng.integers(200, 801))] + [
        int(rng.integers(30, 71) + rng.integers(30, 71)) for _ in range(int(rng.integers(2, 8)))
    ]
    return [int(n) for n in np.cumsum(adds)]


def chat(s: Scale, *, measured_conversations: int, think_s: float) -> Workload:
    rng, pilot = np.random.default_rng(s.seed), np.random.default_rng(s.seed + 1)
    work = statistics.fmean(
        sum(s.ideal_s(n, prev) for n, prev in zip(c, [0] + c[:-1]))
        for c in (_conversation(pilot) for _ in range(2000))
    )
    rate, longest = s.load * s.nodes / work, 800 + 7 * 140  # conversations started per s
    warmup_s = s.warmup_s(longest)
    reqs = []
    for start in s.arrivals(rng, rate, warmup_s, measured_conversations):
        lengths = _conversation(rng)
        stream = _tokens(rng, lengths[-1])
        gaps = np.cumsum(np.concatenate([[0.0], rng.exponential(think_s, len(lengths) - 1)]))
        reqs += [Request(start + float(t), (stream[:n],)) for t, n in zip(gaps, lengths)]
    reqs.sort(key=lambda r: r.arrival)
    return Workload(
        "b",
        reqs,
        s.pool(longest),
        len(reqs) / reqs[-1].arrival,
        warmup_s,
        f"conversations of 3-8 turns, think {think_s} s",
    )


def templates(s: Scale, *, measured: int, num_templates: int) -> Workload:
    rng = np.random.default_rng(s.seed)
    header = _tokens(rng, 32)
    bodies = [
        np.concatenate([header, _tokens(rng, int(n))])
        for n in np.linspace(1000, 2000, num_templates)
    ]
    rate = (
        s.load
        * s.nodes
        / statistics.fmean(s.ideal_s(len(b) + q, len(b)) for b in bodies for q in range(50, 101))
    )
    unit = int(statistics.fmean(len(b) for b in bodies)) + 100
    warmup_s = s.warmup_s(unit)
    arrivals = s.arrivals(rng, rate, warmup_s, measured)
    which = rng.integers(0, num_templates, len(arrivals))
    reqs = [
        Request(t, (bodies[k], _tokens(rng, int(rng.integers(50, 101)))))
        for t, k in zip(arrivals, which)
    ]
    return Workload(
        "c",
        reqs,
        s.pool(unit),
        rate,
        warmup_s,
        f"{num_templates} templates behind one 32-token header",
    )
