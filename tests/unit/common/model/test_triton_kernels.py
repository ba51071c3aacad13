"""The Triton kernels (common.model.triton_attention, common.model.triton_fused) against plain
torch: on CUDA where torch sees a GPU, else on CPU tensors in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are defined: before Triton loads
pytest.importorskip("triton")

from common.model.llama import apply_rope, rms_norm
from common.model.triton_attention import (
    decode_split_counts,
    paged_decode_attention,
    triton_available,
)
from common.model.triton_extend import paged_extend_attention
from common.model.triton_fused import TritonFusedOps, triton_fused_ops
from tests.unit.common.model.test_fused_ops import (  # the C kernels' tests' yardsticks
    _close,
    _maybe_transposed,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYERS, LAYER = 2, 1


def _pool(
    num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """KVPool.rows' layout, every element NaN: a kernel that reads a slot it was not given
    (an unused page, a slot past a sequence's end) turns its output NaN."""
    return torch.full(
        (num_pages * 2 * LAYERS, page_size * kv_heads * head_dim), float("nan"), dtype=dtype
    )


def _fill(
    rows_t: torch.Tensor, pages: list[int], num_tokens: int, page_size: int, g: torch.Generator
) -> None:
    """Random K and V (every layer) in the first num_tokens slots of these pages."""
    for i, page in enumerate(pages):
        used = min(page_size, num_tokens - i * page_size)
        block = rows_t[page * 2 * LAYERS : (page + 1) * 2 * LAYERS].view(2 * LAYERS, page_size, -1)
        block[:, :used] = torch.randn(block[:, :used].shape, generator=g).to(rows_t.dtype)


def _attention64(
    rows_t: torch.Tensor,
    pages: list[int],
    q: torch.Tensor,
    q_pos: torch.Tensor,
    page_size: int,
    kv_heads: int,
) -> torch.Tensor:
    """float64 causal attention of q [n, heads, d] at positions q_pos over one sequence's
    pages (keys 0 .. max(q_pos)), each KV head repeated for its query heads."""
    n, heads, d = q.shape
    total = int(q_pos.max()) + 1
    base = torch.tensor(pages) * 2 * LAYERS + 2 * LAYER
    k = rows_t[base].view(-1, kv_heads, d)[:total].double()
    v = rows_t[base + 1].view(-1, kv_heads, d)[:total].double()
    k = k.repeat_interleave(heads // kv_heads, dim=1)  # [total, heads, d]
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.double(), k) * d**-0.5
    visible = torch.arange(total)[None, :] <= q_pos[:, None]
    probs = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
    return torch.einsum("hnt,thd->nhd", probs, v).reshape(n, heads * d)


def _assert_close(got: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: sums of a few hundred products of size ~1, to about 1e-5 relative (seen:
    under 1e-6); 16-bit: the probabilities rounded for the tensor cores' product and the
    output rounded, a few units of the last place (seen: 2**-8.2 in bfloat16, 2**-11.3 in
    float16)."""
    assert not got.isnan().any(), "a slot that is not the sequence's was read"
    tol = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    err = (got.double().cpu() - expect).abs().max().item()
    assert err <= tol * max(1.0, expect.abs().max().item()), err


# (heads, kv_heads, head_dim, page_size): multi-head, SmolLM2's 3 query heads per KV head,
# 4 per KV head with a 128 head dim and 64-token pages, 8 per KV head with a head dim that
# is no power of two (a masked block)
ATTN_SHAPES = [(4, 4, 64, 16), (9, 3, 64, 16), (8, 2, 128, 64), (8, 1, 80, 4)]


def _decode_case(
    shape: tuple[int, int, int, int], lens: list[int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """A pool, a page table of page ids whose rows are the sequences' slots (in no order,
    among rows nobody uses), the slots, the lengths, q, and each sequence's pages."""
    heads, kv_heads, d, ps = shape
    g = torch.Generator().manual_seed(seed)
    width = max(-(-n // ps) for n in lens) + 2  # wider than any sequence: padding entries
    num_pages = len(lens) * width + 3  # some pages nobody uses: NaN
    rows_t = _pool(num_pages, ps, kv_heads, d, dtype)
    order = torch.randperm(num_pages, generator=g).tolist()  # pages anywhere, in no order
    nobody = order[0]
    slots = torch.randperm(len(lens) + 3, generator=g)[: len(lens)]
    table = torch.full((len(lens) + 3, width), nobody, dtype=torch.int32)
    tables = []
    for b, n in enumerate(lens):
        pages = [order.pop() for _ in range(-(-n // ps))]
        _fill(rows_t, pages, n, ps, g)
        tables.append(pages)
        table[slots[b], : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    # q as the model passes it: a view with the K heads after the query heads in each row
    qk = torch.randn(len(lens), heads + kv_heads, d, generator=g).to(dtype)
    return rows_t, table, slots, torch.tensor(lens), qk[:, :heads], tables


def _decode(rows_t, table, slots, lens_t, q, ps, kv_heads, splits=None, out=None, sms=132):
    """paged_decode_attention on DEVICE, splits by the rule unless given."""
    if splits is None:
        splits = torch.from_numpy(decode_split_counts(lens_t.tolist(), kv_heads, sms))
    return paged_decode_attention(
        rows_t.to(DEVICE),
        table.to(DEVICE),
        slots.to(DEVICE),
        lens_t.to(DEVICE),
        splits.to(DEVICE),
        LAYER,
        q.to(DEVICE),
        ps,
        LAYERS,
        q.shape[-1] ** -0.5,
        kv_heads,
        out=out,
        merge=bool(splits.max() > 1),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_decode_equals_attention_over_the_gathered_pages(dtype, shape):
    """Ragged lengths (one token, exactly a page, many pages, a partial last page) in one
    batch, read through their slots' rows; padding table entries on NaN pages and NaN past
    each sequence's last token."""
    heads, kv_heads, d, ps = shape
    lens = [1, ps, 5 * ps + 3, 2]
    rows_t, table, slots, lens_t, q, tables = _decode_case(shape, lens, dtype, d + ps + heads)
    out = _decode(rows_t, table, slots, lens_t, q, ps, kv_heads)
    assert out.shape == (len(lens), heads * d) and out.dtype == dtype
    for b, n in enumerate(lens):
        expect = _attention64(rows_t, tables[b], q[b : b + 1], torch.tensor([n - 1]), ps, kv_heads)
        _assert_close(out[b : b + 1], expect, dtype)


@pytest.mark.parametrize(
    ("splits", "dtype"),
    [
        ([1, 1, 1], torch.float32),
        ([2, 2, 2], torch.float32),
        ([1, 5, 2], torch.float32),
        ([32, 3, 1], torch.float32),
        ([3, 1, 2], torch.bfloat16),
    ],
)
def test_decode_splits_merge_to_the_same_attention(splits, dtype):
    """Each sequence's own split count: partial softmaxes merged by their log-sum-exps;
    splits past a short sequence's end hold no keys (weight 0); a sequence with one split
    is written by the decode kernel alone; the output is written where asked."""
    shape = (6, 2, 64, 16)
    lens = [3, 150, 40]
    rows_t, table, slots, lens_t, q, tables = _decode_case(shape, lens, dtype, seed=7)
    out = torch.full((len(lens), 6 * 64), float("nan"), dtype=dtype, device=DEVICE)
    split_t = torch.tensor(splits, dtype=torch.int32)
    got = _decode(rows_t, table, slots.int(), lens_t.int(), q, 16, 2, splits=split_t, out=out)
    assert got is out
    for b, n in enumerate(lens):
        expect = _attention64(rows_t, tables[b], q[b : b + 1], torch.tensor([n - 1]), 16, 2)
        _assert_close(out[b : b + 1], expect, dtype)


def test_decode_split_rule_shares_the_keys_by_sequence_length():
    # one short sequence on many SMs: split, at most once per 256 keys
    assert decode_split_counts([2048], 2, 132).tolist() == [8]
    assert decode_split_counts([32768], 8, 132).tolist() == [32]  # capped
    assert decode_split_counts([1], 1, 132).tolist() == [1]  # nothing to split
    # a full batch fills the SMs alone: one split each ...
    assert set(decode_split_counts([4096] * 256, 8, 132).tolist()) == {1}
    # ... but one long sequence among short ones is cut finer than they are (it would hold
    # the whole batch up: 8 KV heads, 127 x 2k and one 32k at batch 128)
    counts = decode_split_counts([2048] * 127 + [32768], 8, 132)
    assert set(counts[:127].tolist()) == {1} and counts[127] >= 4
    assert decode_split_counts([], 8, 132).size == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_is_captured_in_a_cuda_graph_and_replays_new_lengths():
    shape = (8, 2, 128, 16)
    lens = [40, 300, 7]
    rows_t, table, slots, lens_t, q, tables = _decode_case(shape, lens, torch.bfloat16, seed=11)
    args = [t.to(DEVICE) for t in (rows_t, table, slots, lens_t)]
    splits = torch.tensor([1, 4, 2], dtype=torch.int32, device=DEVICE)
    q_d = q.to(DEVICE)

    def step() -> torch.Tensor:
        return paged_decode_attention(
            *args, splits, LAYER, q_d, 16, LAYERS, 128**-0.5, 2, merge=True
        )

    step()  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    args[3].copy_(torch.tensor([39, 290, 1]))  # new values in the captured tensors
    splits.copy_(torch.tensor([2, 1, 1], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    for b, n in enumerate([39, 290, 1]):
        expect = _attention64(rows_t, tables[b], q[b : b + 1], torch.tensor([n - 1]), 16, 2)
        _assert_close(out[b : b + 1], expect, torch.bfloat16)


# per span (cached prefix, new tokens): no prefix; a prefix ending mid-page; one new token
# after a prefix; a span longer than one query block; a whole-page prefix
EXTEND_SPANS = [(0, 37), (21, 11), (50, 1), (3, 70), (16, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (8, 2, 128, 64), (4, 4, 64, 1)])
def test_extend_equals_causal_attention_over_the_gathered_pages(dtype, shape):
    """Spans of several lengths in one launch, each reading its prefix and its new tokens
    from its pages; NaN in unused pages, in the padding and past each span's last token."""
    heads, kv_heads, d, ps = shape
    g = torch.Generator().manual_seed(d + ps)
    spans = EXTEND_SPANS if ps > 1 else EXTEND_SPANS[1:3]  # one-token pages: a short case
    totals = [p + n for p, n in spans]
    width = max(-(-t // ps) for t in totals)
    num_pages = sum(-(-t // ps) for t in totals) + 2
    rows_t = _pool(num_pages, ps, kv_heads, d, dtype)
    order = torch.randperm(num_pages, generator=g).tolist()
    tables, table = [], torch.empty(len(spans), width, dtype=torch.int32)
    for s, total in enumerate(totals):
        pages = [order.pop() for _ in range(-(-total // ps))]
        _fill(rows_t, pages, total, ps, g)
        tables.append(pages)
        table[s] = torch.tensor(pages + [order[0]] * (width - len(pages)))
    num_tokens = sum(n for _, n in spans)
    qk = torch.randn(num_tokens, heads + kv_heads, d, generator=g).to(dtype)
    q = qk[:, :heads]  # a view, as the model passes it
    starts = [sum(n for _, n in spans[:s]) for s in range(len(spans))]
    # the spans' columns unbound from one [S, 3] tensor, as the backend's prepare() does
    meta = torch.tensor([[st, n, p] for st, (p, n) in zip(starts, spans, strict=True)]).to(DEVICE)
    q_starts, num_new, prefixes = meta.unbind(1)
    out = paged_extend_attention(
        rows_t.to(DEVICE),
        table.to(DEVICE),
        q_starts,
        num_new,
        prefixes,
        max(n for _, n in spans),
        LAYER,
        q.to(DEVICE),
        ps,
        LAYERS,
        d**-0.5,
        kv_heads,
    )
    assert out.shape == (num_tokens, heads * d) and out.dtype == dtype
    for s, (prefix, n) in enumerate(spans):
        rows = slice(starts[s], starts[s] + n)
        expect = _attention64(rows_t, tables[s], q[rows], prefix + torch.arange(n), ps, kv_heads)
        _assert_close(out[rows], expect, dtype)


def test_extend_writes_only_its_spans_rows_of_out():
    """`out` given with a row stride (the model's workspace): span rows written, the rest
    (a token in no span) left as they were."""
    heads, kv_heads, d, ps = 4, 2, 64, 16
    g = torch.Generator().manual_seed(3)
    rows_t = _pool(4, ps, kv_heads, d, torch.float32)
    _fill(rows_t, [2, 0], 20, ps, g)
    q = torch.randn(6, heads, d, generator=g)
    wide = torch.full((6, heads * d + 8), -7.0, device=DEVICE)
    out = wide[:, : heads * d]
    table = torch.tensor([[2, 0]], dtype=torch.int32).to(DEVICE)
    one = torch.tensor([1], device=DEVICE)  # q rows 1..5: positions 15..19
    paged_extend_attention(
        rows_t.to(DEVICE),
        table,
        one,
        one * 5,
        one * 15,
        5,
        LAYER,
        q.to(DEVICE),
        ps,
        LAYERS,
        d**-0.5,
        kv_heads,
        out=out,
    )
    expect = _attention64(rows_t, [2, 0], q[1:], 15 + torch.arange(5), ps, kv_heads)
    _assert_close(out[1:], expect, torch.float32)
    assert bool((wide[0] == -7).all()) and bool((wide[:, heads * d :] == -7).all())


# --- the fused steps, checked as tests/unit/common/model/test_fused_ops.py checks the C ones ---

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _ops(dtype: torch.dtype) -> TritonFusedOps:
    ops = triton_fused_ops(DEVICE, dtype, always=True)
    assert ops is not None and triton_available()
    return ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_add_rms_norm(dtype, transposed):
    g = torch.Generator().manual_seed(5)
    rows, hidden = 9, 576
    x = (torch.randn(rows, hidden, generator=g) * 4).to(dtype).to(DEVICE)
    y = _maybe_transposed(torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE), transposed)
    w = (torch.randn(hidden, generator=g) * 0.3 + 1).to(dtype).to(DEVICE)
    expect_x = x + y
    expect_h = rms_norm(expect_x, w, 1e-5)
    got_x = x.clone()
    out = torch.empty_like(x)
    got_h = _ops(dtype).add_rms_norm(got_x, y, w, 1e-5, out=out)
    assert got_h is out
    assert torch.equal(got_x, expect_x)  # the residual add rounds as torch's does, exactly
    # the norm's sum runs in another order: an ulp or two of float32, at most one of 16 bits
    ulps = 8 if dtype == torch.float32 else 1
    _close(got_h, expect_h, ulps)
    _close(_ops(dtype).add_rms_norm(x.clone(), None, w, 1e-5), rms_norm(x, w, 1e-5), ulps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_rope_store_rotates_like_apply_rope_and_writes_the_pool(dtype, transposed):
    g = torch.Generator().manual_seed(6)
    rows, heads, kv_heads, d, ps = 7, 9, 3, 64, 16
    qkv = _maybe_transposed(
        torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype), transposed
    ).to(DEVICE)
    positions = torch.randint(0, 500, (rows,), generator=g).to(DEVICE)
    angles = torch.outer(torch.arange(512, dtype=torch.float32), torch.rand(d // 2, generator=g))
    emb = torch.cat([angles, angles], dim=-1)
    cos = emb.cos().to(dtype).to(DEVICE)
    sin = emb.sin().to(dtype)
    sin_rot = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], dim=-1).to(DEVICE)
    pages = 20
    pool = torch.zeros(pages * LAYERS * 2 * ps, kv_heads * d, dtype=dtype, device=DEVICE)
    slots = torch.randperm(pages * ps, generator=g)[:rows]
    slots = ((slots // ps) * (LAYERS * 2 * ps) + slots % ps).to(DEVICE)  # layer 0's K slots
    expect_pool = pool.clone()
    qk_size = (heads + kv_heads) * d
    expect = apply_rope(
        qkv[:, :qk_size].reshape(rows, heads + kv_heads, d), cos[positions], sin_rot[positions]
    )
    k_slots = slots + 2 * LAYER * ps
    expect_pool.index_copy_(0, k_slots, expect[:, heads:].reshape(rows, kv_heads * d))
    expect_pool.index_copy_(0, k_slots + ps, qkv[:, qk_size:])
    got = _ops(dtype).rope_store(
        qkv, positions, cos, sin_rot, pool, slots, 2 * LAYER * ps, ps, heads, kv_heads, d
    )
    assert torch.equal(got, expect)  # products and the add rounded where torch rounds them
    assert torch.equal(pool, expect_pool)  # and nothing else in the pool written


# the interpreter's numpy warns where exp overflows and inf / inf is NaN, as meant here
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_silu_mul(dtype, transposed):
    g = torch.Generator().manual_seed(8)
    rows, inter = 9, 300
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, 1e-30, -1e-30])
    gate_up[1, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), 90.0])
    gate_up = _maybe_transposed(gate_up.to(dtype), transposed).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    expect = F.silu(gate) * up
    got = _ops(dtype).silu_mul(gate_up)
    assert got.stride(0) == (1 if transposed else inter)  # transposed in, transposed out
    assert torch.equal(got.isnan(), expect.isnan())
    assert torch.equal(got.isinf(), expect.isinf())
    finite = expect.isfinite()
    inf = ~finite & ~expect.isnan()
    assert torch.equal(got[inf], expect[inf])
    # exp differs from torch's by a few float32 ulps: at most one ulp of 16 bits
    _close(got[finite], expect[finite], 16 if dtype == torch.float32 else 1)


def test_fused_ops_offered_on_cuda_only_unless_forced():
    assert triton_fused_ops(torch.device("cpu"), torch.float32) is None
    assert triton_fused_ops(DEVICE, torch.int8, always=True) is None
    assert triton_fused_ops(DEVICE, torch.bfloat16, always=True) is not None
