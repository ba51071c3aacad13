"""float32 products on AVX-512 or AVX2 that fetch the next weights while multiplying:
csrc/f32_gemm.c.

At decode's rows and short prompts' a float32 product waits on its weight: the model's
weights do not stay in cache between passes, and MKL's and oneDNN's products leave the
memory idle while they multiply. This kernel overlaps the two: the weight is packed once
into column panels of the build's width (`F32Gemm.panel`: 32 columns for AVX-512, 16 for
AVX2) and the next panel is prefetched during the current one's multiply-adds. At long
prompts' rows the libraries' products are compute-bound and at least as fast. Which runs at
a row count is the model's measured choice (common.model.cpu.gemm; bench/kernel_tables.py
prints the table). Where the loaded variant has neither AVX-512F nor AVX2
with FMA (portable), `f32_gemm()` is None.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from common.model.cpu.library import load_library
from common.model.cpu.product_entry import ProductEntry


class F32Gemm:
    """The library's float32 panel product, for weights packed by `pack`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = ProductEntry(lib, "f32_gemm")
        lib.f32_gemm_panel.argtypes = []
        lib.f32_gemm_panel.restype = ctypes.c_int
        self.panel = int(lib.f32_gemm_panel())  # output columns per panel: 32, or 16 on AVX2

    @staticmethod
    def packable(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """W [n, k] in this build's panels (`pack_panels` at `self.panel` columns)."""
        return pack_panels(weight, self.panel)

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        bias: torch.Tensor | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [rows, k] float32 @ W.T (+ bias) -> [rows, n] float32, W [n, k] as `pack`
        gave it; into `out` if given (contiguous [rows, n])."""
        k, rows = packed.shape[1], x.shape[0]
        if packed.dim() != 3 or packed.shape[2] != self.panel:
            raise ValueError(
                f"weight packed as {tuple(packed.shape)}, not in panels of {self.panel} columns"
            )
        if x.dtype != torch.float32 or x.shape[1] != k:
            raise ValueError(
                f"product of {x.dtype} {tuple(x.shape)} with a float32 [{n}, {k}] weight"
            )
        if bias is not None and (
            bias.shape != (n,) or bias.dtype != torch.float32 or not bias.is_contiguous()
        ):
            raise ValueError(f"bias must be contiguous float32 [{n}]")
        if out is None:
            out = torch.empty(rows, n, dtype=torch.float32)
        elif out.shape != (rows, n) or not out.is_contiguous() or out.dtype != torch.float32:
            raise ValueError(f"out must be contiguous float32 [{rows}, {n}]")
        if rows == 0:
            return out
        if self._fn(x, packed, n, k, bias, out) != 0:
            raise RuntimeError("float32 panel product refused (a bad shape)")
        return out


def pack_panels(weight: torch.Tensor, width: int) -> torch.Tensor:
    """W [n, k] as [ceil(n / width), k, width]: element [p, i, j] is W[width p + j, i], zero
    past the last column (the kernel stores only columns below n)."""
    n, k = weight.shape
    panels = -(-n // width)
    padded = torch.zeros(panels * width, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.reshape(panels, width, k).transpose(1, 2).contiguous()


@dataclass
class PanelWeight:
    """A weight packed for the panel product, with the kernel that reads it."""

    kernel: F32Gemm
    packed: torch.Tensor
    n: int

    def __call__(
        self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.kernel(x, self.packed, self.n, bias, out)


@functools.cache
def f32_gemm() -> F32Gemm | None:
    """The panel product if this machine can run it (AVX-512F, or AVX2 with FMA; the library
    built), else None."""
    lib = load_library()
    return F32Gemm(lib) if lib is not None and lib.f32_gemm_ready() == 1 else None
