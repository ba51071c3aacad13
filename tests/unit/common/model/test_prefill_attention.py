"""Prefill attention read from the pages in place (csrc/prefill_attention.c): causal attention of
a span's new tokens over every key up to their own position, against float64 on the same
(float32 or bfloat16) values, and nothing read past the span's last token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.cpu import paged_attention
from common.model.cpu.paged_attention import PagedPrefillAttention, paged_prefill_attention

CPU = torch.device("cpu")
LAYERS, LAYER = 3, 1


def _kernel(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32
) -> PagedPrefillAttention:
    # always: the model takes it in bfloat16 only without AMX, its results hold everywhere
    kernel = paged_prefill_attention(CPU, dtype, heads, kv_heads, head_dim, always=True)
    # CI and the image have a C compiler: a kernel that did not build fails here, not silently
    assert kernel is not None, "the paged prefill attention kernel did not build"
    return kernel


def _span(
    total: int,
    heads: int,
    kv_heads: int,
    d: int,
    ps: int,
    g: torch.Generator,
    dtype: torch.dtype = torch.float32,
):
    """A pool whose every slot is NaN but the span's `total` tokens (this layer's K and V), on
    pages anywhere in it; returns the pool rows, the span's rows, and its K, V [total, kvh, d]."""
    pages = -(-total // ps)
    num_pages = pages + 3
    rows_t = torch.full((num_pages * 2 * LAYERS, ps * kv_heads * d), float("nan"), dtype=dtype)
    rows = torch.randperm(num_pages, generator=g)[:pages] * 2 * LAYERS
    k = torch.randn(total, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, d, generator=g).to(dtype)
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
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), kk, vv, attn_mask=visible, scale=d**-0.5
    )
    return out.transpose(0, 1).reshape(n, heads * d)


def _assert_close(out: torch.Tensor, expect: torch.Tensor, rel: float) -> None:
    """float32: within `rel` of the largest value (sums of at most a few hundred products of
    size ~1). bfloat16 computes in float32 and rounds each output once: that rounding (half
    a unit in the 8th bit, 2^-9 relative) on top, doubled for a float32 error that moves a
    value across a rounding boundary."""
    scale = max(1.0, expect.abs().max().item())
    err = (out.double() - expect).abs()
    bound = rel * scale + (2.0**-8 * expect.abs() if out.dtype == torch.bfloat16 else 0.0)
    assert bool((err <= bound).all()), (err - bound).max().item()


# (heads, kv_heads, head_dim, page_size): SmolLM2's GQA, multi-head, a 128 head dim (two
# tiles), 80 (a tile and a single vector), 16 (the tests' tiny models), 8 query heads per KV
# head, one-token and large pages
SHAPES = [
    (9, 3, 64, 16),
    (4, 4, 64, 16),
    (8, 2, 128, 16),
    (4, 2, 80, 4),
    (4, 2, 16, 4),
    (8, 1, 32, 1),
    (6, 3, 64, 64),
]
# (prefix, new): a whole prompt, one token, a block edge, a later chunk off page boundaries,
# one token after a long prefix (decode-like), and a long span
SPANS = [(0, 1), (0, 7), (0, 64), (0, 65), (13, 30), (199, 1), (0, 300), (100, 150)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("span", SPANS)
def test_equals_causal_attention_in_float64(shape, span, dtype):
    heads, kv_heads, d, ps = shape
    prefix, n = span
    g = torch.Generator().manual_seed(prefix * 1000 + n + d + heads)
    rows_t, rows, k, v = _span(prefix + n, heads, kv_heads, d, ps, g, dtype)
    # q as the model passes it: a view with the K heads after the query heads in each row
    qk = torch.randn(n, heads + kv_heads, d, generator=g).to(dtype)
    q = qk[:, :heads]
    out = torch.full((n, heads * d), float("nan"), dtype=dtype)
    _kernel(heads, kv_heads, d, dtype)(rows_t, rows, LAYER, q, prefix, out, ps, d**-0.5)
    _assert_close(out, _reference(q, k, v, prefix), 2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_threads_and_output_rows_of_a_wider_tensor(threads, dtype):
    """Output rows with a stride (the model's one buffer for every span of a batch), and the
    work items of 1 or 2 threads, give the same values; columns outside are untouched."""
    heads, kv_heads, d, ps = 9, 3, 64, 16
    g = torch.Generator().manual_seed(threads)
    rows_t, rows, k, v = _span(170, heads, kv_heads, d, ps, g, dtype)
    q = torch.randn(100, heads, d, generator=g).to(dtype)
    wide = torch.zeros(100, heads * d + 8, dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _kernel(heads, kv_heads, d, dtype)(
            rows_t, rows, LAYER, q, 70, wide[:, 4 : 4 + heads * d], ps, d**-0.5
        )
    finally:
        torch.set_num_threads(before)
    _assert_close(wide[:, 4 : 4 + heads * d], _reference(q, k, v, 70), 2e-6)
    assert torch.equal(wide[:, :4], torch.zeros(100, 4, dtype=dtype))
    assert torch.equal(wide[:, 4 + heads * d :], torch.zeros(100, 4, dtype=dtype))


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
    assert PagedPrefillAttention.supports(CPU, torch.bfloat16, 9, 3, 64)
    assert not PagedPrefillAttention.supports(CPU, torch.float16, 9, 3, 64)
    assert not PagedPrefillAttention.supports(CPU, torch.float32, 9, 3, 72)  # not 16s
    assert not PagedPrefillAttention.supports(CPU, torch.float32, 34, 2, 64)  # 17 groups
    assert not PagedPrefillAttention.supports(torch.device("cuda"), torch.float32, 9, 3, 64)


@pytest.mark.parametrize(
    "flags",
    [
        frozenset({"avx2"}),
        frozenset({"avx512f", "avx512_bf16"}),
        frozenset({"avx512f", "avx512_bf16", "amx_bf16"}),
    ],
)
def test_the_model_takes_the_kernel_where_torch_measured_slower(monkeypatch, flags):
    """float32 on every CPU (AVX2 or AVX-512); bfloat16 only without AMX (where torch's
    flash kernel runs on the tiles); `always` in every case."""
    monkeypatch.setattr(paged_attention, "cpu_flags", lambda: flags)
    for dtype in (torch.float32, torch.bfloat16):
        kernel = paged_prefill_attention(CPU, dtype, 9, 3, 64)
        expect = dtype == torch.float32 or "amx_bf16" not in flags
        assert (kernel is not None) == expect, dtype
        assert paged_prefill_attention(CPU, dtype, 9, 3, 64, always=True) is not None
