"""The C signature the library's products share (csrc/amx_gemm.c, csrc/f32_gemm.c):

  int NAME(const T *x, int64_t ldx, int64_t m, const T *packed, int64_t n, int64_t k,
           const T *bias, T *y, int64_t ldy, int threads)

y [m, n] = x [m, k] @ W.T (+ bias), W packed in the kernel's own layout; 0 on success.
"""

from __future__ import annotations

import ctypes

import torch


class ProductEntry:
    """One such entry point of the loaded library, called on torch tensors."""

    def __init__(self, lib: ctypes.CDLL, symbol: str) -> None:
        fn = getattr(lib, symbol)
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, i64, i64, p, i64, i64, p, p, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        k: int,
        bias: torch.Tensor | None,
        out: torch.Tensor,
    ) -> int:
        """x [rows, k] (any row stride; other column strides copied first) into `out`
        [rows, n], contiguous; returns the kernel's code."""
        if x.stride(1) != 1:
            x = x.contiguous()  # a weight-major product's transposed output
        return self._fn(
            x.data_ptr(),
            x.stride(0),
            x.shape[0],
            packed.data_ptr(),
            n,
            k,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            n,
            torch.get_num_threads(),
        )
