"""Time of one calc_priority round per policy and queue size, on the shared scheduling workload.

Procedure (issue 4): insert the 88 cache sequences of sched-workload.npz into a radix cache
(pages from a PageAllocator); the queue is q{n} in arrival order (request i arrived i-th,
arrival_processed_tokens = 64 i). For 30 rounds: processed tokens = 64 (n + 8 r) + 64;
time one calc_priority; admit the first 8 of the sorted queue (insert their full token
sequences, as the adder + prefill would); append 8 new arrivals taken in order,
cyclically, from q5000 (q1000 when n = 5000). Reports the first round, the median of
rounds 1-29, the policy applied, and whether round 0's in-batch dedup put every
cold-group follower after everything else with each group's leader ahead.

The machine is shared and noisy: each (policy, n) runs --repeat times from scratch and
the best run (lowest median) is reported, with the median CPU time of this process too
(process_time: what the sort costs when it has to wait for a core). Prints a table, then one
JSON line per (policy, n).
Usage: python bench/calc_priority.py [--data PATH] [--sizes 64 128 1000 5000]
       [--policies fcfs lpm ...] [--page-size 16] [--rounds 30] [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np

from common.kv_pool import PageAllocator
from common.radix_cache import RadixCache
from prefill_node.request import Req
from prefill_node.schedule_policy import SchedulePolicy

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "bench-data" / "sched-workload.npz"
POLICIES = ("fcfs", "lpm", "dfs-weight", "hrrn", "shortest-prefill-first")
ADMIT, TOKENS_PER_ARRIVAL = 8, 64
COLD = 2  # q{n}_kind of a cold shared prefix


class Queue:
    """One q{n} of the workload: flat tokens + offsets."""

    def __init__(self, data: np.lib.npyio.NpzFile, n: int) -> None:
        self.tokens = data[f"q{n}_tokens"]
        self.offsets = data[f"q{n}_offsets"]
        self.max_new = data[f"q{n}_max_new_tokens"]
        self.kind = data[f"q{n}_kind"]
        self.group = data[f"q{n}_group"]
        self.n = n

    def req(self, i: int, arrival: int, rid: str) -> Req:
        ids = self.tokens[self.offsets[i] : self.offsets[i + 1]]
        return Req(
            rid,
            arrival,
            ids.tolist(),
            int(self.max_new[i]),
            arrival_time=float(arrival),
            wait_queue_entry_time=float(arrival),
            arrival_processed_tokens=TOKENS_PER_ARRIVAL * arrival,
            key=ids.astype(np.int32).tobytes(),
        )


def admit(policy: SchedulePolicy, tree: RadixCache, alloc: PageAllocator, req: Req) -> None:
    """What the adder and the prefill do for one request: reuse its match, allocate the
    rest, insert the full sequence, free the duplicates and the partial tail page."""
    match = policy.match_prefix_for_req(req)
    assert match is not None
    ps = tree.page_size
    num_prompt_pages = -(-len(req.origin_input_ids) // ps)
    own = len(match.page_ids)
    pages = match.page_ids + alloc.allocate(num_prompt_pages - own)
    present = tree.insert(req.key, pages) // ps
    alloc.free(pages[own:present] + pages[len(req.origin_input_ids) // ps :])


def dedup_ok(queue: list[Req], kind_of: dict[str, int], group_of: dict[str, int]) -> bool:
    """Cold-group followers exactly at the back; each group's leader (first arrival) ahead."""
    leaders: dict[int, str] = {}
    for rid in sorted((r.rid for r in queue), key=lambda rid: int(rid[1:])):
        if kind_of[rid] == COLD:
            leaders.setdefault(group_of[rid], rid)
    lead = set(leaders.values())
    followers = {rid for rid in kind_of if kind_of[rid] == COLD and rid not in lead}
    tail = {r.rid for r in queue[len(queue) - len(followers) :]} if followers else set()
    return tail == followers and all(rid not in tail for rid in lead)


def run(data: np.lib.npyio.NpzFile, n: int, policy_name: str, page_size: int, rounds: int) -> dict:
    cache_tokens, cache_offsets = data["cache_tokens"], data["cache_offsets"]
    queue_data = Queue(data, n)
    more = Queue(data, 1000 if n == 5000 else 5000)
    max_len = int(np.diff(more.offsets).max()) + int(np.diff(queue_data.offsets).max())
    alloc = PageAllocator((len(cache_tokens) + rounds * ADMIT * max_len) // page_size + 4096)
    tree = RadixCache(page_size, alloc)
    for i in range(len(cache_offsets) - 1):
        seq = cache_tokens[cache_offsets[i] : cache_offsets[i + 1]]
        pages = alloc.allocate(-(-len(seq) // page_size))
        present = tree.insert(seq.astype(np.int32).tobytes(), pages) // page_size
        alloc.free(pages[:present] + pages[len(seq) // page_size :])
    policy = SchedulePolicy(policy_name, tree)
    queue = [queue_data.req(i, i, f"q{i}") for i in range(n)]
    kind_of = {f"q{i}": int(queue_data.kind[i]) for i in range(n)}
    group_of = {f"q{i}": int(queue_data.group[i]) for i in range(n)}
    times, cpu_times, applied, is_dedup_ok, rematches = [], [], set(), None, []
    # Admitted requests live on in the running batch: they are not freed during a sort.
    running: list[Req] = []
    next_arrival, next_more = n, 0
    gc.collect()
    for r in range(rounds):
        processed = TOKENS_PER_ARRIVAL * (n + ADMIT * r) + TOKENS_PER_ARRIVAL
        start, cpu_start = time.perf_counter(), time.process_time()
        result = policy.calc_priority(queue, None, processed)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
        applied.add(result.policy)
        rematches.append(result.num_rematches)
        if r == 0 and policy_name != "fcfs":
            is_dedup_ok = dedup_ok(queue, kind_of, group_of)
        for req in queue[:ADMIT]:
            admit(policy, tree, alloc, req)
        running += queue[:ADMIT]
        del queue[:ADMIT]
        for _ in range(ADMIT):
            queue.append(more.req(next_more % more.n, next_arrival, f"a{next_arrival}"))
            next_arrival += 1
            next_more += 1
    tree.check_integrity()
    return {
        "bench": "calc_priority",
        "policy": policy_name,
        "n": n,
        "first_ms": round(times[0] * 1e3, 3),
        "median_ms": round(statistics.median(times[1:]) * 1e3, 3),
        "cpu_median_ms": round(statistics.median(cpu_times[1:]) * 1e3, 3),
        "active_policy": "/".join(sorted(applied)),
        "dedup_ok": is_dedup_ok,
        "median_rematches": statistics.median(rematches[1:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 1000, 5000])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    data = np.load(args.data)
    rows = []
    for n in args.sizes:
        for policy in args.policies:
            runs = [run(data, n, policy, args.page_size, args.rounds) for _ in range(args.repeat)]
            rows.append(min(runs, key=lambda row: row["median_ms"]))
    print(f"calc_priority, page size {args.page_size}, {args.rounds} rounds, best of {args.repeat}")
    head = (
        f"{'policy':<24}{'n':>6}{'first ms':>10}{'median ms':>11}{'cpu ms':>8}"
        f"  {'applied':<24}dedup ok"
    )
    print(head)
    for row in rows:
        print(
            f"{row['policy']:<24}{row['n']:>6}{row['first_ms']:>10.3f}{row['median_ms']:>11.3f}"
            f"{row['cpu_median_ms']:>8.3f}"
            f"  {row['active_policy']:<24}{row['dedup_ok']}"
        )
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
