"""The forward pass's small per-layer steps as Triton kernels for CUDA, one launch each.

The same three steps as common.model.cpu.fused_ops (the CPU's C kernels), with the same
signatures: the residual add with RMSNorm, RoPE with the KV store, silu with its product.
Each rounds where the torch ops it replaces round: arithmetic in float32, the result of each
torch op rounded to the model's dtype (in bfloat16, weight * rms_norm(x) rounds the
normalized value before the product), and products never fused into an add (RoPE is
launched with FMA contraction off). Under TRITON_INTERPRET=1 they run on CPU tensors (the
tests). Block shapes and warp counts are first guesses, not yet tuned on a GPU.
"""

from __future__ import annotations

import torch

from common.model.triton_attention import (
    interpreting,
    round_to,
    tl,
    triton,
    triton_jit,
    triton_runs_on,
)
from common.model.triton_launch import launch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton_jit(do_not_specialize=["y_rs", "y_cs"])
def _add_rms_norm_kernel(
    x_ptr,
    y_ptr,
    y_rs,
    y_cs,
    w_ptr,
    h_ptr,
    hidden,
    eps,
    HAS_Y: tl.constexpr,
    BLOCK: tl.constexpr,
    EMULATE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = h_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0)
    if HAS_Y:
        y = tl.load(y_ptr + row * y_rs + cols.to(tl.int64) * y_cs, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + y.to(tl.float32), dtype, EMULATE)  # torch's x + y
        tl.store(x_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(xf * xf, 0) / hidden + eps))
    normed = round_to(xf * inv_rms, dtype, EMULATE)  # F.rms_norm rounds here
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    h = round_to(w.to(tl.float32) * normed.to(tl.float32), dtype, EMULATE)
    tl.store(h_ptr + row * hidden + cols, h, mask=mask)


