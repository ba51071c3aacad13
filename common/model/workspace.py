"""Buffers one CPU prefill pass reuses across its layers, one per role (products' outputs,
the fused steps' outputs, attention's output).

Without them every layer allocates its intermediates afresh. glibc serves allocations over
32 MB with a new mmap and unmaps them when freed, so each such tensor is page-faulted in and
zeroed by the kernel once per layer: at 4k tokens SmolLM2's gate_up output (50 MB) and at 8k
also silu's (50 MB); a long prefill pays those faults in every layer (bench/model_runner.py
times whole prefill passes). A pass's workspace is dropped with it, so
nothing outlives the forward that made it; decode passes (a few rows) do not take one.
"""

from __future__ import annotations

import math

import torch

# From this many rows a pass takes a workspace: prefill row buckets (common.model.cpu.gemm);
# decode's tensors are small and malloc's free lists already reuse them.
WORKSPACE_ROWS = 128


class Workspace:
    """Per role, one flat buffer grown to the largest view asked of it. A role's view is
    valid until the same role is taken again: a role is one step's output, read by the
    next step(s) of the same layer before the next layer takes it."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, role: str, *shape: int) -> torch.Tensor:
        """A contiguous [*shape] view of `role`'s buffer (its contents are stale)."""
        size = math.prod(shape)
        buf = self._buffers.get(role)
        if buf is None or buf.numel() < size:
            buf = torch.empty(size, dtype=self.dtype, device=self.device)
            self._buffers[role] = buf
        return buf[:size].view(shape)
