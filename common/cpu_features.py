"""What this CPU can do natively, read once from /proc/cpuinfo (empty elsewhere)."""

from __future__ import annotations

import functools

# Either gives native bfloat16 GEMMs (AMX tiles, or AVX-512 dot products); without them
# torch emulates bfloat16 on the CPU and it runs slower than float32.
AMX_BF16_FLAG = "amx_bf16"
NATIVE_BF16_FLAGS = frozenset({AMX_BF16_FLAG, "avx512_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    return bool(NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags))


def has_amx_bf16(flags: frozenset[str] | None = None) -> bool:
    return AMX_BF16_FLAG in (cpu_flags() if flags is None else flags)
