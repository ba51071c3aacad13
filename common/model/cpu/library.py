"""The CPU kernels' shared library, built at install time, picked for this CPU and loaded once.

torch on the CPU lacks five things the model needs: attention that reads the KV pages in
place (csrc/paged_attention.c for decode, csrc/prefill_attention.c for prefill's spans),
the per-layer small steps fused into one call each (csrc/fused_ops.c), bfloat16 products
at few rows on AMX (csrc/amx_gemm.c), and float32 products that fetch their next weights
while they multiply (csrc/f32_gemm.c). All are plain C (no Python or torch headers),
compiled by the package's build (common.model.cpu.build) into one library per instruction
set under lib/; here the best variant this CPU runs is loaded with ctypes (its OpenMP
calls resolve to the runtime torch has loaded). Nothing is compiled at run time: without
a loadable library (a source tree never installed, a CPU of another architecture than the
build's) the model runs on torch's ops, said once in a WARNING line, and
`pdserve_cpu_kernels_info{variant="none"}` reads 1.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

from common import metrics
from common.cpu_features import cpu_flags
from common.model.cpu.build import BY_NAME, LIB_DIR, VARIANTS, Variant

logger = logging.getLogger(__name__)

NONE = "none"
_lock = threading.Lock()
_loaded: dict[str, tuple[str, ctypes.CDLL | None]] = {}
_forced: str | None = None


def use_variant(name: str | None) -> None:
    """Load this variant from now on (None: the best this CPU runs): the AVX2 code's tests
    and the bench's AVX2 emulation on an AVX-512 machine. A library already loaded stays."""
    global _forced
    if name is not None and name not in BY_NAME:
        raise ValueError(f"no CPU kernel variant {name!r} (one of {', '.join(BY_NAME)})")
    _forced = name


def supported(flags: frozenset[str] | None = None) -> tuple[Variant, ...]:
    """The variants this CPU has the instructions for, best first."""
    have = cpu_flags() if flags is None else flags
    return tuple(v for v in VARIANTS if v.needs <= have)


def _candidates() -> tuple[Variant, ...]:
    if _forced is not None:
        return (BY_NAME[_forced],)
    return supported()


def _load(lib_dir: Path) -> tuple[str, ctypes.CDLL | None]:
    errors = []
    for variant in _candidates():
        path = lib_dir / variant.filename
        if not path.exists():
            errors.append(f"{variant.name}: {path} not built")
            continue
        try:
            return variant.name, ctypes.CDLL(str(path))
        except OSError as e:
            errors.append(f"{variant.name}: {e}")
    if not errors:
        errors.append("this CPU runs none of the built variants")
    logger.warning(
        "CPU kernels not loaded, the model runs on torch's ops only (slower): %s "
        "(`pip install .` or `make install` builds them)",
        "; ".join(errors),
    )
    return NONE, None


def load() -> tuple[str, ctypes.CDLL | None]:
    """(variant, library) for this process: the best variant this CPU runs that loads, or
    ("none", None), logged once."""
    key = _forced or ""
    with _lock:
        if key not in _loaded:
            _loaded[key] = _load(LIB_DIR)
            if _loaded[key][1] is not None:
                logger.info("CPU kernels: %s variant", _loaded[key][0])
        return _loaded[key]


def load_library() -> ctypes.CDLL | None:
    """The kernel library, or None where none loads."""
    return load()[1]


def loaded_variant() -> str:
    """Which variant the model's kernels run: amx, avx512, avx2, portable, or none."""
    return load()[0]


def report_variant(is_enabled: bool = True) -> str:
    """Set pdserve_cpu_kernels_info for the variant the model runs ("none" with the kernels
    turned off, --no-cpu-kernels) and return it: the runner's start on the CPU."""
    variant = loaded_variant() if is_enabled else NONE
    metrics.CPU_KERNELS_INFO.labels(**metrics.role_labels(variant=variant)).set(1)
    return variant
