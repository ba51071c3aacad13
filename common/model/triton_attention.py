"""Paged attention in Triton for CUDA: decode reads K/V where the pages lie; what the
decode and extend kernels (common/model/triton_extend.py) share.

Both kernels look each key up through a page table of page ids (int32, one row per
sequence: for decode the decode node's per-request table, common.model.decode_slots, read
through each batch row's slot), so no layer gathers its pages into a copy and no KV head
is repeated for its query heads. Page p's layer-l K is row p * LAYER_ROWS + 2 * l of
KVPool.rows (its V the next row; LAYER_ROWS = 2 * layers). Decode runs one program per
(sequence, KV head, split of its keys) with that KV head's query heads as the rows of one
block; each sequence's split count is data (`decode_split_counts`, from the lengths) read
by the programs of a grid sized for MAX_SPLITS, so a decode step is captured in a CUDA graph
once and a long sequence is cut finer than a short one; a small kernel merges the splits of
the sequences that have several. Extend runs flash attention over every span of the batch
in one launch. Softmax and sums are in float32 in every dtype. Layers, strides and row counts
are not specialised on (one compile serves every layer and batch: common.model.triton_launch).
Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests); the block sizes
are first guesses, not yet tuned on a GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from common.model.triton_launch import launch

try:
    import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]
except ImportError:  # the CPU image has no Triton: the module imports, nothing is offered
    triton = None
    tl = None


def triton_jit(fn: Callable[..., Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[no-untyped-def]
    """triton.jit, with or without arguments (do_not_specialize=...); where Triton is
    missing the kernels stay plain (never called) functions."""
    if triton is None:
        return fn if fn is not None else (lambda f: f)
    if fn is not None:
        return triton.jit(fn)
    return triton.jit(**kwargs)


DECODE_BLOCK_N = 64  # keys per step of a decode program
MIN_KEYS_PER_SPLIT = 256  # a decode split gets at least this many keys
MAX_SPLITS = 32  # splits of one sequence at most: the decode grid's third side
PROGRAMS_PER_SM = 2  # the split rule aims at about this many (sequence, head, split) programs
MIN_DOT = 16  # tl.dot's smallest block side
CPU_NUM_SMS = 8  # what the split rule assumes off CUDA (the interpreter, a dry run)
LOG2_E = 1.4426950408889634  # the kernels take exp2: scores scaled by scale * log2(e)
# strides, layers and row counts vary between calls of one model: a compile serves them all
DECODE_GENERIC = ["row_stride", "table_stride", "q_sb", "q_sh", "out_sb", "layer"]


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter, on CPU tensors (TRITON_INTERPRET=1, set
    before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    """Triton imports, and there is a CUDA device or Triton's interpreter (TRITON_INTERPRET=1)."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels serve a model on `device`: CUDA where torch sees one,
    the CPU under the interpreter, and `meta` (a dry run: launches are recorded, never
    run; common.model.triton_launch) wherever Triton imports."""
    if triton is None:
        return False
    if device.type == "meta":
        return True
    return triton_available()


def _mend_interpreter() -> None:
    """Triton 3.6's interpreter turns a loop bound held in a tensor into an int with int() of
    a one-element array, which numpy 2.4 refuses (triton-lang/triton#9171, fixed after 3.6):
    wrap the function that installs that conversion so it takes the element (the same where
    Triton already does). Interpreter only, at import."""
    from triton.runtime import interpreter  # type: ignore[import-untyped, unused-ignore]

    install = getattr(interpreter, "_patch_lang_tensor", None)
    if install is None or getattr(install, "is_mended", False):
        return

    def mended(tensor, scope):  # type: ignore[no-untyped-def]
        install(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    mended.is_mended = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = mended


if triton is not None and interpreting():
    _mend_interpreter()


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_NUM_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def decode_split_counts(
    seq_lens: Sequence[int] | np.ndarray, kv_heads: int, sms: int
) -> np.ndarray:
    """Into how many key ranges each sequence of a decode batch is cut (int32, one per
    sequence): the batch's keys shared out so that about PROGRAMS_PER_SM programs per SM
    run, every split at least MIN_KEYS_PER_SPLIT keys (whole blocks) and at most MAX_SPLITS
    per sequence. A long sequence gets more splits than the short ones beside it, so it
    does not hold the whole batch up; a batch that fills the SMs by itself gets one each.
    From the lengths the host holds: no device value is read."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    if lens.size == 0:
        return np.zeros(0, dtype=np.int32)
    per_program = -(-int(lens.sum()) * kv_heads // (PROGRAMS_PER_SM * sms))
    keys = max(MIN_KEYS_PER_SPLIT, -(-per_program // DECODE_BLOCK_N) * DECODE_BLOCK_N)
    return np.clip(-(-lens // keys), 1, MAX_SPLITS).astype(np.int32)


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("Triton is not installed")


def dot_settings(q: torch.Tensor) -> tuple[str, bool]:
    """tl.dot's input precision (IEEE in float32: TF32 would cost about three digits) and
    whether to work around the interpreter in 16 bits: it multiplies bfloat16 as raw
    integers, so the dot's operands (exact in float32) are widened first, and its float32 to
    bfloat16 cast truncates, so values are rounded on the bits (round_to). Only CPU tensors
    run in the interpreter (a dry run's meta tensors keep the GPU's settings)."""
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    return prec, q.device.type == "cpu" and q.dtype != torch.float32


@triton_jit
def round_to(x, DTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """float32 x rounded to DTYPE, to nearest even as torch and the GPU round. EMULATE (the
    interpreter, whose float32 to bfloat16 cast truncates) rounds bfloat16 on the bits."""
    if EMULATE and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))  # NaN stays NaN, overflow becomes inf
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton_jit
def attend_block(
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
    key_valid,
    kv_head,
    scale_log2,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    LAYER_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One online-softmax step of a query block over the keys at positions `pos` (those
    where `key_valid`; with CAUSAL only those at or before each row's `q_pos`), each found
    through the sequence's page table row (page ids): nothing is read for an invalid key."""
    offs_d = tl.arange(0, BLOCK_D)
    # one table entry per key (the keys of one page share it)
    page = tl.load(table_row_ptr + pos // PAGE, mask=key_valid, other=0).to(tl.int64)
    row = page * LAYER_ROWS + 2 * layer
    base = row * row_stride + (pos % PAGE) * (KV_HEADS * HEAD_DIM)
    col = kv_head * HEAD_DIM + offs_d
    kv_mask = key_valid[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(pool_ptr + base[:, None] + col[None, :], mask=kv_mask, other=0.0)
    v = tl.load(pool_ptr + (base + row_stride)[:, None] + col[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=PREC)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
    visible = key_valid[None, :]
    if CAUSAL:
        visible = visible & (pos[None, :] <= q_pos[:, None])
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p_lo = round_to(p, v.dtype, UPCAST)  # the probabilities in the operands' dtype
    if UPCAST:
        pv = tl.dot(p_lo.to(tl.float32), v.to(tl.float32), input_precision=PREC)
    else:
        pv = tl.dot(p_lo, v, input_precision=PREC)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


@triton_jit(do_not_specialize=DECODE_GENERIC)
def _decode_kernel(
    pool_ptr,
    row_stride,
    table_ptr,
    table_stride,
    slots_ptr,
    lens_ptr,
    splits_ptr,
    q_ptr,
    q_sb,
    q_sh,
    out_ptr,
    out_sb,
    part_o_ptr,
    part_lse_ptr,
    layer,
    scale_log2,
    GROUPS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    LAYER_ROWS: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.load(splits_ptr + b).to(tl.int32)
    if split >= num_splits:  # the grid covers MAX_SPLITS; this sequence has fewer
        return
    seq_len = tl.load(lens_ptr + b).to(tl.int32)
    # this split's keys: whole blocks, the sequence's length cut into near-equal parts
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUPS + offs_g
    qo_mask = (offs_g < GROUPS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + b.to(tl.int64) * q_sb + heads[:, None] * q_sh + offs_d[None, :],
        mask=qo_mask,
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    table_row_ptr = table_ptr + slot * table_stride
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = attend_block(
            acc,
            m_i,
            l_i,
            q,
            pos,
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
            False,
            PREC,
            UPCAST,
        )
    if num_splits == 1:
        out = round_to(acc / l_i[:, None], out_ptr.dtype.element_ty, UPCAST)
        tl.store(
            out_ptr + b.to(tl.int64) * out_sb + heads[:, None] * HEAD_DIM + offs_d[None, :],
            out,
            mask=qo_mask,
        )
    else:
        # an empty split (its range past the sequence's end) leaves weight 0 for the merge
        has_keys = l_i > 0
        part_out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part = (b.to(tl.int64) * (KV_HEADS * GROUPS) + heads) * MAX_SPLITS + split
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], part_out, mask=qo_mask)
        tl.store(part_lse_ptr + part, lse, mask=offs_g < GROUPS)


@triton_jit(do_not_specialize=["out_sb"])
def _merge_splits_kernel(
    part_o_ptr,
    part_lse_ptr,
    splits_ptr,
    out_ptr,
    out_sb,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_splits = tl.load(splits_ptr + b).to(tl.int32)
    if num_splits == 1:  # the decode kernel wrote this sequence's output itself
        return
    offs_s = tl.arange(0, MAX_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    part = (b.to(tl.int64) * HEADS + h) * MAX_SPLITS + offs_s
    valid = offs_s < num_splits
    lse = tl.load(part_lse_ptr + part, mask=valid, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 always has keys: the max is finite
    o = tl.load(
        part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=valid[:, None] & (offs_d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = round_to(tl.sum(o * w[:, None], 0) / tl.sum(w, 0), out_ptr.dtype.element_ty, EMULATE)
    tl.store(out_ptr + b.to(tl.int64) * out_sb + h * HEAD_DIM + offs_d, out, mask=offs_d < HEAD_DIM)


def checked_out(
    out: torch.Tensor | None, rows: int, width: int, like: torch.Tensor
) -> torch.Tensor:
    """`out`, or a new [rows, width] tensor in like's dtype and device when it is None."""
    if out is None:
        return torch.empty(rows, width, dtype=like.dtype, device=like.device)
    if tuple(out.shape) != (rows, width) or out.dtype != like.dtype or out.stride(1) != 1:
        raise ValueError(
            f"output buffer {tuple(out.shape)} {out.dtype} does not fit "
            f"{(rows, width)} {like.dtype} with unit column stride"
        )
    return out


def checked_groups(
    pool_rows: torch.Tensor, q: torch.Tensor, page_size: int, num_kv_heads: int
) -> int:
    """Query heads per KV head, after checking that Triton runs here and that the pool's
    rows, q [.., heads, head_dim] and the page size fit each other."""
    _require_triton()
    heads, head_dim = q.shape[1:]
    groups = heads // num_kv_heads
    assert groups * num_kv_heads == heads and pool_rows.is_contiguous()
    assert pool_rows.shape[1] == page_size * num_kv_heads * head_dim
    assert page_size & (page_size - 1) == 0, "page_size must be a power of two"
    return groups


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """t with a unit last stride (a copy only if it has none: a shape decision, capturable)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def paged_decode_attention(
    pool_rows: torch.Tensor,
    page_table: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    splits: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    page_size: int,
    num_layers: int,
    scale: float,
    num_kv_heads: int,
    out: torch.Tensor | None = None,
    *,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    merge: bool = True,
) -> torch.Tensor:
    """Attention of one query token per sequence over its pages.

    pool_rows: KVPool.rows (contiguous); page_table [R, W] int32 page ids, one row per
    slot (entries past a sequence's pages: any valid page, never read); slots [B] int, each
    sequence's row of the table; seq_lens [B] int, at least 1; splits [B] int32, each
    sequence's split count (1..MAX_SPLITS, decode_split_counts); q [B, heads, head_dim]
    (rows of any stride). Returns [B, heads * head_dim] in q's dtype (into `out` if given:
    that shape, unit column stride). `partials`: the split results' buffers ([B, heads,
    MAX_SPLITS, head_dim] and [B, heads, MAX_SPLITS] float32), made here when None;
    `merge` False when no sequence has more than one split (the host knows it): the merge
    kernel is skipped. No host synchronisation: capturable in a CUDA graph."""
    bsz, heads, head_dim = q.shape
    groups = checked_groups(pool_rows, q, page_size, num_kv_heads)
    assert page_table.dtype == torch.int32 and page_table.stride(1) == 1
    q = unit_last(q)
    out = checked_out(out, bsz, heads * head_dim, q)
    if bsz == 0:
        return out
    prec, upcast = dot_settings(q)
    if partials is None:
        partials = split_buffers(bsz, heads, head_dim, q.device)
    part_o, part_lse = partials
    launch(
        _decode_kernel,
        (bsz, num_kv_heads, MAX_SPLITS),
        pool_rows,
        pool_rows.stride(0),
        page_table,
        page_table.stride(0),
        slots,
        seq_lens,
        splits,
        q,
        q.stride(0),
        q.stride(1),
        out,
        out.stride(0),
        part_o,
        part_lse,
        layer,
        scale * LOG2_E,
        GROUPS=groups,
        KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE=page_size,
        LAYER_ROWS=2 * num_layers,
        MAX_SPLITS=MAX_SPLITS,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(groups)),  # query heads as a dot's rows
        BLOCK_N=DECODE_BLOCK_N,
        BLOCK_D=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        PREC=prec,
        UPCAST=upcast,
        num_warps=4,
        num_stages=2,
    )
    if merge:
        launch(
            _merge_splits_kernel,
            (bsz, heads),
            part_o,
            part_lse,
            splits,
            out,
            out.stride(0),
            HEADS=heads,
            HEAD_DIM=head_dim,
            MAX_SPLITS=MAX_SPLITS,
            BLOCK_D=triton.next_power_of_2(head_dim),
            EMULATE=upcast,
            num_warps=1,
        )
    return out


def split_buffers(
    bsz: int, heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's per-split outputs and log-sum-exps for `bsz` sequences."""
    return (
        torch.empty(bsz, heads, MAX_SPLITS, head_dim, dtype=torch.float32, device=device),
        torch.empty(bsz, heads, MAX_SPLITS, dtype=torch.float32, device=device),
    )
