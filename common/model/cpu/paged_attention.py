"""Attention read from the KV pool's pages in place: decode (csrc/paged_attention.c) and
prefill's causal spans (csrc/prefill_attention.c).

torch on the CPU has no paged attention: without these kernels decode gathers every
sequence's pages into one tensor per layer (index_select) and runs SDPA's flash kernel on
the copy, and prefill runs it on copies of the new tokens' K and V with each KV head
repeated for its query heads (after a cached prefix on the pages gathered too, two passes
merged). The decode kernel scores each key where its page lies. The prefill kernel reads
the span's pages, packs each key block once for all query blocks and heads that use it, and
runs register-tiled flash attention, in float32 for bfloat16 too. With AMX, torch's flash
kernel runs bfloat16 on the tiles and is faster, so it is kept there
(`paged_prefill_attention`). bench/model_runner.py times whole passes with and without
them.
"""

from __future__ import annotations

import ctypes

import torch

from common.cpu_features import cpu_flags, has_amx_bf16
from common.model.cpu.library import load_library

MAX_GROUPS, MAX_HEADS, MAX_HEAD_DIM = 16, 128, 256  # as in the C sources
_SYMBOLS = {
    torch.float32: "paged_decode_attention_f32",
    torch.bfloat16: "paged_decode_attention_bf16",
}
_PREFILL_SYMBOLS = {
    torch.float32: "paged_prefill_attention_f32",
    torch.bfloat16: "paged_prefill_attention_bf16",
}


def splits_for(batch: int, max_pages: int, threads: int) -> int:
    """Into how many page ranges each sequence's keys are cut: enough work items for every
    thread to get about four (few sequences, long contexts), never more ranges than pages."""
    want = -(-4 * threads // batch)
    return max(1, min(want, max_pages))


class PagedDecodeAttention:
    """One dtype's kernel: attention of one query token per sequence over its pages."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, kv_heads: int) -> None:
        self.dtype = dtype
        self.kv_heads = kv_heads
        fn = getattr(lib, _SYMBOLS[dtype])
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [
            p,
            i64,
            p,
            i64,
            p,
            i64,
            i64,
            p,
            i64,
            p,
            i32,
            i32,
            i32,
            i32,
            ctypes.c_float,
            i32,
            i32,
        ]
        fn.restype = i32
        self._fn = fn

    @staticmethod
    def supports(
        device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
    ) -> bool:
        return (
            device.type == "cpu"
            and dtype in _SYMBOLS
            and heads % kv_heads == 0
            and heads // kv_heads <= MAX_GROUPS
            and heads <= MAX_HEADS
            and head_dim <= MAX_HEAD_DIM
            and head_dim % 16 == 0
        )

    def __call__(
        self,
        pool_rows: torch.Tensor,
        rows: torch.Tensor,
        lens: torch.Tensor,
        layer: int,
        q: torch.Tensor,
        page_size: int,
        scale: float,
    ) -> torch.Tensor:
        """pool_rows: KVPool.rows; rows [B, width] int64, each page's layer-0 K row; lens [B]
        int64 tokens per sequence (at least 1); q [B, heads, head_dim], rows of any stride.
        Returns [B, heads * head_dim] in q's dtype."""
        bsz, heads, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        threads = torch.get_num_threads()
        splits = splits_for(bsz, rows.shape[1], threads)
        out = torch.empty(bsz, heads * d, dtype=q.dtype)
        rc = self._fn(
            pool_rows.data_ptr(),
            pool_rows.shape[1],
            rows.data_ptr(),
            rows.shape[1],
            lens.data_ptr(),
            bsz,
            layer,
            q.data_ptr(),
            q.stride(0),
            out.data_ptr(),
            heads,
            self.kv_heads,
            d,
            page_size,
            scale,
            splits,
            threads,
        )
        if rc != 0:
            raise RuntimeError(f"paged decode attention failed ({rc})")
        return out


def paged_decode_attention(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> PagedDecodeAttention | None:
    """The kernel for this model, or None (not the CPU, an unsupported shape, no build)."""
    if not PagedDecodeAttention.supports(device, dtype, heads, kv_heads, head_dim):
        return None
    lib = load_library()
    return PagedDecodeAttention(lib, dtype, kv_heads) if lib is not None else None


class PagedPrefillAttention:
    """Causal attention of one extend span's new tokens over its pages, one dtype's kernel
    (csrc/prefill_attention.c): the new tokens' K and V are in the pages already."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype, kv_heads: int) -> None:
        self.dtype = dtype
        self.kv_heads = kv_heads
        fn = getattr(lib, _PREFILL_SYMBOLS[dtype])
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [
            p,
            i64,
            p,
            i64,
            p,
            i64,
            i64,
            i64,
            p,
            i64,
            i32,
            i32,
            i32,
            i32,
            ctypes.c_float,
            i32,
        ]
        fn.restype = i32
        self._fn = fn

    @staticmethod
    def supports(
        device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
    ) -> bool:
        return (
            device.type == "cpu"
            and dtype in _PREFILL_SYMBOLS
            and heads % kv_heads == 0
            and heads // kv_heads <= MAX_GROUPS
            and head_dim <= MAX_HEAD_DIM
            and head_dim % 16 == 0
        )

    def __call__(
        self,
        pool_rows: torch.Tensor,
        rows: torch.Tensor,
        layer: int,
        q: torch.Tensor,
        prefix: int,
        out: torch.Tensor,
        page_size: int,
        scale: float,
    ) -> None:
        """q [n, heads, head_dim] (rows of any stride), the tokens at positions prefix ..
        prefix + n - 1; rows int64, the span's pages' layer-0 K rows, covering prefix + n
        tokens. Writes out [n, heads * head_dim] (rows of any stride). All in the kernel's
        dtype."""
        n, heads, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        assert out.stride(1) == 1 and out.shape == (n, heads * d) and rows.is_contiguous()
        assert pool_rows.dtype == q.dtype == out.dtype == self.dtype
        rc = self._fn(
            pool_rows.data_ptr(),
            pool_rows.shape[1],
            rows.data_ptr(),
            layer,
            q.data_ptr(),
            q.stride(0),
            n,
            prefix,
            out.data_ptr(),
            out.stride(0),
            heads,
            self.kv_heads,
            d,
            page_size,
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"paged prefill attention failed ({rc})")


def paged_prefill_attention(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    *,
    always: bool = False,
) -> PagedPrefillAttention | None:
    """The prefill kernel for this model, or None: not the CPU, an unsupported shape, no
    build, or bfloat16 on a CPU with AMX, where torch's flash kernel runs on the tiles and
    is the faster one. `always` takes it in that case too, for its tests."""
    if not PagedPrefillAttention.supports(device, dtype, heads, kv_heads, head_dim):
        return None
    lib = load_library()
    if lib is None:
        return None
    slower = dtype == torch.bfloat16 and has_amx_bf16(cpu_flags())
    return PagedPrefillAttention(lib, dtype, kv_heads) if always or not slower else None