@triton_jit(do_not_specialize=["qkv_rs", "qkv_cs", "k_offset", "v_offset"])
def _rope_store_kernel(
    qkv_ptr,
    qkv_rs,
    qkv_cs,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    qk_ptr,
    pool_ptr,
    slots_ptr,
    k_offset,
    v_offset,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    half: tl.constexpr = HEAD_DIM // 2
    d_mask = offs_d < HEAD_DIM
    mask = (offs_h < HEADS + KV_HEADS)[:, None] & d_mask[None, :]
    src = qkv_ptr + row * qkv_rs
    col = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    col64 = col.to(tl.int64)
    # the other half of each head, in place of cat(x2, x1): rotate-half's partner
    partner = (offs_h[:, None] * HEAD_DIM + ((offs_d + half) % HEAD_DIM)[None, :]).to(tl.int64)
    x = tl.load(src + col64 * qkv_cs, mask=mask, other=0.0).to(tl.float32)
    swapped = tl.load(src + partner * qkv_cs, mask=mask, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    cos = tl.load(cos_ptr + pos * HEAD_DIM + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * HEAD_DIM + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    dtype = qk_ptr.dtype.element_ty
    # x * cos + swapped * sin_rot, each product rounded to the dtype as torch rounds it
    a = round_to(x * cos[None, :], dtype, EMULATE).to(tl.float32)
    b = round_to(swapped * sin[None, :], dtype, EMULATE).to(tl.float32)
    rotated = round_to(a + b, dtype, EMULATE)
    tl.store(qk_ptr + row * ((HEADS + KV_HEADS) * HEAD_DIM) + col, rotated, mask=mask)
    # k (rotated) and v to this layer's slots of the pool
    slot = tl.load(slots_ptr + row).to(tl.int64) + k_offset
    kv_cols = (offs_h[:, None] - HEADS) * HEAD_DIM + offs_d[None, :]
    k_mask = mask & (offs_h >= HEADS)[:, None]
    tl.store(pool_ptr + slot * (KV_HEADS * HEAD_DIM) + kv_cols, rotated, mask=k_mask)
    offs_kv = tl.arange(0, BLOCK_KV)
    v_cols = offs_kv[:, None] * HEAD_DIM + offs_d[None, :]
    v_mask = (offs_kv < KV_HEADS)[:, None] & d_mask[None, :]
    v = tl.load(src + ((HEADS + KV_HEADS) * HEAD_DIM + v_cols).to(tl.int64) * qkv_cs, mask=v_mask)
    tl.store(pool_ptr + (slot + v_offset) * (KV_HEADS * HEAD_DIM) + v_cols, v, mask=v_mask)


@triton_jit(do_not_specialize=["gu_rs", "gu_cs", "out_rs", "out_cs", "rows"])
def _silu_mul_kernel(
    gu_ptr,
    gu_rs,
    gu_cs,
    out_ptr,
    out_rs,
    out_cs,
    rows,
    inter,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    EMULATE: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r < rows)[:, None] & (offs_c < inter)[None, :]
    r = offs_r.to(tl.int64)[:, None]
    c = offs_c.to(tl.int64)[None, :]
    gate = tl.load(gu_ptr + r * gu_rs + c * gu_cs, mask=mask, other=0.0)
    up = tl.load(gu_ptr + r * gu_rs + (c + inter) * gu_cs, mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # F.silu, x / (1 + exp(-x)) in float32 as torch computes it, rounded as its own op. exp
    # is taken in float64 and rounded: the GPU's float32 exp is an approximation whose error
    # grows with |x| (tens of ulps near x = -88); rounded, it overflows where torch's does.
    g = gate.to(tl.float32)
    e = tl.exp(-gate.to(tl.float64)).to(tl.float32)
    silu = round_to(tl.math.div_rn(g, 1.0 + e), dtype, EMULATE)
    out = round_to(silu.to(tl.float32) * up.to(tl.float32), dtype, EMULATE)
    tl.store(out_ptr + r * out_rs + c * out_cs, out, mask=mask)


def _emulate(t: torch.Tensor) -> bool:
    """The interpreter's bfloat16 workaround: CPU tensors only (meta ones keep the GPU's)."""
    return t.device.type == "cpu"


def _checked_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A caller's output buffer, as the kernels write it: contiguous, this shape and dtype."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"output buffer {tuple(out.shape)} {out.dtype} does not fit "
            f"{tuple(shape)} {dtype} contiguous"
        )
    return out


class TritonFusedOps:
    """One dtype's fused steps, as common.model.cpu.fused_ops.FusedOps: every tensor on one
    device in that dtype (positions and slots int), outputs new tensors, contiguous unless
    said otherwise."""

    def __init__(self, dtype: torch.dtype) -> None:
        assert dtype in _DTYPES
        self.dtype = dtype

    def add_rms_norm(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As FusedOps.add_rms_norm: x += y in place, then weight * rms_norm(x)."""
        assert x.is_contiguous() and weight.is_contiguous() and x.dim() == 2
        rows, hidden = x.shape
        h = torch.empty_like(x) if out is None else _checked_out(out, x.shape, x.dtype)
        if rows == 0:
            return h
        block = triton.next_power_of_2(hidden)
        launch(
            _add_rms_norm_kernel,
            (rows,),
            x,
            x if y is None else y,
            0 if y is None else y.stride(0),
            0 if y is None else y.stride(1),
            weight,
            h,
            hidden,
            eps,
            HAS_Y=y is not None,
            BLOCK=block,
            EMULATE=_emulate(x),
            num_warps=max(1, min(16, block // 512)),
        )
        return h

    def rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin_rot: torch.Tensor,
        pool_tokens: torch.Tensor,
        slots: torch.Tensor,
        k_offset: int,
        v_offset: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As FusedOps.rope_store: q and k rotated, k and v written to the pool's slots."""
        assert positions.is_contiguous() and slots.is_contiguous() and pool_tokens.is_contiguous()
        assert cos.is_contiguous() and sin_rot.is_contiguous() and head_dim % 2 == 0
        rows = qkv.shape[0]
        shape = (rows, heads + kv_heads, head_dim)
        qk = (
            torch.empty(shape, dtype=qkv.dtype, device=qkv.device)
            if out is None
            else _checked_out(out, shape, qkv.dtype)
        )
        if rows == 0:
            return qk
        launch(
            _rope_store_kernel,
            (rows,),
            qkv,
            qkv.stride(0),
            qkv.stride(1),
            positions,
            cos,
            sin_rot,
            qk,
            pool_tokens,
            slots,
            k_offset,
            v_offset,
            HEADS=heads,
            KV_HEADS=kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(heads + kv_heads),
            BLOCK_KV=triton.next_power_of_2(kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
            EMULATE=_emulate(qkv),
            num_warps=4,
            enable_fp_fusion=False,
        )
        return qk

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up [rows, 2 * inter] (any 2-D view): silu(gate) * up, [rows, inter]; a
        transposed view when gate_up is one (as FusedOps gives it). `out` (contiguous
        [rows, inter]) is used unless gate_up is transposed."""
        rows, width = gate_up.shape
        inter = width // 2
        transposed = gate_up.stride(0) == 1 and gate_up.stride(1) != 1
        if transposed:
            out = torch.empty(inter, rows, dtype=gate_up.dtype, device=gate_up.device).t()
        elif out is None:
            out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        else:
            out = _checked_out(out, (rows, inter), gate_up.dtype)
        if rows == 0 or inter == 0:
            return out
        # tiles long along the unit stride: rows when transposed, columns otherwise
        block_r, block_c = (64, 16) if transposed else (4, 256)
        grid = (triton.cdiv(rows, block_r), triton.cdiv(inter, block_c))
        launch(
            _silu_mul_kernel,
            grid,
            gate_up,
            gate_up.stride(0),
            gate_up.stride(1),
            out,
            out.stride(0),
            out.stride(1),
            rows,
            inter,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            EMULATE=_emulate(gate_up),
            num_warps=4,
        )
        return out


def triton_fused_ops(
    device: torch.device, dtype: torch.dtype, *, always: bool = False
) -> TritonFusedOps | None:
    """The fused steps for this model on CUDA, or None (Triton missing, another device or
    dtype). `always` offers them on the CPU too, under TRITON_INTERPRET=1 (tests); on `meta` (a dry
    run) they are offered as on CUDA."""
    if dtype not in _DTYPES or not triton_runs_on(device):
        return None
    if device.type == "cpu" and not (always and interpreting()):
        return None
    return TritonFusedOps(dtype)
