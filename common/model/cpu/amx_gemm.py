"""bfloat16 products at decode's row counts on AMX tiles: csrc/amx_gemm.c.

At 1-64 rows a product's time is its weight's bytes over the memory bandwidth, and oneDNN's
bfloat16 product leaves part of it unused; this kernel streams the weight through the
tiles, each tile loaded ahead of its use. The weight is packed once into the tiles' layout.
Whether it runs at a row count is the model's measured choice (common.model.cpu.gemm;
bench/kernel_tables.py prints the table). Where the CPU, the loaded variant
(amx only) or the kernel does not allow AMX, `amx_gemm()` is None and the torch kernels are
all there is.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from common.model.cpu.library import load_library
from common.model.cpu.product_entry import ProductEntry

BLOCK_N, BLOCK_K = 16, 32  # as in the C source: output columns x inputs per weight tile


class AmxGemm:
    """The library's AMX product, for weights `packable` and packed by `pack`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = ProductEntry(lib, "amx_gemm_bf16")

    @staticmethod
    def packable(weight: torch.Tensor) -> bool:
        n, k = weight.shape
        return (
            weight.device.type == "cpu"
            and weight.dtype == torch.bfloat16
            and n % BLOCK_N == 0
            and k % BLOCK_K == 0
        )

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """W [n, k] as [n/16, k/32, 16 pairs, 16 columns, 2]: element [b, c, p, j, e] is
        W[16b + j, 32c + 2p + e], a TDPBF16PS weight tile per [b, c], column blocks in order."""
        n, k = weight.shape
        tiles = weight.reshape(n // BLOCK_N, BLOCK_N, k // BLOCK_K, BLOCK_K // 2, 2)
        return tiles.permute(0, 2, 3, 1, 4).contiguous()

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [rows, k] bfloat16 @ W.T (+ bias) -> [rows, n] bfloat16, W as `pack` gave it."""
        n, k = packed.shape[0] * BLOCK_N, packed.shape[1] * BLOCK_K
        out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
        if self._fn(x, packed, n, k, bias, out) != 0:
            raise RuntimeError("AMX product refused (no AMX permission, or a bad shape)")
        return out


@dataclass
class AmxWeight:
    """A weight packed for the AMX product, with the kernel that reads it."""

    kernel: AmxGemm
    packed: torch.Tensor

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(x, self.packed, bias)


@functools.cache
def amx_gemm() -> AmxGemm | None:
    """The AMX product if this machine can run it (the CPU has AMX, the library built with
    it, the kernel grants the tile state), else None."""
    lib = load_library()
    return AmxGemm(lib) if lib is not None and lib.amx_gemm_ready() == 1 else None
