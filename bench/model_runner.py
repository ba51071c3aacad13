"""Prefill and decode speed of pdserve's model runner vs transformers, same run, same tokens.

Prefill: for each dtype and prompt length (128, 1k, 4k, 8k tokens), one prompt through
our extend and through transformers' forward (last-token logits only, no cache kept), the
best of --repeats; tokens/s, the ratio, and the fraction of the matmul bound (linear
layers' and attention's FLOPs / this machine's measured GEMM FLOP/s).
Decode: for each dtype (float32; bfloat16 where the CPU has native bf16) and batch size
(1, 8, 32): prefill the same prompts in both, then time only the decode steps; bound step
time = model FLOPs per decode step / measured GEMM FLOP/s.

Prints the CPU, both tables, then one JSON line per (phase, dtype, size).
Usage: python bench/model_runner.py [--batches 1 8 32] [--new-tokens 32] [--dtypes float32]
       [--prefill-lengths 128 1024 4096 8192] [--skip-decode] [--skip-prefill]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from common.kv_pool import pages_needed  # noqa: E402
from common.model.default_model import default_model_dir  # noqa: E402
from common.model.runner import ExtendRequest, ModelRunner  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402

PROMPTS = [
    "Explain how a paged KV cache lets a server batch requests of different lengths.",
    "Write a short poem about the tide coming in over a rocky shore at dusk.",
    "List three ways to make a Python web service more robust under load.",
    "What is the difference between prefill and decode in LLM inference?",
]


def bf16_supported() -> bool:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def gemm_flops_per_s(dtype: torch.dtype, n: int = 1024, reps: int = 10) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def prefill_flops(spec, n: int) -> float:
    """Matmul FLOPs of prefilling n tokens: the layers' linears and causal attention."""
    linear = spec.decode_flops_per_token() - 2 * spec.vocab_size * spec.hidden_size
    attention = 2 * 2 * spec.num_layers * spec.num_heads * spec.head_dim * n * (n + 1) / 2
    return n * linear + attention + 2 * spec.vocab_size * spec.hidden_size


