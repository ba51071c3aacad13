"""The fused per-layer steps (common.model.cpu.fused_ops) against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.cpu.fused_ops import FusedOps, fused_ops
from common.model.llama import apply_rope, rms_norm

DTYPES = [torch.float32, torch.bfloat16]


def _ops(dtype: torch.dtype) -> FusedOps:
    ops = fused_ops(torch.device("cpu"), dtype)
    assert ops is not None, "the CPU kernels did not build"  # CI has a C compiler
    return ops


def _close(got: torch.Tensor, expect: torch.Tensor, ulps: float) -> None:
    """Equal up to `ulps` units in the last place of the dtype, relative to each value
    (what a different summation order or exp can move), never more."""
    assert got.shape == expect.shape and got.dtype == expect.dtype
    eps = torch.finfo(expect.dtype).eps
    diff = (got.double() - expect.double()).abs()
    allowed = ulps * eps * expect.double().abs().clamp_min(torch.finfo(expect.dtype).tiny)
    assert bool((diff <= allowed).all()), diff.max().item()


def _maybe_transposed(t: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The same values, as a weight-major product gives them: a transposed view."""
    return t.t().contiguous().t() if transposed else t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64, 200])
@pytest.mark.parametrize("transposed", [False, True])
def test_add_rms_norm(dtype, rows, transposed):
    g = torch.Generator().manual_seed(rows)
    hidden = 576
    x = (torch.randn(rows, hidden, generator=g) * 4).to(dtype)
    y = _maybe_transposed(torch.randn(rows, hidden, generator=g).to(dtype), transposed)
    w = (torch.randn(hidden, generator=g) * 0.3 + 1).to(dtype)
    expect_x = x + y
    expect_h = rms_norm(expect_x, w, 1e-5)
    got_x = x.clone()
    got_h = _ops(dtype).add_rms_norm(got_x, y, w, 1e-5)
    assert torch.equal(got_x, expect_x)  # the residual add rounds as torch's does, exactly
    # the norm's sum runs in another order: its factor moves by an ulp or two of float32,
    # which bfloat16's rounding shows at most as one of its own ulps
    _close(got_h, expect_h, 8 if dtype == torch.float32 else 1)
    # and without a residual (the first layer's norm)
    _close(
        _ops(dtype).add_rms_norm(x.clone(), None, w, 1e-5),
        rms_norm(x, w, 1e-5),
        8 if dtype == torch.float32 else 1,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 100])
@pytest.mark.parametrize("transposed", [False, True])
def test_rope_store_rotates_like_apply_rope_and_writes_the_pool(dtype, rows, transposed):
    g = torch.Generator().manual_seed(rows + 1)
    heads, kv_heads, d, ps, layers = 9, 3, 64, 16, 2
    qkv = _maybe_transposed(
        torch.randn(rows, (heads + 2 * kv_heads) * d, generator=g).to(dtype), transposed
    )
    positions = torch.randint(0, 500, (rows,), generator=g)
    angles = torch.outer(torch.arange(512, dtype=torch.float32), torch.rand(d // 2, generator=g))
    emb = torch.cat([angles, angles], dim=-1)
    cos = emb.cos().to(dtype)
    sin = emb.sin().to(dtype)
    sin_rot = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], dim=-1)
    pages = 20
    pool = torch.zeros(pages * layers * 2 * ps, kv_heads * d, dtype=dtype)  # KVPool.tokens
    slots = torch.randperm(pages * ps, generator=g)[:rows]
    slots = (slots // ps) * (layers * 2 * ps) + slots % ps  # layer 0's K slot of each token
    layer = 1
    expect_pool = pool.clone()
    qk_size = (heads + kv_heads) * d
    expect = apply_rope(
        qkv[:, :qk_size].reshape(rows, heads + kv_heads, d), cos[positions], sin_rot[positions]
    )
    k_slots = slots + 2 * layer * ps
    expect_pool.index_copy_(0, k_slots, expect[:, heads:].reshape(rows, kv_heads * d))
    expect_pool.index_copy_(0, k_slots + ps, qkv[:, qk_size:])
    got = _ops(dtype).rope_store(
        qkv, positions, cos, sin_rot, pool, slots, 2 * layer * ps, ps, heads, kv_heads, d
    )
    assert torch.equal(got, expect)  # products and the add rounded where torch rounds them
    assert torch.equal(pool, expect_pool)  # and nothing else in the pool written


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9, 300])
@pytest.mark.parametrize("transposed", [False, True])
def test_silu_mul(dtype, rows, transposed):
    g = torch.Generator().manual_seed(rows + 2)
    inter = 1536
    gate_up = torch.randn(rows, 2 * inter, generator=g) * 6
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, 1e-30, -1e-30])
    gate_up = _maybe_transposed(gate_up.to(dtype), transposed)
    gate, up = gate_up.chunk(2, dim=-1)
    expect = F.silu(gate) * up
    got = _ops(dtype).silu_mul(gate_up)
    # exp is a polynomial here, Sleef's in torch: a few float32 ulps, in bfloat16 at most one
    _close(got, expect, 16 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [7, 16, 23, 40])  # under one vector, one, and tails
@pytest.mark.parametrize("transposed", [False, True])
def test_silu_mul_tails_and_non_finite_values(dtype, inter, transposed):
    """Rows not a whole number of 16-lane vectors (the tail's zero-padded block) and
    non-finite gates: NaN where torch has NaN (NaN, -inf), inf where it has inf, and the
    finite values within the same ulps as test_silu_mul."""
    g = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(5, 2 * inter, generator=g) * 6
    gate_up[0, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), 90.0])
    gate_up[1, inter - 1] = float("nan")  # the last element: in the tail where there is one
    gate_up = _maybe_transposed(gate_up.to(dtype), transposed)
    gate, up = gate_up.chunk(2, dim=-1)
    expect = F.silu(gate) * up
    got = _ops(dtype).silu_mul(gate_up)
    assert torch.equal(got.isnan(), expect.isnan())
    assert torch.equal(got.isinf(), expect.isinf())
    finite = expect.isfinite()
    assert torch.equal(got[~finite & ~expect.isnan()], expect[~finite & ~expect.isnan()])
    _close(got[finite], expect[finite], 16 if dtype == torch.float32 else 1)


def test_not_offered_off_the_cpu_or_for_other_dtypes():
    assert fused_ops(torch.device("cpu"), torch.float16) is None
    assert fused_ops(torch.device("cuda"), torch.float32) is None
