"""Garbage collection in a long-running process: what start-up built is frozen, young
collections are rarer.

CPython collects its youngest generation every 700 net allocations of container objects;
a gateway allocates thousands a request (JSON, pydantic models, asyncio), so collections
landed inside routing decisions and each scanned everything start-up had built (the
tokenizer, modules, the rings). bench/routing_sim.py at 128 nodes (2-core AMD EPYC):
routing p99 208 -> 164 us on workload c and 192 -> 148 us on a, p99.9 969 -> 268 us and
840 -> 244 us, with the threshold at 50,000 against Python's default.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000


def settle(gen0_threshold: int = GEN0_THRESHOLD) -> None:
    """Freeze every object alive now (no later collection scans them) and collect the
    youngest generation every ``gen0_threshold`` allocations; 0 leaves Python's policy."""
    if gen0_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, gen1, gen2)
