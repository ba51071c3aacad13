"""bfloat16 products at decode's row counts on AMX tiles: csrc/amx_gemm.c.

At 1-64 rows a product's time is its weight's bytes over the memory bandwidth. On a
2-core AMX Xeon (22 GB/s read), SmolLM2's 30 layers of products (212 MB in bfloat16) took
13-36 ms through oneDNN's packed weights (the fastest of the three torch kernels,
common.model.gemm) and 9-19 ms through this kernel at 1-32 rows, interleaved runs giving
1.5-2.2x (1.0-1.3x at 64 rows). The weight is packed once into the tiles' layout; where
the CPU, the compiler or the kernel does not allow AMX, `amx_gemm()` is None and the
torch kernels are all there is.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from common.model.cpu_kernels import load_library
from common.model.product_entry import ProductEntry

BLOCK_N, BLOCK_K = 16, 32  # as in the C source: output columns x inputs per weight tile


class AmxGemm:
    """The library's AMX product, for weights `packable` and packed by `pack`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = ProductEntry(lib, "amx_gemm_bf16")

    @staticmethod
    def packable(weight: torch.Tensor) -> bool:
        n, k = weight.shape
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
                and n % BLOCK_N == 0 and k % BLOCK_K == 0)

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """W [n, k] as [n/16, k/32, 16 pairs, 16 columns, 2]: element [b, c, p, j, e] is
        W[16b + j, 32c + 2p + e], a TDPBF16PS weight tile per [b, c], column blocks in order."""
        n, k = weight.shape
        tiles = weight.reshape(n // BLOCK_N, BLOCK_N, k // BLOCK_K, BLOCK_K // 2, 2)
        return tiles.permute(0, 2, 3, 1, 4).contiguous()

    def __call__(self, x: torch.Tensor, packed: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
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
