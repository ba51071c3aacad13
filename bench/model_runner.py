"""Prefill and decode speed of pdserve's model runner vs transformers, same run, same tokens.

Prefill: for each dtype and prompt length (128, 1k, 4k, 8k tokens), one prompt through
our extend and through transformers' forward (last-token logits only, no cache kept), the
best of --repeats (of 2048 / tokens at least, for short prompts); tokens/s, the ratio,
and the fraction of the matmul bound (linear
layers' and attention's FLOPs / this machine's measured GEMM FLOP/s); side by side, ours
with torch's flash attention on copies in place of the paged prefill kernel (vs torch).
The product kernels are chosen first, as a node's warm-up chooses them (common.model.cpu.gemm;
the kernel column); bench/kernel_tables.py times each kernel per row count.
Decode: for each dtype (float32; bfloat16 where the CPU has native bf16) and batch size
(1, 8, 32): prefill the same prompts in both, then time only the decode steps; side by side,
also our decode on always weight-major products (vs wm) and on torch's ops without the C
kernels of common.model.cpu.library (vs torch), each as a ratio of their time to ours. The bound
step time is the larger of compute (model FLOPs per step / measured GEMM FLOP/s) and memory
(weight and KV bytes one step reads / measured read bandwidth): decode at small batches
streams every weight once per step.
Agreement (dtypes other than float32): greedy continuations of --new-tokens over the 16
prompts of greedy_prompts.py, ours in that dtype and transformers' in it, each against
transformers' float32: the share matching at the first token and over all tokens; and
teacher-forced along float32's greedy path, the share of steps choosing the same token
and the mean KL divergence from float32's distribution.

--emulate-avx2 runs it all as on an AVX2-only CPU (an AMD EPYC Zen 3), on a CPU with
AVX-512: the bench runs itself again with torch held to AVX2 (ATEN_CPU_CAPABILITY,
ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) and our kernels' avx2 variant (x86-64-v3), in
float32 only. Only the instructions are emulated: the caches and the memory are this CPU's,
so every JSON line says which it was ("isa": "native" or "avx2-emulated", and
"torch_cpu_capability" as torch reports it).

Prints the CPU, the tables, then one JSON line per (phase, dtype, size).
Usage: python bench/model_runner.py [--batches 1 8 32] [--new-tokens 32] [--dtypes float32]
       [--prefill-lengths 128 1024 4096 8192] [--skip-decode] [--skip-prefill]
       [--skip-agreement] [--emulate-avx2]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from cpu_info import describe_cpu  # noqa: E402
from greedy_prompts import (  # noqa: E402
    agreement,
    chat_ids,
    forced_agreement,
    forced_logits,
    greedy,
)
from model_reference import (  # noqa: E402
    gemm_flops_per_s,
    hf_decode_seconds,
    hf_forced_logits,
    hf_greedy,
    read_bytes_per_s,
)

from common.cpu_features import has_native_bf16  # noqa: E402
from common.kv_pool import pages_needed  # noqa: E402
from common.model.attention import AttentionBackend, TorchAttention  # noqa: E402
from common.model.cpu import library as cpu_kernels  # noqa: E402
from common.model.cpu.gemm import (  # noqa: E402
    HAND_WRITTEN,
    WEIGHT_MAJOR,
    KernelChooser,
    bucket_of,
)
from common.model.default_model import default_model_dir  # noqa: E402
from common.model.runner import ExtendRequest, ModelRunner  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402

# What holds torch's CPU kernels to AVX2: ATen's dispatch, oneDNN's and MKL's (read as each
# first runs, so set before the process starts)
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def emulate_avx2() -> None:
    """Run this bench again with torch held to AVX2 (AVX2_ENV), unless this is that run;
    there, load our kernels' AVX2 variant and check torch took it."""
    if any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})
    cpu_kernels.use_variant("avx2")
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        raise SystemExit(f"--emulate-avx2: torch runs {capability} kernels, not AVX2")


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of the matrices one decode step reads (every layer's, the LM head's)."""
    return sum(t.numel() * t.element_size() for t in runner.model.weight_tensors())


def kv_bytes(runner: ModelRunner, tokens: int) -> int:
    """Bytes of KV attention reads over `tokens` cached tokens (all layers, K and V)."""
    return runner.layout.bytes_per_page * tokens // runner.page_size


def kernel_choice(chooser, rows: int) -> str:
    """The product kernel the runner settled on for `rows` (see common.model.cpu.gemm)."""
    if chooser is None:
        return "row_major"
    return chooser.choices().get(bucket_of(rows), "exploring")


def prefill_flops(spec, n: int) -> float:
    """Matmul FLOPs of prefilling n tokens: the layers' linears and causal attention."""
    linear = spec.decode_flops_per_token() - 2 * spec.vocab_size * spec.hidden_size
    attention = 2 * 2 * spec.num_layers * spec.num_heads * spec.head_dim * n * (n + 1) / 2
    return n * linear + attention + 2 * spec.vocab_size * spec.hidden_size


