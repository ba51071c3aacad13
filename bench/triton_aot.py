"""Every Triton kernel variant the device check and serving use, compiled ahead of time for
an H100 (sm_90) on a machine without a GPU: Triton's own compiler and the ptxas in its wheel.

The variants come from walking each configuration's serving calls on meta tensors
(common.model.kernel_variants.serving_variants): the device check's shapes (the tiny test
models, SmolLM2-135M, Llama-3.2-1B) and serving's dtypes (bfloat16, float16, float32) at the
default page size. Each is compiled in a worker process; ptxas -v reports its registers,
spills and stack, Triton its shared memory. A variant fails when it does not compile, when a
16-bit one spills registers, or when its shared memory passes the H100's 227 KiB per block.

Prints the table (kernel, variant, registers, shared memory, spills, seconds), then one JSON
line per variant and a summary line; exits 1 when any variant failed, naming it.
Usage: python bench/triton_aot.py [--workers N] [--dtypes bfloat16 float16 float32]
       [--shapes tiny-llama smollm2-135m llama-3.2-1b] [--capability 90] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The repo root before bench/: bench/transfer.py would shadow the `transfer` package.
_BENCH = os.path.dirname(os.path.realpath(__file__))
_ROOT = os.path.dirname(_BENCH)
sys.path[:] = [_ROOT, *(p for p in sys.path if os.path.realpath(p or ".") != _BENCH), _BENCH]
os.environ.pop("TRITON_INTERPRET", None)  # the kernels as jit functions, for the compiler

from cpu_info import describe_cpu  # noqa: E402
from device_check_common import SHAPES  # noqa: E402

from common.model.kernel_variants import (  # noqa: E402
    Compiled,
    describe,
    precompile,
    serving_variants,
    union,
)
from common.model.spec import ModelSpec  # noqa: E402
from common.model.triton_launch import Variant  # noqa: E402

H100_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may take
DEFAULT_SHAPES = ("tiny-llama", "smollm2-135m", "llama-3.2-1b")
DEFAULT_DTYPES = ("bfloat16", "float16", "float32")
PAGE_SIZE = 16  # --page-size's default (the device check's too)


def spec_of(shape: str) -> ModelSpec:
    arch, cfg, _, _ = SHAPES[shape]
    return ModelSpec.from_hf_config({**cfg, "model_type": arch})


def variants_for(shapes: list[str], dtypes: list[str]) -> list[Variant]:
    """The distinct variants of every (shape, dtype) configuration, decode and prefill."""
    return union(
        serving_variants(spec_of(shape), dtype, PAGE_SIZE, decodes=decodes)
        for shape in shapes
        for dtype in dtypes
        for decodes in (True, False)
    )


def problems(c: Compiled) -> list[str]:
    """Why a compiled variant fails the check (empty: it passes)."""
    out = []
    if c.error:
        out.append(f"does not compile: {c.error[:300]}")
    if c.variant.dtype_class in ("bf16", "fp16") and c.has_spills:
        out.append(f"spills {c.spill_store_bytes} B stored / {c.spill_load_bytes} B loaded")
    if c.shared_bytes > H100_SHARED_BYTES:
        out.append(f"{c.shared_bytes} B shared memory > {H100_SHARED_BYTES}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=sorted(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES))
    p.add_argument("--capability", type=int, default=90, help="CUDA compute capability")
    p.add_argument("--json", help="also write the rows to this file (JSON lines)")
    args = p.parse_args()
    print(f"# {describe_cpu()}")
    started = time.perf_counter()
    variants = variants_for(args.shapes, args.dtypes)
    walk_s = time.perf_counter() - started
    print(f"# {len(variants)} variants from {len(args.shapes)} shapes x {len(args.dtypes)} dtypes")
    results = precompile(variants, ("cuda", args.capability, 32), args.workers)
    total_s = time.perf_counter() - started
    rows = describe(results)
    failed = 0
    print(f"{'kernel':<22} {'dtype':<5} {'regs':>4} {'shared':>7} {'spills':>7} {'s':>6}  variant")
    for c, row in zip(results, rows):
        why = problems(c)
        row["ok"] = not why
        row["problems"] = why
        failed += bool(why)
        spills = f"{c.spill_store_bytes}/{c.spill_load_bytes}"
        print(
            f"{row['kernel']:<22} {row['dtype']:<5} {c.registers:>4} {c.shared_bytes:>7} "
            f"{spills:>7} {c.seconds:>6.2f}  {row['variant'][:90]}"
            + (f"  FAIL: {'; '.join(why)}" if why else "")
        )
    summary = {
        "kind": "summary",
        "target": f"sm_{args.capability}",
        "num_variants": len(results),
        "num_failed": failed,
        "walk_s": round(walk_s, 2),
        "total_s": round(total_s, 2),
        "compile_s_summed": round(sum(c.seconds for c in results), 2),
        "workers": args.workers,
    }
    lines = [json.dumps(r) for r in rows] + [json.dumps(summary)]
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
