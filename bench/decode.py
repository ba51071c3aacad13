"""Decode throughput and inter-token latency, KV arriving by transfer vs local decoding, same run.

Transfer path ("pd"): the real prefill loop (PrefillScheduler) and decode loop
(DecodeScheduler) in ONE process, joined by the loopback transfer backend: the prompt's
KV pages are copied from the prefill pool into the decode pool, the first token comes in
the aux data, and the decode node continues with continuous batching and streams
TokenChunks to a gateway socket. No NIXL and no second process (transport
"loopback-in-process"); bench/transfer.py measures the NIXL path itself.
Local baseline: the decode node's own ModelRunner decoding the same prompts with no
transfer and no scheduler: one batched extend, then one runner.decode per step, greedy.

For each batch size B, B requests arrive at once (same-length chat prompts, greedy,
ignore_eos, N new tokens). tokens_per_s = output tokens after each request's first /
(last token time - first token time); ITL = gaps between consecutive tokens of a request
(pd: on the decode node's clock, the time spent in its step() calls, since the prefill
loop sharing this thread would run on another node; a token is stamped when the step
that sent it ends, a first token when the step that committed its transfer began). The decode
node reserves N tokens per request (--num-reserved-decode-tokens N) so all B run in one batch,
as in the baseline.
Prints a table, then one JSON line per batch size.
Usage: python bench/decode.py [--batches 1 8 32] [--new-tokens 32] [--repeats 2] [--threads N]
       python bench/decode.py --host-time [...]   the host's work per decode step against a
                                                  baseline revision (bench/decode_host.py)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time

# bench/transfer.py would shadow the transfer package: keep bench/ off the path.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import zmq

from common import messages as msg
from common.config import DecodeConfig, ModelConfig, PrefillConfig
from common.ipc import bind_pull, recv_messages
from common.kv_pool import pages_needed
from common.model.default_model import default_model_dir
from common.model.loader import load_spec, load_state_dict
from common.model.runner import ExtendRequest, ModelRunner
from common.tokenizer import Tokenizer
from decode_node.scheduler import DecodeScheduler
from prefill_node.scheduler import PrefillScheduler
from transfer.kv_manager import KVManager
from transfer.loopback_backend import LoopbackBackend

PROMPTS = [
    "Explain how a paged KV cache lets a server batch requests of different lengths.",
    "Write a short poem about the tide coming in over a rocky shore at dusk.",
    "List three ways to make a Python web service more robust under load.",
    "What is the difference between prefill and decode in LLM inference?",
]
PAGE = 16
_rooms = itertools.count(1)


def prompt_batch(tokenizer: Tokenizer, batch: int) -> list[list[int]]:
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    width = min(len(i) for i in ids)
    return [ids[i % len(ids)][-width:] for i in range(batch)]


def summarize(times: dict[int, list[float]]) -> tuple[float, list[float]]:
    """(tokens/s after each request's first token, inter-token gaps in seconds)."""
    first = min(t[0] for t in times.values())
    last = max(t[-1] for t in times.values())
    num = sum(len(t) - 1 for t in times.values())
    gaps = [b - a for t in times.values() for a, b in itertools.pairwise(t)]
    return num / (last - first), gaps


def local_run(runner: ModelRunner, prompts: list[list[int]], new_tokens: int):
    tables = [
        runner.pool.allocator.allocate(pages_needed(len(p) + new_tokens, PAGE)) for p in prompts
    ]
    try:
        logits = runner.extend([ExtendRequest(p, 0, t) for p, t in zip(prompts, tables)]).logits
        now = time.perf_counter()
        outs = [[t] for t in logits.argmax(-1).tolist()]
        times = {i: [now] for i in range(len(prompts))}
        for step in range(new_tokens - 1):
            lens = [len(p) + step + 1 for p in prompts]
            logits = runner.decode([o[-1] for o in outs], lens, tables)
            now = time.perf_counter()
            for i, (o, t) in enumerate(zip(outs, logits.argmax(-1).tolist())):
                o.append(t)
                times[i].append(now)
        return outs, times
    finally:
        for t in tables:
            runner.pool.allocator.free(t)


class PDPair:
    """Prefill node + decode node in this process, loopback transfer, a gateway reply socket."""

    def __init__(
        self, model_dir, tokenizer: Tokenizer, max_batch: int, prompt_len: int, new_tokens: int
    ) -> None:
        spec = load_spec(model_dir)
        weights = load_state_dict(model_dir, torch.float32, False)
        tokens = max_batch * (prompt_len + new_tokens + PAGE) + 4 * PAGE
        self.prefill_runner = ModelRunner(spec, weights, page_size=PAGE, max_total_tokens=tokens)
        self.runner = ModelRunner(spec, weights, page_size=PAGE, max_total_tokens=tokens)
        ctx: zmq.Context = zmq.Context.instance()
        self.pkv = KVManager(
            "bench-p",
            "prefill",
            LoopbackBackend("bench-p"),
            self.prefill_runner.pool,
            backend_kind="loopback",
        )
        self.dkv = KVManager(
            "bench-d",
            "decode",
            LoopbackBackend("bench-d"),
            self.runner.pool,
            backend_kind="loopback",
        )
        p_sock, p_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
        d_sock, d_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
        self.reply_sock, self.reply_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
        model = ModelConfig(page_size=PAGE)
        # All B requests in one prefill round: no in-batch deferral of the repeated prompts.
        prefill_config = PrefillConfig(
            model=model, in_batch_prefix_caching_deprioritize_threshold=1 << 30
        )
        self.prefill = PrefillScheduler(prefill_config, self.prefill_runner, self.pkv, p_sock)
        self.decode = DecodeScheduler(
            DecodeConfig(
                model=model, num_reserved_decode_tokens=new_tokens, max_running_requests=max_batch
            ),
            self.runner,
            self.dkv,
            d_sock,
            tokenizer,
            lambda _node: self.pkv.control_endpoint,
        )
        self.to_prefill, self.to_decode = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
        self.to_prefill.connect(p_endpoint)
        self.to_decode.connect(d_endpoint)

    def run(self, prompts: list[list[int]], new_tokens: int, timeout_s: float = 600.0):
        rids = {}
        for i, ids in enumerate(prompts):
            room = next(_rooms)
            rids[f"r{room}"] = i
            g = msg.GenerateReq(
                rid=f"r{room}",
                room=room,
                input_ids=ids,
                sampling={"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True},
                priority=None,
                routing_key=None,
                prefill_node_id="p",
                decode_node_id="d",
                reply_endpoint=self.reply_endpoint,
                arrival_time=time.time(),
                return_logprob=False,
            )
            self.to_prefill.send(msg.encode(g))
            self.to_decode.send(msg.encode(g))
        outs: dict[int, list[int]] = {i: [] for i in rids.values()}
        times: dict[int, list[float]] = {i: [] for i in rids.values()}
        num_done, deadline = 0, time.monotonic() + timeout_s
        clock = 0.0  # the decode node's time: seconds spent in decode.step() (and reading replies)
        while num_done < len(prompts):
            self.prefill.step()  # another node's work in a real deployment: not on the clock
            start = time.perf_counter()
            self.decode.step()
            messages = recv_messages(self.reply_sock)
            before, clock = clock, clock + time.perf_counter() - start
            for m in messages:
                if isinstance(m, msg.TokenChunk):
                    i = rids[m.rid]
                    # A first token is committed when its transfer completes, before the
                    # step's decode forward; every later token comes out of that forward.
                    times[i] += [before if not outs[i] else clock] * len(m.token_ids)
                    outs[i] += m.token_ids
                elif isinstance(m, msg.ReqFinished):
                    num_done += 1
                else:
                    raise RuntimeError(f"unexpected reply: {m}")  # noqa: TRY004
            if time.monotonic() > deadline:
                raise TimeoutError("the pd run did not finish")
        assert self.decode.is_idle() and self.runner.pool.allocator.num_used_pages == 0
        return [outs[i] for i in range(len(prompts))], times


def main() -> None:
    if "--host-time" in sys.argv:
        argv = [a for a in sys.argv[1:] if a != "--host-time"]
        host = os.path.join(_HERE, "decode_host.py")
        raise SystemExit(subprocess.call([sys.executable, host, *argv]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="runs per point; the fastest is kept")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's); 1 is steadier on a busy small machine",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    width = len(prompt_batch(tokenizer, 1)[0])
    pair = PDPair(model_dir, tokenizer, max(args.batches), width, args.new_tokens)
    pair.run(prompt_batch(tokenizer, 1), 4)  # warm-up: handshake, allocator, kernels
    local_run(pair.runner, prompt_batch(tokenizer, 1), 4)
    rows = []
    for batch in args.batches:
        prompts = prompt_batch(tokenizer, batch)
        best_pd, best_local, same = None, None, True
        for _ in range(args.repeats):
            out_local, t_local = local_run(pair.runner, prompts, args.new_tokens)
            out_pd, t_pd = pair.run(prompts, args.new_tokens)
            same = same and out_local == out_pd
            pd_run, local = summarize(t_pd), summarize(t_local)
            best_pd = pd_run if best_pd is None or pd_run[0] > best_pd[0] else best_pd
            best_local = local if best_local is None or local[0] > best_local[0] else best_local
        assert best_pd is not None and best_local is not None
        (tps, gaps), (local_tps, local_gaps) = best_pd, best_local
        rows.append(
            {
                "bench": "decode",
                "batch": batch,
                "tokens_per_s": round(tps, 1),
                "itl_p50_ms": round(1e3 * statistics.median(gaps), 2),
                "itl_p99_ms": round(1e3 * _p99(gaps), 2),
                "ratio_vs_local": round(tps / local_tps, 3),
                "local_tokens_per_s": round(local_tps, 1),
                "local_itl_p50_ms": round(1e3 * statistics.median(local_gaps), 2),
                "local_itl_p99_ms": round(1e3 * _p99(local_gaps), 2),
                "greedy_outputs_equal": same,
                "transport": "loopback-in-process",
                "model": "SmolLM2-135M-Instruct",
                "dtype": "float32",
                "prompt_tokens": width,
                "new_tokens": args.new_tokens,
                "torch_threads": torch.get_num_threads(),
            }
        )
    print(
        f"{'batch':>5} {'pd tok/s':>9} {'local tok/s':>12} {'ratio':>6} {'itl p50':>8} "
        f"{'itl p99':>8} {'local p50':>10} {'local p99':>10} {'equal':>6}"
    )
    for r in rows:
        print(
            f"{r['batch']:5d} {r['tokens_per_s']:9.1f} {r['local_tokens_per_s']:12.1f} "
            f"{r['ratio_vs_local']:6.3f} {r['itl_p50_ms']:8.2f} {r['itl_p99_ms']:8.2f} "
            f"{r['local_itl_p50_ms']:10.2f} {r['local_itl_p99_ms']:10.2f} "
            f"{r['greedy_outputs_equal']!s:>6}"
        )
    for r in rows:
        print(json.dumps(r))


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


if __name__ == "__main__":
    main()
