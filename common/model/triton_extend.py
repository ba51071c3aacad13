"""Paged extend attention in Triton for CUDA: flash attention over every span of a batch in
one launch, keys read through a page table of page ids where they lie (the layout and the
shared pieces: common/model/triton_attention.py). Softmax and sums in float32 in every dtype;
under TRITON_INTERPRET=1 the kernel runs on CPU tensors (the tests)."""

from __future__ import annotations

import torch

from common.model.triton_attention import (
    LOG2_E,
    MIN_DOT,
    attend_block,
    checked_groups,
    checked_out,
    dot_settings,
    round_to,
    tl,
    triton,
    triton_jit,
    unit_last,
)
from common.model.triton_launch import launch

# query rows and keys per step of an extend program: in float32 (IEEE products, twice the
# bytes) 64 x 64 spills about 2.7 KB of registers on sm_90 and 32 x 32 none to speak of
# (bench/triton_aot.py)
EXTEND_BLOCKS = {torch.float32: (32, 32)}
EXTEND_BLOCK_M, EXTEND_BLOCK_N = 64, 64
# strides and the layer vary between calls of one model: one compile serves them all
EXTEND_GENERIC = [
    "row_stride",
    "table_stride",
    "starts_stride",
    "num_new_stride",
    "prefixes_stride",
    "q_st",
    "q_sh",
    "out_st",
    "layer",
]


@triton_jit(do_not_specialize=EXTEND_GENERIC)
def _extend_kernel(
    pool_ptr,
    row_stride,
    table_ptr,
    table_stride,
    starts_ptr,
    starts_stride,
    num_new_ptr,
    num_new_stride,
    prefixes_ptr,
    prefixes_stride,
    q_ptr,
    q_st,
    q_sh,
    out_ptr,
    out_st,
    layer,
    scale_log2,
    GROUPS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    LAYER_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    span = tl.program_id(0)
    block_m = tl.program_id(1)
    head = tl.program_id(2)
    num_new = tl.load(num_new_ptr + span * num_new_stride).to(tl.int32)
    if block_m * BLOCK_M >= num_new:  # the grid covers the longest span
        return
    q_start = tl.load(starts_ptr + span * starts_stride).to(tl.int64)
    prefix = tl.load(prefixes_ptr + span * prefixes_stride).to(tl.int32)
    kv_head = head // GROUPS

    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qo_mask = (offs_m < num_new)[:, None] & (offs_d < HEAD_DIM)[None, :]
    tok = q_start + offs_m
    q = tl.load(
        q_ptr + tok[:, None] * q_st + head * q_sh + offs_d[None, :], mask=qo_mask, other=0.0
    )
    q_pos = prefix + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row_ptr = table_ptr + span.to(tl.int64) * table_stride
    # keys before the block's first position are seen by every row: no mask; then the
    # blocks the causal diagonal crosses, up to the block's last query position
    first_pos = prefix + block_m * BLOCK_M
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    end = prefix + tl.minimum(num_new, (block_m + 1) * BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = attend_block(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            pool_ptr,
            table_row_ptr,
            row_stride,
            layer,
            pos,
            pos < full_end,
            kv_head,
            scale_log2,
            KV_HEADS,
            HEAD_DIM,
            PAGE,
            LAYER_ROWS,
            BLOCK_D,
            False,
            PREC,
            UPCAST,
        )
    for n0 in range(full_end, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = attend_block(
            acc,
            m_i,
            l_i,
            q,
            q_pos,
            pool_ptr,
            table_row_ptr,
            row_stride,
            layer,
            pos,
            pos < end,
            kv_head,
            scale_log2,
            KV_HEADS,
            HEAD_DIM,
            PAGE,
            LAYER_ROWS,
            BLOCK_D,
            True,
            PREC,
            UPCAST,
        )
    out = round_to(acc / l_i[:, None], out_ptr.dtype.element_ty, UPCAST)
    tl.store(out_ptr + tok[:, None] * out_st + head * HEAD_DIM + offs_d[None, :], out, mask=qo_mask)


def paged_extend_attention(
    pool_rows: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    num_new: torch.Tensor,
    prefixes: torch.Tensor,
    max_new: int,
    layer: int,
    q: torch.Tensor,
    page_size: int,
    num_layers: int,
    scale: float,
    num_kv_heads: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a batch of extend spans over their pages, one launch.

    Span s's new tokens are rows q_starts[s] .. q_starts[s] + num_new[s] - 1 of q [T, heads,
    head_dim] (rows of any stride), at positions prefixes[s] .. prefixes[s] + num_new[s] - 1;
    its keys, positions 0 .. prefixes[s] + num_new[s] - 1, are all read from its pages
    page_table[s] ([S, W] int32 page ids, padded; the new tokens' K and V are in the pages
    already).
    q_starts, num_new, prefixes: [S] int (any stride); max_new: the largest num_new, known
    to the host. Returns [T, heads * head_dim] in q's dtype (into `out` if given); rows of
    q that belong to no span are left unwritten."""
    tokens, heads, head_dim = q.shape
    groups = checked_groups(pool_rows, q, page_size, num_kv_heads)
    q = unit_last(q)
    assert page_table.dtype == torch.int32
    page_table = unit_last(page_table)
    out = checked_out(out, tokens, heads * head_dim, q)
    num_spans = num_new.shape[0]
    if num_spans == 0 or max_new <= 0:
        return out
    prec, upcast = dot_settings(q)
    block_m, block_n = EXTEND_BLOCKS.get(q.dtype, (EXTEND_BLOCK_M, EXTEND_BLOCK_N))
    grid = (num_spans, triton.cdiv(max_new, block_m), heads)
    launch(
        _extend_kernel,
        grid,
        pool_rows,
        pool_rows.stride(0),
        page_table,
        page_table.stride(0),
        q_starts,
        q_starts.stride(0),
        num_new,
        num_new.stride(0),
        prefixes,
        prefixes.stride(0),
        q,
        q.stride(0),
        q.stride(1),
        out,
        out.stride(0),
        layer,
        scale * LOG2_E,
        GROUPS=groups,
        KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=page_size,
        LAYER_ROWS=2 * num_layers,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        PREC=prec,
        UPCAST=upcast,
        num_warps=4,
        num_stages=2,
    )
    return out