def prefill_rows(runner: ModelRunner, hf, dtype_name: str, gemm: float, lengths: list[int],
                 repeats: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for n in lengths:
        ids = torch.randint(0, runner.spec.vocab_size, (n,), generator=g).tolist()
        ours, theirs = [], []
        for _ in range(repeats):
            pages = runner.pool.allocator.allocate(pages_needed(n, runner.page_size))
            t = time.perf_counter()
            runner.extend([ExtendRequest(ids, 0, pages)])
            ours.append(time.perf_counter() - t)
            runner.pool.allocator.free(pages)
            with torch.no_grad():
                t = time.perf_counter()
                hf(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
                theirs.append(time.perf_counter() - t)
        t_ours, t_hf = min(ours), min(theirs)
        rows.append({
            "bench": "model_runner", "phase": "prefill", "tokens": n, "dtype": dtype_name,
            "tokens_per_s": round(n / t_ours, 1),
            "transformers_tokens_per_s": round(n / t_hf, 1),
            "ratio_vs_transformers": round(t_hf / t_ours, 3),
            "seconds": round(t_ours, 3), "transformers_seconds": round(t_hf, 3),
            "fraction_of_matmul_bound": round(prefill_flops(runner.spec, n) / gemm / t_ours, 3),
        })
    return rows


def prompt_batch(tokenizer, batch: int) -> list[list[int]]:
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    width = min(len(i) for i in ids)
    # Equal lengths, so transformers needs no padding and both do the same work.
    return [ids[i % len(ids)][-width:] for i in range(batch)]


def ours_decode_seconds(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    ps = runner.page_size
    tables = [runner.pool.allocator.allocate(pages_needed(len(p) + new_tokens, ps)) for p in prompts]
    try:
        logits = runner.extend([ExtendRequest(p, 0, t) for p, t in zip(prompts, tables)]).logits
        outs = [[t] for t in logits.argmax(-1).tolist()]
        start = time.perf_counter()
        for step in range(new_tokens - 1):
            lens = [len(p) + step + 1 for p in prompts]
            logits = runner.decode([o[-1] for o in outs], lens, tables)
            for o, t in zip(outs, logits.argmax(-1).tolist()):
                o.append(t)
        return time.perf_counter() - start, outs
    finally:
        for t in tables:
            runner.pool.allocator.free(t)


def hf_decode_seconds(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t
    return total - prefill, out[:, ids.shape[1]:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtypes", nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=2, help="runs per point; the best is kept")
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=[128, 1024, 4096, 8192])
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_info import describe_cpu

    print(f"cpu: {describe_cpu()}")
    dtypes = args.dtypes or (["float32", "bfloat16"] if bf16_supported() else ["float32"])
    if "bfloat16" not in dtypes and not bf16_supported():
        print("# bfloat16 skipped: this CPU has no native bf16 (avx512_bf16/amx_bf16)")

    from transformers import AutoModelForCausalLM

    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    max_batch = max(args.batches)
    rows: list[dict] = []
    prefill: list[dict] = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        gemm = gemm_flops_per_s(dtype)
        longest = max(args.prefill_lengths) if not args.skip_prefill else 0
        runner = ModelRunner.from_path(None, progress=False, dtype=dtype_name,
                                       max_total_tokens=max(max_batch * 256, longest + 16))
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        hf.eval()
        hf.generation_config.eos_token_id = None  # exactly new_tokens tokens on both sides
        flops_per_token = runner.spec.decode_flops_per_token()
        if not args.skip_prefill:
            prefill += prefill_rows(runner, hf, dtype_name, gemm, args.prefill_lengths,
                                    args.repeats)
        for batch in ([] if args.skip_decode else args.batches):
            prompts = prompt_batch(tokenizer, batch)
            ours, hf_s, same = [], [], True
            for _ in range(args.repeats):
                t_ours, out_ours = ours_decode_seconds(runner, prompts, args.new_tokens)
                t_hf, out_hf = hf_decode_seconds(hf, prompts, args.new_tokens)
                ours.append(t_ours)
                hf_s.append(t_hf)
                same = same and out_ours == out_hf
            steps = args.new_tokens - 1
            tok_s = batch * steps / min(ours)
            hf_tok_s = batch * steps / min(hf_s)
            step_s = min(ours) / steps
            bound_s = batch * flops_per_token / gemm
            rows.append({
                "bench": "model_runner", "phase": "decode", "dtype": dtype_name, "batch": batch,
                "tokens_per_s": round(tok_s, 1),
                "transformers_tokens_per_s": round(hf_tok_s, 1),
                "ratio_vs_transformers": round(tok_s / hf_tok_s, 3),
                "fraction_of_matmul_bound": round(bound_s / step_s, 3),
                "step_ms": round(step_s * 1e3, 1),
                "matmul_bound_ms": round(bound_s * 1e3, 1),
                "gemm_gflops": round(gemm / 1e9, 1),
                "greedy_outputs_equal": same,
                "spread_ours_pct": round(100 * (max(ours) - min(ours)) / statistics.mean(ours), 1),
            })
        del runner, hf

    if prefill:
        print(f"prefill\n{'dtype':9} {'tokens':>6} {'ours tok/s':>11} {'hf tok/s':>9} "
              f"{'ratio':>6} {'ours s':>8} {'hf s':>8} {'of bound':>9}")
        for r in prefill:
            print(f"{r['dtype']:9} {r['tokens']:6d} {r['tokens_per_s']:11.1f} "
                  f"{r['transformers_tokens_per_s']:9.1f} {r['ratio_vs_transformers']:6.2f} "
                  f"{r['seconds']:8.2f} {r['transformers_seconds']:8.2f} "
                  f"{r['fraction_of_matmul_bound']:9.2f}")
    if rows:
        print(f"decode\n{'dtype':9} {'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} "
              f"{'ratio':>6} {'step ms':>8} {'bound ms':>9} {'of bound':>9} {'equal':>6}")
    for r in rows:
        print(f"{r['dtype']:9} {r['batch']:5d} {r['tokens_per_s']:11.1f} "
              f"{r['transformers_tokens_per_s']:9.1f} {r['ratio_vs_transformers']:6.2f} "
              f"{r['step_ms']:8.1f} {r['matmul_bound_ms']:9.1f} "
              f"{r['fraction_of_matmul_bound']:9.2f} {str(r['greedy_outputs_equal']):>6}")
    for r in prefill + rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
