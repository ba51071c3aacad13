"""Paged attention in Triton for CUDA: decode reads K/V where the pages lie; what the
decode and extend kernels (common/model/triton_extend.py) share.

Both kernels look each key up through the page table (KVPool.rows: per page and layer a K
row then a V row of page_size * kv_heads * head_dim elements), so no layer gathers its pages
into a copy and no KV head is repeated for its query heads. Decode runs one program per
(sequence, KV head, split of the key range) with that KV head's query heads as the rows of
one block, then a small kernel merges the splits; the split count comes from shapes alone,
so a decode step can be captured in a CUDA graph. Extend runs flash attention over every
span of the batch in one launch. Softmax and sums are in float32 in every dtype. Under
TRITON_INTERPRET=1 the same kernels run on CPU tensors (the tests); the block sizes and the
split rule are first guesses, not yet tuned on a GPU.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]

    triton_jit = triton.jit
except ImportError:  # the CPU image has no Triton: the module imports, nothing is offered
    triton = None
    tl = None

    def triton_jit(fn):  # type: ignore[no-untyped-def]
        """Where Triton is missing the kernels stay plain (never called) functions."""
        return fn


DECODE_BLOCK_N = 64  # keys per step of a decode program
MIN_KEYS_PER_SPLIT = 256  # a decode split gets at least this many keys of the longest sequence
MAX_SPLITS = 32
MIN_DOT = 16  # tl.dot's smallest block side
CPU_NUM_SMS = 8  # what the split rule assumes under the interpreter
LOG2_E = 1.4426950408889634  # the kernels take exp2: scores scaled by scale * log2(e)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter, on CPU tensors (TRITON_INTERPRET=1, set
    before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    """Triton imports, and there is a CUDA device or Triton's interpreter (TRITON_INTERPRET=1)."""
    return triton is not None and (torch.cuda.is_available() or interpreting())


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
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_NUM_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def decode_splits(batch: int, kv_heads: int, width: int, page_size: int, num_sms: int) -> int:
    """Into how many key ranges each sequence is cut: about two programs per SM when few
    (sequence, KV head) pairs would leave SMs idle, never a range shorter than
    MIN_KEYS_PER_SPLIT keys of the table's width. Shapes only, never values: capturable."""
    want = -(-2 * num_sms // (batch * kv_heads))
    most = -(-width * page_size // MIN_KEYS_PER_SPLIT)
    return max(1, min(want, most, MAX_SPLITS))


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("Triton is not installed")


def dot_settings(q: torch.Tensor) -> tuple[str, bool]:
    """tl.dot's input precision (IEEE in float32: TF32 would cost about three digits) and
    whether to work around the interpreter in 16 bits: it multiplies bfloat16 as raw
    integers, so the dot's operands (exact in float32) are widened first, and its float32 to
    bfloat16 cast truncates, so values are rounded on the bits (round_to)."""
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    return prec, q.device.type != "cuda" and q.dtype != torch.float32


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
    table_col,
    row_stride,
    layer,
    pos,
    key_valid,
    kv_head,
    scale_log2,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One online-softmax step of a query block over the keys at positions `pos` (those
    where `key_valid`; with CAUSAL only those at or before each row's `q_pos`), each found
    through the sequence's page table row: nothing is read for an invalid key."""
    offs_d = tl.arange(0, BLOCK_D)
    # one table entry per key (the keys of one page share it)
    # table_col: the table's column stride (decode graphs keep it page-major)
    page_row = tl.load(table_row_ptr + (pos // PAGE) * table_col, mask=key_valid, other=0).to(
        tl.int64
    )
    base = (page_row + 2 * layer) * row_stride + (pos % PAGE) * (KV_HEADS * HEAD_DIM)
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


@triton_jit
def _decode_kernel(
    pool_ptr,
    row_stride,
    table_ptr,
    table_stride,
    table_col,
    lens_ptr,
    lens_stride,
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
    SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b * lens_stride).to(tl.int32)
    # this split's keys: whole blocks, the sequence's length cut into SPLITS near-equal parts
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N
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
    table_row_ptr = table_ptr + b.to(tl.int64) * table_stride
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
            table_col,
            row_stride,
            layer,
            pos,
            pos < end,
            kv_head,
            scale_log2,
            KV_HEADS,
            HEAD_DIM,
            PAGE,
            BLOCK_D,
            False,
            PREC,
            UPCAST,
        )
    if SPLITS == 1:
        out = round_to(acc / l_i[:, None], out_ptr.dtype.element_ty, UPCAST)
        tl.store(
            out_ptr + b.to(tl.int64) * out_sb + heads[:, None] * HEAD_DIM + offs_d[None, :],
            out,
            mask=qo_mask,
        )
    else:
        # an empty split (a sequence shorter than the others) leaves weight 0 for the merge
        has_keys = l_i > 0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part = (b.to(tl.int64) * (KV_HEADS * GROUPS) + heads) * SPLITS + split  # [BLOCK_G]
        tl.store(part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=qo_mask)
        tl.store(part_lse_ptr + part, lse, mask=offs_g < GROUPS)


@triton_jit
def _merge_splits_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    out_sb,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EMULATE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    part = (b.to(tl.int64) * HEADS + h) * SPLITS + offs_s
    lse = tl.load(part_lse_ptr + part, mask=offs_s < SPLITS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 always has keys: the max is finite
    o = tl.load(
        part_o_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=(offs_s < SPLITS)[:, None] & (offs_d < HEAD_DIM)[None, :],
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
    read_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    page_size: int,
    scale: float,
    num_kv_heads: int,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its pages.

    pool_rows: KVPool.rows (contiguous); read_rows [B, W] int, each page's layer-0 K row,
    padded past a sequence's pages with any valid row (never read); seq_lens [B] int, at
    least 1; q [B, heads, head_dim] (rows of any stride). Returns [B, heads * head_dim] in
    q's dtype (into `out` if given: that shape, unit column stride). `num_splits` overrides
    the split rule (decode_splits). No host synchronisation: capturable in a CUDA graph."""
    bsz, heads, head_dim = q.shape
    groups = checked_groups(pool_rows, q, page_size, num_kv_heads)
    q = unit_last(q)
    out = checked_out(out, bsz, heads * head_dim, q)  # read_rows: any strides
    if bsz == 0:
        return out
    width = read_rows.shape[1]
    splits = num_splits or decode_splits(bsz, num_kv_heads, width, page_size, _num_sms(q.device))
    prec, upcast = dot_settings(q)
    block_d = max(MIN_DOT, triton.next_power_of_2(head_dim))
    block_g = max(MIN_DOT, triton.next_power_of_2(groups))  # query heads as a dot's rows
    part_o = part_lse = out  # with one split the kernel writes `out` and nothing else
    if splits > 1:
        part_o = torch.empty(bsz, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bsz, heads, splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(bsz, num_kv_heads, splits)](
        pool_rows,
        pool_rows.stride(0),
        read_rows,
        read_rows.stride(0),
        read_rows.stride(1),
        seq_lens,
        seq_lens.stride(0),
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
        SPLITS=splits,
        BLOCK_G=block_g,
        BLOCK_N=DECODE_BLOCK_N,
        BLOCK_D=block_d,
        PREC=prec,
        UPCAST=upcast,
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        _merge_splits_kernel[(bsz, heads)](
            part_o,
            part_lse,
            out,
            out.stride(0),
            HEADS=heads,
            HEAD_DIM=head_dim,
            SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=triton.next_power_of_2(head_dim),
            EMULATE=upcast,
            num_warps=1,
        )
    return out
