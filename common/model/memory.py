"""How large the KV pool may be: `--mem-fraction-static` of the device, less what is in use.

SGLang's rule, by its flag's name: after the weights are loaded and a warm-up forward at the
largest batch has run, the pool takes `fraction` of the device's memory less everything
already in use (weights, CUDA context, other processes on the GPU) and less the warm-up's
activation peak, which every later forward needs again. The rest of the device (1 -
fraction) is left for CUDA graphs, the sampler and fragmentation. On the CPU the same rule
reads the machine's memory (/proc/meminfo) when the flag is given; without it the CPU pool
keeps its fixed default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_CUDA_FRACTION = 0.85  # SGLang picks 0.8-0.9 by GPU size; an H200 at 0.85 leaves ~21 GB


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # bytes the device has
    free: int  # bytes nobody uses now (other processes included)

    @property
    def in_use(self) -> int:
        return self.total - self.free


def device_memory(device: torch.device) -> DeviceMemory:
    """The device's memory now: cudaMemGetInfo on CUDA, MemTotal/MemAvailable on the CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total=int(total), free=int(free))
    fields: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                fields[name] = int(parts[0]) * 1024  # kB
    return DeviceMemory(
        total=fields["MemTotal"], free=fields.get("MemAvailable", fields.get("MemFree", 0))
    )


def kv_pool_bytes(memory: DeviceMemory, fraction: float, activation_bytes: int) -> int:
    """Bytes for the KV pool: `fraction` of the device, less what is in use and the
    activations a forward needs at its largest. Raises ValueError when nothing is left,
    naming the numbers (a second process on the same GPU is the usual cause)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--mem-fraction-static {fraction} must be in (0, 1]")
    budget = int(memory.total * fraction) - memory.in_use - max(0, activation_bytes)
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"--mem-fraction-static {fraction} leaves no KV pool: {fraction:.2f} of "
            f"{memory.total / gib:.1f} GiB is {memory.total * fraction / gib:.1f} GiB, but "
            f"{memory.in_use / gib:.1f} GiB are in use (weights, CUDA context, other "
            f"processes) and a forward needs {activation_bytes / gib:.2f} GiB more; raise the "
            f"fraction, or give each node its own GPU (pdserve launch --gpus)"
        )
    return budget
