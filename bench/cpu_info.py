"""The CPU a benchmark ran on, as one line: model, the SIMD flags that change our kernels, cores."""

from __future__ import annotations

import os
import platform

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def describe_cpu() -> str:
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    flags = " ".join(f for f in FLAGS if f in have)
                    break
    except OSError:
        pass
    return f"{model or platform.processor() or 'unknown'} [{flags}] x{os.cpu_count()}"
