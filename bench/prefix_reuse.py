"""Prefix reuse of the real prefill loop: prompt tokens computed vs the minimum, per policy.

A generated-shared-prefix batch (as SGLang's benchmark: G groups x P prompts, each prompt a
group's system prompt + its own question; sizes scaled down by flags for a CPU) arrives all
at once, in shuffled order, at a PrefillScheduler with the fake transfer backend (a decode
KVManager in the same process answers each room). The minimum is the number of unique
tokens in the union prefix tree (every system prompt once, every question once).
Prints a table and one JSON line per policy:
{"bench": "prefix_reuse", "policy": ..., "computed_tokens": ..., "min_tokens": ..., "ratio": ...}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

# bench/transfer.py would shadow the `transfer` package: keep bench/ off the path.
sys.path[:] = [
    p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))
]

import zmq  # noqa: E402

from common import messages as msg  # noqa: E402
from common.config import ModelConfig, PrefillConfig  # noqa: E402
from common.ipc import bind_pull  # noqa: E402
from common.kv_pool import KVPool, pages_needed  # noqa: E402
from common.model.runner import ModelRunner  # noqa: E402
from prefill_node.scheduler import PrefillScheduler  # noqa: E402
from transfer.fake_backend import FakeBackend  # noqa: E402
from transfer.kv_manager import KVManager  # noqa: E402
from transfer.kv_poll import KVPoll  # noqa: E402

POLICIES = ["fcfs", "lpm", "dfs-weight", "hrrn", "shortest-prefill-first"]


def workload(
    groups: int, per_group: int, system_len: int, question_len: int, vocab: int, seed: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(100, vocab) for _ in range(system_len)] for _ in range(groups)]
    prompts = [
        systems[g] + [rng.randrange(100, vocab) for _ in range(question_len)]
        for g in range(groups)
        for _ in range(per_group)
    ]
    rng.shuffle(prompts)
    return prompts


def run_policy(runner: ModelRunner, policy: str, prompts: list[list[int]], args) -> int:
    config = PrefillConfig(
        model=ModelConfig(page_size=runner.page_size),
        schedule_policy=policy,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
    )
    ctx = zmq.Context.instance()
    n = time.monotonic_ns()
    prefill = KVManager(f"p{n}", "prefill", FakeBackend(f"p{n}"), runner.pool, backend_kind="fake")
    decode_pool = KVPool(runner.layout, 1)
    decode = KVManager(f"d{n}", "decode", FakeBackend(f"d{n}"), decode_pool, backend_kind="fake")
    req_sock, req_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    reply_sock, reply_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    sched = PrefillScheduler(config, runner, prefill, req_sock)
    push = ctx.socket(zmq.PUSH)
    push.connect(req_endpoint)
    receivers = {}
    for i, ids in enumerate(prompts):
        push.send(
            msg.encode(
                msg.GenerateReq(
                    rid=f"r{i}",
                    room=i,
                    input_ids=ids,
                    sampling={"max_new_tokens": 1, "temperature": 0.0},
                    priority=None,
                    routing_key=None,
                    prefill_node_id="p",
                    decode_node_id="d",
                    reply_endpoint=reply_endpoint,
                    arrival_time=time.time(),
                    return_logprob=False,
                )
            )
        )
        receivers[i] = decode.create_receiver(i, prefill.control_endpoint)
    pending_meta = dict(receivers)
    deadline = time.monotonic() + args.timeout
    while any(r.poll() is not KVPoll.Success for r in receivers.values()):
        sched.step()
        decode.poll()
        for room, r in list(pending_meta.items()):
            if r.poll() is KVPoll.WaitingForInput:
                r.send_metadata(list(range(pages_needed(len(prompts[room]), runner.page_size))))
                del pending_meta[room]
        failed = [r for r in receivers.values() if r.poll() is KVPoll.Failed]
        if failed or time.monotonic() > deadline:
            raise RuntimeError(f"{policy}: {len(failed)} rooms failed or timed out")
    while sched.states:  # let the inflight queue settle so pages go back to the cache
        sched.step()
    sched.check_integrity()
    computed = sched.processed_tokens
    push.close(0)
    prefill.close()
    decode.close()
    if sched.tree is not None:
        sched.tree.reset()
    runner.pool.allocator.check_integrity()
    return computed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=8, help="SGLang's benchmark: 64")
    ap.add_argument("--prompts-per-group", type=int, default=8, help="SGLang's: 16")
    ap.add_argument("--system-len", type=int, default=256, help="SGLang's: 2048")
    ap.add_argument("--question-len", type=int, default=32, help="SGLang's: 128")
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--chunked-prefill-size", type=int, default=1024)
    ap.add_argument("--max-prefill-tokens", type=int, default=2048)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args()
    longest = args.system_len + args.question_len
    # A cache big enough for the longest request, and for every group's system prompt.
    total = max(4 * longest, args.groups * args.system_len + 16 * longest)
    runner = ModelRunner.from_path(args.model_path, progress=False, max_total_tokens=total)
    prompts = workload(
        args.groups,
        args.prompts_per_group,
        args.system_len,
        args.question_len,
        runner.spec.vocab_size,
    )
    min_tokens = args.groups * args.system_len + len(prompts) * args.question_len
    rows = []
    for policy in args.policies:
        start = time.perf_counter()
        computed = run_policy(runner, policy, prompts, args)
        rows.append(
            {
                "bench": "prefix_reuse",
                "policy": policy,
                "computed_tokens": computed,
                "min_tokens": min_tokens,
                "ratio": round(computed / min_tokens, 4),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    print(
        f"{len(prompts)} prompts: {args.groups} groups x {args.prompts_per_group}, "
        f"system {args.system_len} + question {args.question_len} tokens; pool {total} tokens"
    )
    print(f"{'policy':24} {'computed':>9} {'minimum':>8} {'ratio':>7} {'s':>6}")
    for r in rows:
        print(
            f"{r['policy']:24} {r['computed_tokens']:9d} {r['min_tokens']:8d} {r['ratio']:7.3f} "
            f"{r['seconds']:6.1f}"
        )
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
