"""bench/routing_sim.py's report: the worst run of the sweep per node count, the table
across cost-model scales, and the verdict on the targets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from routing_workloads import CostCase


def pct(values: Sequence[float], q: float, scale: float = 1.0, digits: int = 4) -> float:
    return round(float(np.percentile(values, q)) * scale, digits) if values else float("nan")


@dataclass
class Run:
    """The routers' rows over one workload, one node count and one cost model."""

    nodes: int
    workload: str
    case: CostCase
    rows: dict[str, dict[str, Any]]  # by router

    def share(self) -> float | None:
        """precise's hit rate / the oracle's."""
        p, o = self.rows.get("precise"), self.rows.get("oracle")
        return p["hit_rate"] / o["hit_rate"] if p and o and o["hit_rate"] else None

    def margin(self) -> float | None:
        """precise's hit rate - affinity's."""
        p, a = self.rows.get("precise"), self.rows.get("affinity")
        return p["hit_rate"] - a["hit_rate"] if p and a else None

    def p90_gain(self) -> float | None:
        """affinity's p90 TTFT / precise's (workloads a and c)."""
        p, a = self.rows.get("precise"), self.rows.get("affinity")
        return a["ttft_p90_s"] / p["ttft_p90_s"] if p and a and self.workload != "b" else None


def _worst(runs: Sequence[Run], measure: Callable[[Run], float | None]) -> tuple[float, Run]:
    scored = [(v, r) for r in runs if (v := measure(r)) is not None]
    return min(scored, key=lambda x: x[0]) if scored else (float("nan"), runs[0])


def worst_cases(runs: Sequence[Run], route_s: dict[int, list[float]]) -> list[dict[str, Any]]:
    """Per node count, the worst run of the sweep by each measure (one JSON line each)."""
    out = []
    for n in sorted({r.nodes for r in runs}):
        mine = [r for r in runs if r.nodes == n]
        row: dict[str, Any] = {"bench": "routing_sim_worst", "nodes": n, "runs": len(mine)}
        for name, measure in (
            ("share", Run.share),
            ("margin", Run.margin),
            ("p90_gain", Run.p90_gain),
        ):
            value, run = _worst(mine, measure)
            row[name] = round(value, 4)
            row[f"{name}_run"] = f"{run.workload} {run.case.label} ({run.case.cost.short()})"
        row["route_us_p99"] = pct(route_s.get(n, []), 99, 1e6, 1)
        out.append(row)
    return out


def print_worst(worst: list[dict[str, Any]]) -> None:
    print(
        "\nworst case per node count over the sweep (share = precise's hit rate / the "
        "oracle's; margin = precise's - affinity's; p90 gain = affinity's p90 TTFT / "
        "precise's, a and c; routing p99 over every precise decision)"
    )
    print(f"{'nodes':>5} {'runs':>4}  {'share':>6}  {'margin':>7}  {'p90 gain':>8}  {'p99 us':>6}")
    for w in worst:
        print(
            f"{w['nodes']:5d} {w['runs']:4d}  {w['share']:6.1%}  {w['margin']:+7.1%}  "
            f"{w['p90_gain']:8.2f}  {w['route_us_p99']:6.0f}"
        )
        for name in ("share", "margin", "p90_gain"):
            print(f"{'':12}{name} worst at: {w[f'{name}_run']}")


def print_scales(runs: Sequence[Run]) -> None:
    """Per node count, workload and scale of the fitted model (unperturbed, every seed):
    mean hit rates, the worst share and margin, median p90 TTFTs."""
    print(
        "\nacross cost-model scales (the fitted model times k, unperturbed; hit rates are "
        "means over seeds, share and margin the worst seed, p90 TTFT the median seed)"
    )
    print(
        f"{'nodes':>5} {'wl':>2} {'k':>4} {'seeds':>5}  {'oracle':>6} {'precise':>7} "
        f"{'affin':>6}  {'share':>6} {'margin':>7}  {'p90 s orc/prec/aff':>22}"
    )
    groups: dict[tuple[int, str, float], list[Run]] = {}
    for r in runs:
        if not r.case.perturbation:
            groups.setdefault((r.nodes, r.workload, r.case.scale), []).append(r)
    for (n, wl, k), mine in sorted(groups.items()):

        def mean_hit(router: str, mine: list[Run] = mine) -> float:
            hits = [r.rows[router]["hit_rate"] for r in mine if router in r.rows]
            return float(np.mean(hits)) if hits else float("nan")

        def p90(router: str, mine: list[Run] = mine) -> float:
            p90s = [r.rows[router]["ttft_p90_s"] for r in mine if router in r.rows]
            return float(np.median(p90s)) if p90s else float("nan")

        p90s = "/".join(f"{p90(x):.1f}" for x in ("oracle", "precise", "affinity"))
        print(
            f"{n:5d} {wl:>2} {k:4g} {len(mine):5d}  {mean_hit('oracle'):6.1%} "
            f"{mean_hit('precise'):7.1%} {mean_hit('affinity'):6.1%}  "
            f"{_worst(mine, Run.share)[0]:6.1%} {_worst(mine, Run.margin)[0]:+7.1%}  "
            f"{p90s:>22}"
        )


def verdict(worst: list[dict[str, Any]]) -> None:
    checks: list[tuple[bool, str]] = []
    for w in worst:
        n = w["nodes"]
        checks.append(
            (w["share"] >= 0.95, f"hit rate @{n}: worst precise/oracle {w['share']:.1%} (>= 95%)")
        )
        checks.append(
            (w["margin"] >= 0, f"vs affinity @{n}: worst precise - affinity {w['margin']:+.1%}")
        )
        checks.append(
            (
                w["p90_gain"] >= 5,
                f"p90 TTFT @{n}: worst affinity/precise {w['p90_gain']:.2f}x (>= 5x)",
            )
        )
        if n == 128:
            checks.append(
                (
                    w["route_us_p99"] < 200,
                    f"routing p99 @128: {w['route_us_p99']:.0f} us (< 200 us)",
                )
            )
    print(
        f"targets (worst case over the sweep): {sum(ok for ok, _ in checks)} of {len(checks)} met"
    )
    for ok, text in checks:
        print(f"  {'MET ' if ok else 'MISS'} {text}")
