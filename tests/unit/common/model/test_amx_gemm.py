"""The AMX product (common.model.cpu.amx_gemm, csrc/amx_gemm.c) on the real kernel: products within
bfloat16 rounding of the exact one, every row count and tail, and the model's decode on it.
Skipped where the machine cannot run AMX; the fallback is checked everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.cpu.amx_gemm import AmxGemm, amx_gemm
from common.model.cpu.gemm import AMX, ROW_MAJOR, LinearWeight, linear
from tests.support.tiny_products import logits_on, tiny_runner

KERNEL = amx_gemm()
needs_amx = pytest.mark.skipif(KERNEL is None, reason="no AMX on this machine (or no C compiler)")


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values around |x| (8 bits of mantissa)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.pow(2.0, e - 7)


def _check(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Within a bfloat16 rounding of the float64 product (and of the sum with the bias:
    torch rounds the product, then the sum), plus float32 accumulation error."""
    product = x.double() @ weight.double().t()
    exact = product if bias is None else product + bias.double()
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    tol = _bf16_ulp(exact) + 1e-5 * product.abs().max()
    if bias is not None:
        tol = tol + _bf16_ulp(product)
    err = (out.double() - exact).abs()
    assert bool((err <= tol).all()), (err - tol).max().item()


def test_pack_layout():
    """Tile [b, c] holds W[16b + j, 32c + 2p + e] at [p, j, e]: the VNNI pairs of TDPBF16PS."""
    w = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64).to(torch.bfloat16)
    packed = AmxGemm.pack(w)
    assert packed.shape == (2, 2, 16, 16, 2)
    for b, c, p, j, e in [(0, 0, 0, 0, 0), (1, 0, 3, 5, 1), (0, 1, 15, 15, 1), (1, 1, 7, 2, 0)]:
        assert packed[b, c, p, j, e] == w[16 * b + j, 32 * c + 2 * p + e]


def test_packable_shapes():
    assert AmxGemm.packable(torch.zeros(48, 64, dtype=torch.bfloat16))
    assert not AmxGemm.packable(torch.zeros(40, 64, dtype=torch.bfloat16))  # 40 columns
    assert not AmxGemm.packable(torch.zeros(48, 48, dtype=torch.bfloat16))  # 48 inputs
    assert not AmxGemm.packable(torch.zeros(48, 64))  # float32


def test_amx_without_its_copy_is_row_major():
    """No AMX here, or a shape it does not take: the kernel name falls back to F.linear."""
    weight = torch.randn(40, 48).to(torch.bfloat16)
    w = LinearWeight.of(weight, amx=KERNEL)
    assert w.amx is None
    x = torch.randn(3, 48).to(torch.bfloat16)
    assert torch.equal(linear(x, w, AMX), F.linear(x, weight))


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 64, 70])
@pytest.mark.parametrize("n", [48, 64])  # an odd number of column blocks, and an even one
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_within_rounding(rows, n, with_bias):
    g = torch.Generator().manual_seed(rows * n)
    weight = torch.randn(n, 96, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    w = LinearWeight.of(weight, bias, amx=KERNEL)
    assert w.amx is not None
    _check(linear(x, w, AMX), x, weight, bias)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
def test_threads_and_strided_inputs(threads):
    """Rows of a wider tensor and a transposed view (a weight-major product's output) give
    the product of the same values; the column ranges of 1 or 2 threads cover every column."""
    g = torch.Generator().manual_seed(threads)
    weight = torch.randn(16 * 9, 64, generator=g).to(torch.bfloat16)
    w = LinearWeight.of(weight, amx=KERNEL)
    wide = torch.randn(20, 100, generator=g).to(torch.bfloat16)
    x = wide[:, 10:74]  # row stride 100
    xt = torch.randn(64, 20, generator=g).to(torch.bfloat16).t()  # column stride 20
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(linear(x, w, AMX), x, weight, None)
        _check(linear(xt, w, AMX), xt, weight, None)
    finally:
        torch.set_num_threads(before)


@needs_amx
def test_decode_on_amx_matches_row_major():
    """The bfloat16 model takes the AMX product in place of oneDNN's packed one, and extend
    + decode on it give row_major's logits within bfloat16 rounding (the same tokens fed)."""
    # every matrix packs for AMX: widths in multiples of 16 x 32
    runner = tiny_runner("bfloat16", vocab=256, intermediate=96, seed=3)
    model = runner.model
    assert model.chooser is not None and AMX in model.chooser.kernels
    assert model.layers[0].qkv.amx is not None and model.layers[0].qkv.packed is None
    assert model.lm_head.amx is not None
    prompts = [[5, 9, 200, 17, 3], [44, 2, 8], [100, 101, 102, 103, 104, 105, 7]]
    fed = [[11, 12, 13, 14], [250, 0, 31, 9], [60, 61, 62, 63]]  # per sequence, per step
    results = {}
    for kernel in (ROW_MAJOR, AMX):
        results[kernel] = logits_on(runner, kernel, prompts, fed)
        assert model.chooser.choices()[4] == kernel  # decode's 3 rows
    scale = results[ROW_MAJOR].abs().max().item()
    assert (results[AMX] - results[ROW_MAJOR]).abs().max().item() <= 0.05 * scale
    runner.pool.check_integrity()
