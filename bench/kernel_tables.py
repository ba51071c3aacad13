"""Which product kernel and which fused-step implementation is fastest here, per row count.

Products: for each dtype (float32; bfloat16 where the CPU has native bf16) and row count,
one pass of SmolLM2's 120 layer products (every layer's own weights, as a forward reads
them) on each kernel the model's chooser may take there (common.model.cpu.gemm),
interleaved, best of --repeats: the hand-written kernels (amx, panels) against the fastest
of the libraries' (F.linear/MKL, weight-major, oneDNN packed), with the ratio (> 1: ours
faster) and the kernel the chooser's rule takes from these times (a hand-written one only
10% or more ahead). Fused steps: the three per-layer steps per call, the C kernels
(common.model.cpu.fused_ops) against torch.compile (inductor) of the torch ops they replace
and those ops eager.

Prints the CPU, the two tables, then one JSON line per row.
Usage: python bench/kernel_tables.py [--dtypes float32] [--rows 1 2 4 ... 1024]
       [--fused-rows 1 8 32 128 1024] [--repeats 5] [--skip-fused]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from cpu_info import describe_cpu  # noqa: E402

from common.cpu_features import has_native_bf16  # noqa: E402
from common.model.cpu import library  # noqa: E402
from common.model.cpu.gemm import (  # noqa: E402
    AMX,
    PACKED,
    PANELS,
    ROW_MAJOR,
    WEIGHT_MAJOR,
    bucket_of,
    choose,
    time_products,
)
from common.model.llama import apply_rope, rms_norm  # noqa: E402
from common.model.runner import ModelRunner  # noqa: E402

TORCH_KERNELS = (ROW_MAJOR, WEIGHT_MAJOR, PACKED)
OUR_KERNELS = (AMX, PANELS)


def gemm_table(
    runner: ModelRunner, dtype_name: str, row_counts: list[int], repeats: int
) -> list[dict]:
    """Per row count, one pass of the layers' products on each kernel the chooser may take
    there (common.model.cpu.gemm.time_products), interleaved, best of `repeats`: our
    kernels (amx, panels) against the fastest of torch's (F.linear/MKL, weight-major, oneDNN
    packed)."""
    model = runner.model
    assert model.chooser is not None  # the CPU
    products, out = model.layer_products(), []
    for rows in row_counts:
        kernels = model.chooser.candidates(bucket_of(rows))
        for k in kernels:
            time_products(products, rows, k, model.dtype)  # untimed: first-call costs
        best = {k: float("inf") for k in kernels}
        for _ in range(repeats):
            for k in kernels:
                best[k] = min(best[k], time_products(products, rows, k, model.dtype))
        torch_best = min((k for k in kernels if k in TORCH_KERNELS), key=best.__getitem__)
        row = {
            "bench": "kernel_tables",
            "phase": "gemm",
            "dtype": dtype_name,
            "rows": rows,
            "torch_best": torch_best,
            "chosen": choose(best),
            **{f"{k}_ms": round(t * 1e3, 2) for k, t in best.items()},
        }
        for k in kernels:
            if k in OUR_KERNELS:  # > 1: ours faster than torch's best by that factor
                row[f"{k}_vs_torch"] = round(best[torch_best] / best[k], 3)
        out.append(row)
    return out


def _add_norm_torch(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float):
    x = x + y
    return x, rms_norm(x, w, eps)


def _rope_store_torch(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin_rot: torch.Tensor,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
    d: int,
    v_offset: int,
) -> torch.Tensor:
    n, qk_size = qkv.shape[0], (heads + kv_heads) * d
    qk = apply_rope(
        qkv[:, :qk_size].reshape(n, heads + kv_heads, d), cos[positions], sin_rot[positions]
    )
    tokens.index_copy_(0, slots, qk[:, heads:].reshape(n, kv_heads * d))
    tokens.index_copy_(0, slots + v_offset, qkv[:, qk_size:])
    return qk


def _silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _best_us(fn, calls: int, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def fused_table(
    runner: ModelRunner, dtype_name: str, row_counts: list[int], repeats: int
) -> list[dict]:
    """The three fused small steps per call, µs: the C kernels (common.model.cpu.fused_ops),
    torch.compile (inductor) of the torch ops they replace, and those ops eager."""
    fused, spec, dtype = runner.model.fused, runner.spec, runner.model.dtype
    if fused is None:
        return []
    try:
        compiled = [
            torch.compile(f, dynamic=False)
            for f in (_add_norm_torch, _rope_store_torch, _silu_mul_torch)
        ]
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print(f"# torch.compile unavailable: {e!r}")
        return []
    heads, kv, d, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.rms_norm_eps
    hidden, inter = spec.hidden_size, runner.model.layers[0].down.weight.shape[1]
    cos, sin_rot, tokens = runner.model.cos, runner.model.sin_rot, runner.pool.tokens
    ps, out = runner.page_size, []
    for rows in row_counts:
        x, y = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, hidden, dtype=dtype)
        w = runner.model.norm
        qkv = torch.randn(rows, (heads + 2 * kv) * d, dtype=dtype)
        positions = torch.arange(rows, dtype=torch.long)
        slots = torch.arange(rows, dtype=torch.long)
        gate_up = torch.randn(rows, 2 * inter, dtype=dtype)
        cases = {
            "add_rms_norm": (
                lambda: fused.add_rms_norm(x, y, w, eps),
                lambda f: lambda: f(x, y, w, eps),
            ),
            "rope_store": (
                lambda: fused.rope_store(
                    qkv, positions, cos, sin_rot, tokens, slots, 0, ps, heads, kv, d
                ),
                lambda f: lambda: f(qkv, positions, cos, sin_rot, tokens, slots, heads, kv, d, ps),
            ),
            "silu_mul": (lambda: fused.silu_mul(gate_up), lambda f: lambda: f(gate_up)),
        }
        calls = max(5, 2048 // rows)
        for (name, (c_fn, bind)), eager, comp in zip(
            cases.items(), (_add_norm_torch, _rope_store_torch, _silu_mul_torch), compiled
        ):
            c_us = _best_us(c_fn, calls, repeats)
            compiled_us = _best_us(bind(comp), calls, repeats)
            eager_us = _best_us(bind(eager), calls, repeats)
            out.append(
                {
                    "bench": "kernel_tables",
                    "phase": "fused",
                    "dtype": dtype_name,
                    "op": name,
                    "rows": rows,
                    "c_us": round(c_us, 1),
                    "compiled_us": round(compiled_us, 1),
                    "eager_us": round(eager_us, 1),
                    "compiled_vs_c": round(c_us / compiled_us, 3),
                }
            )
    return out


def print_tables(tables: list[dict]) -> None:
    gemm = [r for r in tables if r["phase"] == "gemm"]
    if gemm:
        names = [k for k in (*TORCH_KERNELS, *OUR_KERNELS) if any(f"{k}_ms" in r for r in gemm)]
        print(
            f"products of one pass (all layers), ms\n{'dtype':9} {'rows':>5} "
            + " ".join(f"{k:>12}" for k in names)
            + "  torch best      chosen  ours/torch"
        )
        for r in gemm:
            ours = " ".join(
                f"{k}={r[k + '_vs_torch']}" for k in OUR_KERNELS if k + "_vs_torch" in r
            )
            print(
                f"{r['dtype']:9} {r['rows']:5d} "
                + " ".join(f"{r.get(k + '_ms', '-'):>12}" for k in names)
                + f"  {r['torch_best']:>10}  {r['chosen']:>10}  {ours}"
            )
    fused = [r for r in tables if r["phase"] == "fused"]
    if fused:
        print(
            f"fused steps, us per call\n{'dtype':9} {'op':13} {'rows':>5} {'C':>9} "
            f"{'compiled':>9} {'eager':>9} {'C/compiled':>10}"
        )
        for r in fused:
            print(
                f"{r['dtype']:9} {r['op']:13} {r['rows']:5d} {r['c_us']:9.1f} "
                f"{r['compiled_us']:9.1f} {r['eager_us']:9.1f} {r['compiled_vs_c']:10.3f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=None)
    ap.add_argument(
        "--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    )
    ap.add_argument("--fused-rows", type=int, nargs="+", default=[1, 8, 32, 128, 1024])
    ap.add_argument("--repeats", type=int, default=5, help="runs per point; the best is kept")
    ap.add_argument("--skip-fused", action="store_true")
    args = ap.parse_args()
    print(f"cpu: {describe_cpu()}; CPU kernels: {library.loaded_variant()} variant")
    dtypes = args.dtypes or (["float32", "bfloat16"] if has_native_bf16() else ["float32"])
    tables: list[dict] = []
    for dtype_name in dtypes:
        runner = ModelRunner.from_path(
            None, progress=False, dtype=dtype_name, max_total_tokens=max(args.fused_rows) + 64
        )
        tables += gemm_table(runner, dtype_name, args.rows, args.repeats)
        if not args.skip_fused:
            tables += fused_table(runner, dtype_name, args.fused_rows, args.repeats)
        del runner
    print_tables(tables)
    for r in tables:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
