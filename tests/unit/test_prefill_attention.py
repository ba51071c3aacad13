"""Prefill attention read from the pages in place (csrc/prefill_attention.c): causal attention of
a span's new tokens over every key up to their own position, against float64, and nothing read
past the span's last token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.paged_attention import PagedPrefillAttention, paged_prefill_attention

CPU = torch.device("cpu")
LAYERS, LAYER = 3, 1


def _kernel(heads: int, kv_heads: int, head_dim: int) -> PagedPrefillAttention:
    # any vector width: the model takes it with AVX-512 only, its results hold everywhere
    kernel = paged_prefill_attention(CPU, torch.float32, heads, kv_heads, head_dim,
                                     any_vector_width=True)
    # CI and the image have a C compiler: a kernel that did not build fails here, not silently
    assert kernel is not None, "the paged prefill attention kernel did not build"
    return kernel


def _span(total: int, heads: int, kv_heads: int, d: int, ps: int, g: torch.Generator):
    """A pool whose every slot is NaN but the span's `total` tokens (this layer's K and V), on
    pages anywhere in it; returns the pool rows, the span's rows, and its K, V [total, kvh, d]."""
    pages = -(-total // ps)
    num_pages = pages + 3
    rows_t = torch.full((num_pages * 2 * LAYERS, ps * kv_heads * d), float("nan"))
    rows = torch.randperm(num_pages, generator=g)[:pages] * 2 * LAYERS
    k = torch.randn(total, kv_heads, d, generator=g)
    v = torch.randn(total, kv_heads, d, generator=g)
    for t in range(total):
        row, off = rows[t // ps].item() + 2 * LAYER, t % ps
        width = kv_heads * d
        rows_t[row, off * width : (off + 1) * width] = k[t].reshape(-1)
        rows_t[row + 1, off * width : (off + 1) * width] = v[t].reshape(-1)
    return rows_t, rows, k, v


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """float64 causal attention after `prefix` cached tokens, each KV head for its query heads."""
    n, heads, d = q.shape
    groups = heads // k.shape[1]
    kk = k.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    vv = v.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    total = k.shape[0]
    visible = torch.arange(total)[None, :] <= (prefix + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1), kk, vv,
                                         attn_mask=visible, scale=d**-0.5)
    return out.transpose(0, 1).reshape(n, heads * d)


# (heads, kv_heads, head_dim, page_size): SmolLM2's GQA, multi-head, a 128 head dim (two
# tiles), 80 (a tile and a single vector), 16 (the tests' tiny models), 8 query heads per KV
# head, one-token and large pages
SHAPES = [(9, 3, 64, 16), (4, 4, 64, 16), (8, 2, 128, 16), (4, 2, 80, 4), (4, 2, 16, 4),
          (8, 1, 32, 1), (6, 3, 64, 64)]
# (prefix, new): a whole prompt, one token, a block edge, a later chunk off page boundaries,
# one token after a long prefix (decode-like), and a long span
SPANS = [(0, 1), (0, 7), (0, 64), (0, 65), (13, 30), (199, 1), (0, 300), (100, 150)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("span", SPANS)
def test_equals_causal_attention_in_float64(shape, span):
    heads, kv_heads, d, ps = shape
    prefix, n = span
    g = torch.Generator().manual_seed(prefix * 1000 + n + d + heads)
    rows_t, rows, k, v = _span(prefix + n, heads, kv_heads, d, ps, g)
    # q as the model passes it: a view with the K heads after the query heads in each row
    qk = torch.randn(n, heads + kv_heads, d, generator=g)
    q = qk[:, :heads]
    out = torch.full((n, heads * d), float("nan"))
    _kernel(heads, kv_heads, d)(rows_t, rows, LAYER, q, prefix, out, ps, d**-0.5)
    expect = _reference(q, k, v, prefix)
    # float32 sums of at most 300 products of size ~1
    err = (out.double() - expect).abs().max().item()
    assert err <= 2e-6 * max(1.0, expect.abs().max().item()), err


@pytest.mark.parametrize("threads", [1, 2])
def test_threads_and_output_rows_of_a_wider_tensor(threads):
    """Output rows with a stride (the model's one buffer for every span of a batch), and the
    work items of 1 or 2 threads, give the same values; columns outside are untouched."""
    heads, kv_heads, d, ps = 9, 3, 64, 16
    g = torch.Generator().manual_seed(threads)
    rows_t, rows, k, v = _span(170, heads, kv_heads, d, ps, g)
    q = torch.randn(100, heads, d, generator=g)
    wide = torch.zeros(100, heads * d + 8)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _kernel(heads, kv_heads, d)(rows_t, rows, LAYER, q, 70, wide[:, 4 : 4 + heads * d], ps,
                                    d**-0.5)
    finally:
        torch.set_num_threads(before)
    expect = _reference(q, k, v, 70)
    assert (wide[:, 4 : 4 + heads * d].double() - expect).abs().max().item() <= 2e-6 * 4
    assert torch.equal(wide[:, :4], torch.zeros(100, 4))
    assert torch.equal(wide[:, 4 + heads * d :], torch.zeros(100, 4))


def test_large_scores_stay_finite():
    """Scores in the hundreds (a max far above the rest): the online softmax's rescaling by
    exp of the max's change underflows to 0 for the stale terms, never to NaN or inf."""
    heads, kv_heads, d, ps = 4, 2, 64, 16
    g = torch.Generator().manual_seed(7)
    rows_t, rows, k, v = _span(200, heads, kv_heads, d, ps, g)
    q = torch.randn(200, heads, d, generator=g) * 30
    out = torch.empty(200, heads * d)
    _kernel(heads, kv_heads, d)(rows_t, rows, LAYER, q, 0, out, ps, d**-0.5)
    expect = _reference(q, k, v, 0)
    assert bool(torch.isfinite(out).all())
    assert (out.double() - expect).abs().max().item() <= 1e-5 * expect.abs().max().item()


def test_supports():
    assert PagedPrefillAttention.supports(CPU, torch.float32, 9, 3, 64)
    assert not PagedPrefillAttention.supports(CPU, torch.bfloat16, 9, 3, 64)  # torch's AMX flash
    assert not PagedPrefillAttention.supports(CPU, torch.float32, 9, 3, 72)  # not 16s
    assert not PagedPrefillAttention.supports(CPU, torch.float32, 34, 2, 64)  # 17 groups
    assert not PagedPrefillAttention.supports(torch.device("cuda"), torch.float32, 9, 3, 64)
