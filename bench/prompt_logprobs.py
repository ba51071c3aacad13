"""What the prompt's logprobs (completions' echo + logprobs) cost a prefill, side by side.

    python bench/prompt_logprobs.py [--tokens 256 1024 2048] [--top 5] [--rounds 5]
        [--device cpu] [--dtype float32] [--threads N]

The built-in model's ModelRunner, one request's extend of --tokens random prompt tokens:
``plain`` (the last position's logits, what a prefill computes) against ``logprobs`` (every
position's logprob of the next prompt token and its top --top, as
prefill_node/prompt_logprobs.py asks), alternating, median of --rounds after a warm-up.
Prints the CPU (or GPU), one line per length with the ratio, and one JSON line per length:
{"bench": "prompt_logprobs", ...}. A request with them also computes its cached prefix
again: that cost is the prefix's share of the prompt, not measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu_info import describe_cpu  # noqa: E402

from common.kv_pool import pages_needed  # noqa: E402
from common.model.runner import ExtendRequest, ModelRunner  # noqa: E402


def _timed(runner: ModelRunner, req: ExtendRequest) -> float:
    start = time.perf_counter()
    out = runner.extend([req])
    out.done.synchronize()
    if out.target_logprobs and out.target_logprobs[0] is not None:
        out.target_logprobs[0].tolist()  # what the prefill node reads back
        top = out.top_logprobs[0]
        if top is not None:
            top[0].tolist(), top[1].tolist()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else describe_cpu()
    print(f"device: {where}; {args.dtype}", flush=True)
    runner = ModelRunner.from_path(
        None, progress=False, device=args.device, dtype=args.dtype, max_total_tokens=4096
    )
    runner.warmup()
    vocab = runner.spec.vocab_size
    for n in args.tokens:
        ids = torch.randint(100, vocab - 1, (n,), generator=torch.Generator().manual_seed(n))
        prompt = ids.tolist()
        pages = runner.pool.allocator.allocate(pages_needed(n, runner.page_size))
        plain = ExtendRequest(prompt, 0, pages)
        scored = ExtendRequest(prompt, 0, pages, logprob_targets=prompt[1:], top_logprobs=args.top)
        times: dict[str, list[float]] = {"plain": [], "logprobs": []}
        _timed(runner, plain), _timed(runner, scored)  # warm-up of this length
        for _ in range(args.rounds):
            times["plain"].append(_timed(runner, plain))
            times["logprobs"].append(_timed(runner, scored))
        runner.pool.allocator.free(pages)
        plain_ms = statistics.median(times["plain"]) * 1e3
        scored_ms = statistics.median(times["logprobs"]) * 1e3
        print(
            f"{n:5d} tokens: plain {plain_ms:8.1f} ms, with prompt logprobs {scored_ms:8.1f} ms, "
            f"ratio {scored_ms / plain_ms:.2f}x",
            flush=True,
        )
        row = {
            "bench": "prompt_logprobs",
            "tokens": n,
            "top": args.top,
            "device": args.device,
            "dtype": args.dtype,
            "plain_ms": round(plain_ms, 2),
            "logprobs_ms": round(scored_ms, 2),
            "ratio": round(scored_ms / plain_ms, 3),
        }
        print(json.dumps(row))


if __name__ == "__main__":
    main()
