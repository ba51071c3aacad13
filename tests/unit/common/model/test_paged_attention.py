"""Decode attention read from the pages in place (common.model.cpu.paged_attention): the same
attention as over gathered pages, and nothing read past a sequence's length."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.cpu.paged_attention import (
    PagedDecodeAttention,
    paged_decode_attention,
    splits_for,
)

CPU = torch.device("cpu")


def _pool(
    num_pages: int,
    layers: int,
    page_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    g: torch.Generator,
) -> torch.Tensor:
    """KVPool.rows' layout: per page, per layer, a K row then a V row."""
    return torch.randn(num_pages * 2 * layers, page_size * kv_heads * head_dim, generator=g).to(
        dtype
    )


def _reference(
    rows_t: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    layer: int,
    q: torch.Tensor,
    page_size: int,
    kv_heads: int,
) -> torch.Tensor:
    """float64 attention over the gathered pages, the padding masked (as the SDPA path does)."""
    bsz, heads, d = q.shape
    width = rows.shape[1]
    base = rows.reshape(-1) + 2 * layer
    k = rows_t.index_select(0, base).view(bsz, width * page_size, kv_heads, d).double()
    v = rows_t.index_select(0, base + 1).view(bsz, width * page_size, kv_heads, d).double()
    groups = heads // kv_heads
    k = k.repeat_interleave(groups, dim=2).transpose(1, 2)
    v = v.repeat_interleave(groups, dim=2).transpose(1, 2)
    mask = torch.arange(width * page_size)[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(
        q.double()[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=d**-0.5
    )
    return out.reshape(bsz, heads * d)


def _kernel(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> PagedDecodeAttention:
    kernel = paged_decode_attention(CPU, dtype, heads, kv_heads, head_dim)
    # CI and the image have a C compiler: a kernel that did not build fails here, not silently
    assert kernel is not None, "the paged attention kernel did not build"
    return kernel


# (heads, kv_heads, head_dim, page_size): SmolLM2's GQA, plain multi-head, a 128 head dim,
# 4 query heads per KV head, one-token and large pages
SHAPES = [
    (9, 3, 64, 16),
    (4, 4, 64, 16),
    (8, 2, 128, 16),
    (8, 2, 32, 4),
    (6, 3, 64, 1),
    (6, 2, 48, 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("lens", [[1], [5, 17, 16], [300], [40] * 12])
def test_equals_attention_over_the_gathered_pages(dtype, shape, lens):
    heads, kv_heads, d, ps = shape
    g = torch.Generator().manual_seed(len(lens) * 1000 + sum(lens) + d)
    layers, layer = 3, 2
    bsz = len(lens)
    width = -(-max(lens) // ps)
    num_pages = bsz * width + 2
    rows_t = _pool(num_pages, layers, ps, kv_heads, d, dtype, g)
    # each sequence's pages anywhere in the pool, in no order
    rows = torch.randperm(num_pages, generator=g)[: bsz * width].view(bsz, width) * 2 * layers
    lens_t = torch.tensor(lens)
    # q as the model passes it: a view with the K heads after the query heads in each row
    qk = torch.randn(bsz, heads + kv_heads, d, generator=g).to(dtype)
    q = qk[:, :heads]
    out = _kernel(dtype, heads, kv_heads, d)(rows_t, rows, lens_t, layer, q, ps, d**-0.5)
    assert out.shape == (bsz, heads * d) and out.dtype == dtype
    expect = _reference(rows_t, rows, lens_t, layer, q, ps, kv_heads)
    # float32: sums of at most 300 products of size ~1; bfloat16: the output rounded to 8 bits
    tol = 2e-6 if dtype == torch.float32 else 2**-8
    err = (out.double() - expect).abs().max().item()
    assert err <= tol * max(1.0, expect.abs().max().item()), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_nothing_past_a_sequence_length(dtype):
    """Slots after a sequence's last token (the rest of its last page, pages the table pads
    with) may hold anything, NaN included: the output must not change."""
    heads, kv_heads, d, ps, layers = 9, 3, 64, 16, 2
    g = torch.Generator().manual_seed(7)
    rows_t = _pool(12, layers, ps, kv_heads, d, dtype, g)
    lens = torch.tensor([21, 3])
    rows = torch.tensor([[0, 1, 2], [3, 4, 4]]) * 2 * layers  # 3 pages wide, padded
    q = torch.randn(2, heads, d, generator=g).to(dtype)
    kernel = _kernel(dtype, heads, kv_heads, d)
    before = kernel(rows_t, rows, lens, 1, q, ps, d**-0.5)
    poisoned = rows_t.clone()
    tok = kv_heads * d
    for layer_row in (2, 3):  # layer 1's K and V rows
        poisoned[1 * 2 * layers + layer_row, (21 - ps) * tok :] = float("nan")  # page 1 past 21
        poisoned[2 * 2 * layers + layer_row] = float("nan")  # page 2: beyond sequence 0's pages
        poisoned[3 * 2 * layers + layer_row, 3 * tok :] = float("nan")  # sequence 1 past 3
        poisoned[4 * 2 * layers + layer_row] = float("nan")  # the padding page of sequence 1
    after = kernel(poisoned, rows, lens, 1, q, ps, d**-0.5)
    assert torch.equal(before, after)
    # and the other layer's rows are not this layer's
    poisoned[:, :] = rows_t
    poisoned[0 * 2 * layers + 0] = float("nan")  # page 0, layer 0's K
    assert torch.equal(kernel(poisoned, rows, lens, 1, q, ps, d**-0.5), before)


def test_one_sequence_is_split_and_merged():
    """Few sequences get their pages cut into ranges (work for every thread), merged by
    their maxima; ranges with no tokens (more ranges than a short sequence's pages) count 0."""
    assert splits_for(1, 100, 2) == 8 and splits_for(1, 3, 2) == 3  # never more than pages
    assert splits_for(32, 10, 2) == 1 and splits_for(3, 10, 2) == 3 and splits_for(2, 1, 4) == 1
    heads, kv_heads, d, ps = 9, 3, 64, 16
    g = torch.Generator().manual_seed(3)
    rows_t = _pool(40, 1, ps, kv_heads, d, torch.float32, g)
    rows = torch.arange(40).view(1, 40) * 2
    q = torch.randn(1, heads, d, generator=g)
    kernel = _kernel(torch.float32, heads, kv_heads, d)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):  # 4 and 8 ranges of one sequence
            torch.set_num_threads(n)
            for length in (640, 17, 600):
                lens = torch.tensor([length])
                expect = _reference(rows_t, rows, lens, 0, q, ps, kv_heads)
                err = (kernel(rows_t, rows, lens, 0, q, ps, d**-0.5).double() - expect).abs().max()
                assert err.item() <= 2e-6, (n, length, err)
    finally:
        torch.set_num_threads(threads)


def test_shapes_the_kernel_does_not_take_are_left_to_sdpa():
    assert not PagedDecodeAttention.supports(CPU, torch.float16, 9, 3, 64)
    assert not PagedDecodeAttention.supports(CPU, torch.float32, 9, 3, 72)  # not a multiple of 16
    assert not PagedDecodeAttention.supports(CPU, torch.float32, 64, 2, 64)  # 32 heads per KV head
    assert not PagedDecodeAttention.supports(torch.device("cuda"), torch.float32, 9, 3, 64)
    assert paged_decode_attention(CPU, torch.float32, 9, 3, 72) is None
    assert PagedDecodeAttention.supports(CPU, torch.bfloat16, 32, 8, 128)