def _prefill_seconds(runner: ModelRunner, ids: list[int]) -> float:
    pages = runner.pool.allocator.allocate(pages_needed(len(ids), runner.page_size))
    try:
        t = time.perf_counter()
        runner.extend([ExtendRequest(ids, 0, pages)])
        return time.perf_counter() - t
    finally:
        runner.pool.allocator.free(pages)


def prefill_rows(
    runner: ModelRunner,
    hf,
    dtype_name: str,
    gemm: float,
    lengths: list[int],
    repeats: int,
    torch_ops: bool,
) -> list[dict]:
    """Per length: ours, transformers' and (if `torch_ops` and the runner has the paged
    prefill kernel) ours on torch's attention, interleaved, best of `repeats` (or of
    2048 / n, if more) each."""
    rows = []
    g = torch.Generator().manual_seed(0)
    plain_too = torch_ops and runner.model.attention.prefill_kernel is not None
    for n in lengths:
        ids = torch.randint(0, runner.spec.vocab_size, (n,), generator=g).tolist()
        _prefill_seconds(runner, ids)  # untimed: first-call costs
        ours, theirs, plain = [], [], []
        # short prompts take tenths of a second, where the machine's noise is as large as
        # the difference: more runs of both, interleaved, keep the best of each steady
        for _ in range(max(repeats, -(-2048 // n))):
            ours.append(_prefill_seconds(runner, ids))
            with torch.no_grad():
                t = time.perf_counter()
                hf(torch.tensor([ids]), use_cache=False, logits_to_keep=1)
                theirs.append(time.perf_counter() - t)
            if plain_too:
                with model_swapped(runner, attention=_without_prefill_kernel(runner)):
                    plain.append(_prefill_seconds(runner, ids))
        t_ours, t_hf = min(ours), min(theirs)
        rows.append(
            {
                "bench": "model_runner",
                "phase": "prefill",
                "tokens": n,
                "dtype": dtype_name,
                "tokens_per_s": round(n / t_ours, 1),
                "transformers_tokens_per_s": round(n / t_hf, 1),
                "ratio_vs_transformers": round(t_hf / t_ours, 3),
                "seconds": round(t_ours, 3),
                "transformers_seconds": round(t_hf, 3),
                "fraction_of_matmul_bound": round(prefill_flops(runner.spec, n) / gemm / t_ours, 3),
                "gemm_kernel": kernel_choice(runner.model.chooser, n),
                # the paged prefill kernel against torch's flash kernel on copies (what ran before)
                "prefill_attention": runner.model.attention.prefill_kernel is not None,
                "ratio_vs_torch_attention": round(min(plain) / t_ours, 3) if plain else None,
            }
        )
    return rows


def prompt_batch(tokenizer, batch: int) -> list[list[int]]:
    ids = chat_ids(tokenizer)
    width = min(len(i) for i in ids)
    # Equal lengths, so transformers needs no padding and both do the same work.
    return [ids[i % len(ids)][-width:] for i in range(batch)]


def ours_decode_seconds(
    runner: ModelRunner, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    ps = runner.page_size
    tables = [
        runner.pool.allocator.allocate(pages_needed(len(p) + new_tokens, ps)) for p in prompts
    ]
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


@contextlib.contextmanager
def model_swapped(runner: ModelRunner, **attrs):
    """The runner's model with some attributes replaced for a side-by-side run, then restored."""
    saved = {name: getattr(runner.model, name) for name in attrs}
    for name, value in attrs.items():
        setattr(runner.model, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(runner.model, name, value)


def _without_prefill_kernel(runner: ModelRunner) -> AttentionBackend:
    """The runner's CPU attention with prefill on torch's flash passes (decode unchanged)."""
    attention = copy.copy(runner.model.attention)
    attention.prefill_kernel = None  # type: ignore[attr-defined]
    return attention


def torch_attention(runner: ModelRunner) -> AttentionBackend:
    """Attention over gathered pages and copies (SDPA), as before the C kernels."""
    return TorchAttention(runner.spec, runner.model.dtype, runner.device)


def fixed_kernel_seconds(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> float:
    """Our decode with every product weight-major, the kernel used before they were chosen."""
    with model_swapped(
        runner, chooser=KernelChooser((WEIGHT_MAJOR,)), head_chooser=KernelChooser((WEIGHT_MAJOR,))
    ):
        return ours_decode_seconds(runner, prompts, new_tokens)[0]


def torch_ops_seconds(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> float:
    """Our decode on torch's ops only, as before the C kernels (common.model.cpu.library):
    attention over gathered pages, the small steps unfused, neither hand-written product.
    Where the AMX product replaced oneDNN's packed weights the choice is row- or
    weight-major only (with --no-cpu-kernels the runner packs for oneDNN instead)."""
    assert runner.model.chooser is not None  # the CPU
    kernels = tuple(k for k in runner.model.chooser.kernels if k not in HAND_WRITTEN)
    with model_swapped(
        runner,
        attention=torch_attention(runner),
        fused=None,
        chooser=KernelChooser(kernels),
        head_chooser=KernelChooser(kernels),
    ):
        ours_decode_seconds(runner, prompts, new_tokens)  # the fresh choosers measure first
        return ours_decode_seconds(runner, prompts, new_tokens)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtypes", nargs="+", default=None)
    ap.add_argument("--repeats", type=int, default=2, help="runs per point; the best is kept")
    ap.add_argument("--prefill-lengths", type=int, nargs="+", default=[128, 1024, 4096, 8192])
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument(
        "--skip-fixed-kernel",
        action="store_true",
        help="leave out the decode runs on always weight-major products",
    )
    ap.add_argument(
        "--skip-torch-ops",
        action="store_true",
        help="leave out our runs on torch's ops only (decode without the C kernels, "
        "prefill on torch's flash attention)",
    )
    ap.add_argument(
        "--emulate-avx2",
        action="store_true",
        help="torch held to AVX2 and our kernels built for it, in float32: an "
        "AVX2-only CPU's instructions on this one's caches and memory",
    )
    args = ap.parse_args()
    if args.emulate_avx2:
        emulate_avx2()
    isa = "avx2-emulated" if args.emulate_avx2 else "native"
    print(
        f"cpu: {describe_cpu()}; CPU kernels: {cpu_kernels.loaded_variant()} variant"
        + (" (emulating AVX2: torch's kernels AVX2, ours x86-64-v3)" if args.emulate_avx2 else "")
    )
    bf16 = has_native_bf16() and not args.emulate_avx2
    dtypes = args.dtypes or (["float32", "bfloat16"] if bf16 else ["float32"])
    if "bfloat16" not in dtypes and not bf16:
        print(
            "# bfloat16 skipped: no native bf16 (avx512_bf16/amx_bf16)"
            + (" in an AVX2 emulation" if args.emulate_avx2 else " on this CPU")
        )

    from transformers import AutoModelForCausalLM

    model_dir = default_model_dir()
    tokenizer = Tokenizer.from_pretrained(model_dir)
    max_batch = max(args.batches)
    rows: list[dict] = []
    prefill: list[dict] = []
    agree: list[dict] = []
    bandwidth = read_bytes_per_s()
    chat = chat_ids(tokenizer)
    want_agreement = not args.skip_agreement and any(d != "float32" for d in dtypes)
    reference: list[list[int]] | None = None  # transformers' float32 greedy over `chat`
    reference_logits: list | None = None  # its logits along that greedy path
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name)
        gemm = gemm_flops_per_s(dtype)
        longest = max(args.prefill_lengths) if not args.skip_prefill else 0
        runner = ModelRunner.from_path(
            None,
            progress=False,
            dtype=dtype_name,
            max_total_tokens=max(max_batch * 256, longest + 16),
        )
        t = time.perf_counter()
        # As a node's warm-up: every bucket chosen, then fixed; the weights' other copies
        # kept for the side-by-side runs on torch's ops.
        runner.choose_kernels(keep_all_copies=True)
        print(f"# {dtype_name}: kernels chosen at warm-up in {time.perf_counter() - t:.1f} s")
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        hf.eval()
        hf.generation_config.eos_token_id = None  # exactly new_tokens tokens on both sides
        flops_per_token = runner.spec.decode_flops_per_token()
        if not args.skip_prefill:
            prefill += prefill_rows(
                runner,
                hf,
                dtype_name,
                gemm,
                args.prefill_lengths,
                args.repeats,
                not args.skip_torch_ops,
            )
        for batch in [] if args.skip_decode else args.batches:
            prompts = prompt_batch(tokenizer, batch)
            ours_decode_seconds(runner, prompts, args.new_tokens)  # untimed: first-call costs
            ours, hf_s, fixed, plain, same = [], [], [], [], True
            kernels = (
                runner.model.attention.decode_kernel is not None or runner.model.fused is not None
            )
            for _ in range(args.repeats):
                t_ours, out_ours = ours_decode_seconds(runner, prompts, args.new_tokens)
                t_hf, out_hf = hf_decode_seconds(hf, prompts, args.new_tokens)
                ours.append(t_ours)
                hf_s.append(t_hf)
                same = same and out_ours == out_hf
                if not args.skip_fixed_kernel:
                    fixed.append(fixed_kernel_seconds(runner, prompts, args.new_tokens))
                if kernels and not args.skip_torch_ops:
                    plain.append(torch_ops_seconds(runner, prompts, args.new_tokens))
            steps = args.new_tokens - 1
            tok_s = batch * steps / min(ours)
            hf_tok_s = batch * steps / min(hf_s)
            step_s = min(ours) / steps
            compute_s = batch * flops_per_token / gemm
            cached = batch * (len(prompts[0]) + args.new_tokens // 2)
            memory_s = (weight_bytes(runner) + kv_bytes(runner, cached)) / bandwidth
            bound_s = max(compute_s, memory_s)
            rows.append(
                {
                    "bench": "model_runner",
                    "phase": "decode",
                    "dtype": dtype_name,
                    "batch": batch,
                    "tokens_per_s": round(tok_s, 1),
                    "transformers_tokens_per_s": round(hf_tok_s, 1),
                    "ratio_vs_transformers": round(tok_s / hf_tok_s, 3),
                    "fraction_of_matmul_bound": round(bound_s / step_s, 3),
                    "step_ms": round(step_s * 1e3, 1),
                    "matmul_bound_ms": round(bound_s * 1e3, 1),
                    "compute_bound_ms": round(compute_s * 1e3, 1),
                    "memory_bound_ms": round(memory_s * 1e3, 1),
                    "gemm_gflops": round(gemm / 1e9, 1),
                    "read_gb_per_s": round(bandwidth / 1e9, 1),
                    "greedy_outputs_equal": same,
                    "gemm_kernel": kernel_choice(runner.model.chooser, batch),
                    "lm_head_kernel": kernel_choice(runner.model.head_chooser, batch),
                    "spread_ours_pct": round(
                        100 * (max(ours) - min(ours)) / statistics.mean(ours), 1
                    ),
                    # the chosen kernels against always weight-major
                    # (what ran before they were chosen)
                    "ratio_vs_weight_major": round(min(fixed) / min(ours), 3) if fixed else None,
                    # the C kernels against torch's ops alone (what ran before them)
                    "paged_attention": runner.model.attention.decode_kernel is not None,
                    "fused_ops": runner.model.fused is not None,
                    "ratio_vs_torch_ops": round(min(plain) / min(ours), 3) if plain else None,
                }
            )
        if want_agreement and dtype_name == "float32":
            reference = hf_greedy(hf, chat, args.new_tokens)
            reference_logits = hf_forced_logits(hf, chat, reference)
        if want_agreement and dtype_name != "float32":
            if reference is None or reference_logits is None:
                ref_model = AutoModelForCausalLM.from_pretrained(
                    str(model_dir), dtype=torch.float32
                )
                ref_model.generation_config.eos_token_id = None
                reference = hf_greedy(ref_model.eval(), chat, args.new_tokens)
                reference_logits = hf_forced_logits(ref_model, chat, reference)
                del ref_model
            ours_a = agreement(reference, greedy(runner, chat, args.new_tokens))
            theirs_a = agreement(reference, hf_greedy(hf, chat, args.new_tokens))
            ours_f = forced_agreement(reference_logits, forced_logits(runner, chat, reference))
            theirs_f = forced_agreement(reference_logits, hf_forced_logits(hf, chat, reference))
            agree.append(
                {
                    "bench": "model_runner",
                    "phase": "agreement",
                    "dtype": dtype_name,
                    "prompts": len(chat),
                    "new_tokens": args.new_tokens,
                    "first_token_match": ours_a["first_token"],
                    "all_tokens_match": ours_a["all_tokens"],
                    "mean_common_prefix": ours_a["mean_common_prefix"],
                    "transformers_first_token_match": theirs_a["first_token"],
                    "transformers_all_tokens_match": theirs_a["all_tokens"],
                    "transformers_mean_common_prefix": theirs_a["mean_common_prefix"],
                    # teacher-forced along the reference's greedy path (greedy_prompts.py)
                    "forced_argmax_match": round(ours_f["argmax_match"], 4),
                    "forced_kl": round(ours_f["kl"], 6),
                    "transformers_forced_argmax_match": round(theirs_f["argmax_match"], 4),
                    "transformers_forced_kl": round(theirs_f["kl"], 6),
                }
            )
        del runner, hf

    if prefill:
        print(
            f"prefill\n{'dtype':9} {'tokens':>6} {'ours tok/s':>11} {'hf tok/s':>9} "
            f"{'ratio':>6} {'ours s':>8} {'hf s':>8} {'of bound':>9} {'vs torch':>8} kernel"
        )
        for r in prefill:
            print(
                f"{r['dtype']:9} {r['tokens']:6d} {r['tokens_per_s']:11.1f} "
                f"{r['transformers_tokens_per_s']:9.1f} {r['ratio_vs_transformers']:6.2f} "
                f"{r['seconds']:8.2f} {r['transformers_seconds']:8.2f} "
                f"{r['fraction_of_matmul_bound']:9.2f} {r['ratio_vs_torch_attention'] or '-':>8} "
                f"{r['gemm_kernel']}"
            )
    if rows:
        print(
            f"decode\n{'dtype':9} {'batch':>5} {'ours tok/s':>11} {'hf tok/s':>9} "
            f"{'ratio':>6} {'step ms':>8} {'bound ms':>9} {'(flop':>6} {'mem)':>5} "
            f"{'of bound':>9} {'equal':>6} {'vs wm':>7} {'vs torch':>8} kernels (layers/head)"
        )
    for r in rows:
        print(
            f"{r['dtype']:9} {r['batch']:5d} {r['tokens_per_s']:11.1f} "
            f"{r['transformers_tokens_per_s']:9.1f} {r['ratio_vs_transformers']:6.2f} "
            f"{r['step_ms']:8.1f} {r['matmul_bound_ms']:9.1f} {r['compute_bound_ms']:6.1f} "
            f"{r['memory_bound_ms']:5.1f} "
            f"{r['fraction_of_matmul_bound']:9.2f} {str(r['greedy_outputs_equal']):>6} "
            f"{r['ratio_vs_weight_major'] or '-':>7} {r['ratio_vs_torch_ops'] or '-':>8} "
            f"{r['gemm_kernel']}/{r['lm_head_kernel']}"
        )
    if agree:
        print(
            f"agreement with transformers' float32 over {len(chat)} prompts, {args.new_tokens} "
            f"greedy tokens (free-running; teacher-forced: same choice, KL)\n{'dtype':9} "
            f"{'':13} {'first':>6} {'all':>6} {'prefix':>7} {'forced':>7} {'KL':>8}"
        )
    for r in agree:
        for who, pre in (("ours", ""), ("transformers", "transformers_")):
            print(
                f"{r['dtype']:9} {who:13} {r[pre + 'first_token_match']:6.2f} "
                f"{r[pre + 'all_tokens_match']:6.2f} {r[pre + 'mean_common_prefix']:7.1f} "
                f"{r[pre + 'forced_argmax_match']:7.3f} {r[pre + 'forced_kl']:8.5f}"
            )
    capability = torch.backends.cpu.get_cpu_capability()  # ATen's kernels: AVX512, AVX2...
    for r in prefill + rows + agree:
        print(json.dumps({**r, "isa": isa, "torch_cpu_capability": capability}))


if __name__ == "__main__":
    main()
