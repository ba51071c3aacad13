"""Compiling the C kernels of csrc/ into one shared library per instruction set, at install time.

setup.py's build step calls `build_all` (the package's build, `pip install .` or
`pip install -e .`); nothing compiles at run time. Each variant is all the sources built
with one target's flags, the loader (common.model.cpu.library) picking the best variant the
CPU runs, as ATen's CPU_CAPABILITY and vLLM's csrc/cpu do:
  amx       x86-64-v4 with AVX512-BF16 and AMX tiles (the AMX bfloat16 product)
  avx512    x86-64-v4: AVX-512 F/BW/CD/DQ/VL
  avx2      x86-64-v3: AVX2, FMA, F16C, BMI
  portable  no target flag: plain C and GCC's vector extensions, any architecture
Only the standard library here: setup.py loads this file by path, before the package and
its dependencies are installed.
"""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
LIB_DIR = Path(__file__).with_name("lib")
CFLAGS: tuple[str, ...] = ("-O3", "-fopenmp", "-fPIC", "-Wno-psabi")
# Per source, flags of its own: the fused ops round where torch rounds, so no multiply and
# add may become one fused multiply-add there.
SOURCES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("paged_attention.c", ()),
    ("prefill_attention.c", ()),
    ("fused_ops.c", ("-ffp-contract=off",)),
    ("amx_gemm.c", ()),
    ("f32_gemm.c", ()),
)
# GCC vectorizes 256 bits wide on AVX-512 unless told otherwise; the fused ops' loops gain
# from 512 bits (bit-equal results either way).
WIDE_VECTORS: dict[str, tuple[str, ...]] = {"fused_ops.c": ("-mprefer-vector-width=512",)}


@dataclass(frozen=True)
class Variant:
    """One build target: its compiler flags and the CPU flags (/proc/cpuinfo) it needs."""

    name: str
    march: tuple[str, ...]
    needs: frozenset[str]
    x86_only: bool = True
    wide_vectors: bool = False

    @property
    def filename(self) -> str:
        return f"libpdserve_cpu_{self.name}.so"

    def source_flags(self, source: str, own: tuple[str, ...]) -> list[str]:
        extra = WIDE_VECTORS.get(source, ()) if self.wide_vectors else ()
        return [*CFLAGS, *self.march, *own, *extra]


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# best first: the loader takes the first one the CPU has the flags of
VARIANTS: tuple[Variant, ...] = (
    Variant(
        "amx",
        ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
        _V4 | {"avx512_bf16", "amx_tile", "amx_bf16"},
        wide_vectors=True,
    ),
    Variant("avx512", ("-march=x86-64-v4",), _V4, wide_vectors=True),
    Variant("avx2", ("-march=x86-64-v3",), _V3),
    Variant("portable", (), frozenset(), x86_only=False),
)
BY_NAME: dict[str, Variant] = {v.name: v for v in VARIANTS}


def buildable(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants this build machine's compiler targets: all on x86-64, portable elsewhere."""
    arch = (machine or platform.machine()).lower()
    x86 = arch in ("x86_64", "amd64")
    return tuple(v for v in VARIANTS if x86 or not v.x86_only)


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")


def build_variant(variant: Variant, out_dir: Path, compiler: str = "gcc") -> Path:
    """All sources with the variant's flags, linked into out_dir/variant.filename (written
    under a temporary name, then renamed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / variant.filename
    with tempfile.TemporaryDirectory(dir=out_dir) as work:
        objects = []
        for name, own in SOURCES:
            obj = str(Path(work) / (name + ".o"))
            _run([compiler, *variant.source_flags(name, own), "-c", "-o", obj, str(CSRC / name)])
            objects.append(obj)
        linked = str(Path(work) / variant.filename)
        _run([compiler, "-shared", "-fopenmp", "-o", linked, *objects, "-lm"])
        os.replace(linked, target)
    return target


def build_all(
    out_dir: Path = LIB_DIR,
    compiler: str | None = None,
    variants: tuple[Variant, ...] | None = None,
) -> list[Path]:
    """Every buildable variant into out_dir, side by side (one per core); the first failure
    raises."""
    cc = compiler or os.environ.get("CC") or "gcc"
    todo = buildable() if variants is None else variants
    with ThreadPoolExecutor(max_workers=max(1, min(len(todo), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda v: build_variant(v, out_dir, cc), todo))
