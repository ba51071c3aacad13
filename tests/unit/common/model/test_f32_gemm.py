"""The float32 panel product (common.model.cpu.f32_gemm, csrc/f32_gemm.c) on the real kernel:
products within float32 accumulation error of the exact one at every row count, column
tail and input length, and the model on it. Run on the build's own vector width (AVX-512
here, or AVX2 where that is all the CPU has; test_kernels_avx2_build runs them on an AVX2
build too) and skipped where neither builds; the layout and the fallback are checked
everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.cpu.f32_gemm import f32_gemm, pack_panels
from common.model.cpu.gemm import PANELS, PREFILL_KERNELS, ROW_MAJOR, LinearWeight, linear
from tests.support.tiny_products import logits_on, tiny_runner

KERNEL = f32_gemm()
needs_kernel = pytest.mark.skipif(
    KERNEL is None, reason="neither AVX-512 nor AVX2+FMA here (or no C compiler)"
)


def _check(
    out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """Within float32 accumulation error of the float64 product: k roundings of terms no
    larger than the sum of |x| |W| (plus the bias's rounding)."""
    exact = x.double() @ weight.double().t()
    bound = x.double().abs() @ weight.double().abs().t()
    if bias is not None:
        exact = exact + bias.double()
        bound = bound + bias.double().abs()
    assert out.dtype == torch.float32 and out.shape == exact.shape
    tol = (x.shape[1] + 2) * 2.0**-24 * bound
    err = (out.double() - exact).abs()
    assert bool((err <= tol).all()), (err - tol).max().item()


@pytest.mark.parametrize("width", [32, 16])  # the AVX-512 and the AVX2 builds' panels
def test_pack_layout(width):
    """Panel p holds W[width p + j, i] at [p, i, j], zero past the last column."""
    n = width + 8
    w = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    packed = pack_panels(w, width)
    assert packed.shape == (2, 3, width)
    for p, i, j in [(0, 0, 0), (0, 2, width - 1), (1, 1, 7), (1, 0, 5)]:
        assert packed[p, i, j] == w[width * p + j, i]
    assert bool((packed[1, :, 8:] == 0).all())


def test_panels_without_its_copy_is_row_major():
    """No AVX-512 here, or a dtype it does not take: the kernel name falls back to F.linear."""
    weight = torch.randn(40, 48).to(torch.bfloat16)
    w = LinearWeight.of(weight, panels=KERNEL)
    assert w.panels is None
    x = torch.randn(3, 48).to(torch.bfloat16)
    assert torch.equal(linear(x, w, PANELS), F.linear(x, weight))
    assert PANELS in PREFILL_KERNELS  # its output rows are contiguous


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 12, 13, 24, 25, 64, 131])
@pytest.mark.parametrize("n", [32, 40, 96, 7])  # whole panels, a tail, three, less than one
@pytest.mark.parametrize("with_bias", [False, True])
def test_product_within_rounding(rows, n, with_bias):
    g = torch.Generator().manual_seed(rows * 100 + n)
    weight = torch.randn(n, 72, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(rows, 72, generator=g)
    w = LinearWeight.of(weight, bias, panels=KERNEL)
    assert w.panels is not None
    _check(linear(x, w, PANELS), x, weight, bias)


@needs_kernel
def test_rows_in_several_chunks_and_long_inputs():
    """More rows than one chunk holds (x up to a quarter of L2: 84 rows of 1500 inputs on
    a 2 MiB L2 in 12-row blocks, 18 on 512 KiB in 6-row blocks; 301 rows are 1.8 MB) and k
    not a multiple of anything: every chunk and every panel of both threads' ranges is
    written."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 1500, generator=g)
    x = torch.randn(301, 1500, generator=g)
    w = LinearWeight.of(weight, panels=KERNEL)
    out = torch.full((301, 200), float("nan"))
    assert linear(x, w, PANELS, out) is out  # the caller's buffer (a prefill workspace)
    _check(out, x, weight, None)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_threads_and_strided_inputs(threads):
    """Rows of a wider tensor and a transposed view (a weight-major product's output) give
    the product of the same values; the panel ranges of 1 or 2 threads cover every column."""
    g = torch.Generator().manual_seed(threads)
    weight = torch.randn(32 * 9 + 5, 64, generator=g)
    w = LinearWeight.of(weight, panels=KERNEL)
    wide = torch.randn(20, 100, generator=g)
    x = wide[:, 10:74]  # row stride 100
    xt = torch.randn(64, 20, generator=g).t()  # column stride 20
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check(linear(x, w, PANELS), x, weight, None)
        _check(linear(xt, w, PANELS), xt, weight, None)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_bad_shapes_are_refused():
    w = LinearWeight.of(torch.randn(40, 48), panels=KERNEL)
    assert w.panels is not None
    with pytest.raises(ValueError):
        w.panels(torch.randn(3, 47), None)  # inputs of another length
    with pytest.raises(ValueError):
        w.panels(torch.randn(3, 48), None, torch.empty(3, 41))  # an output of another shape
    assert w.panels(torch.randn(0, 48), None).shape == (0, 40)
    assert KERNEL is not None
    other = 32 if KERNEL.panel == 16 else 16  # packed for the other build's width
    with pytest.raises(ValueError):
        KERNEL(torch.randn(3, 48), pack_panels(torch.randn(40, 48), other), 40, None)


@needs_kernel
def test_extend_and_decode_on_panels_match_row_major():
    """The float32 model offers the panel product beside oneDNN's, and a prefill of 130
    rows (a workspace pass, bucket 256) plus decode on it give row_major's logits within
    float32 rounding (the same tokens fed)."""
    # widths that are not whole panels (vocab 250, intermediate 80)
    runner = tiny_runner("float32", vocab=250, intermediate=80, seed=5, num_pages=128)
    model = runner.model
    assert model.chooser is not None and PANELS in model.chooser.kernels
    assert model.layers[0].qkv.panels is not None and model.lm_head.panels is not None
    prompts = [[(7 * i) % 250 for i in range(130)], [44, 2, 8], [100, 101, 102, 103, 7]]
    fed = [[11, 12, 13, 14], [249, 0, 31, 9], [60, 61, 62, 63]]  # per sequence, per step
    results = {}
    for kernel in (ROW_MAJOR, PANELS):
        results[kernel] = logits_on(runner, kernel, prompts, fed)
        assert model.chooser.choices()[4] == kernel  # decode's 3 rows
        assert model.chooser.choices()[256] == kernel  # the extend's 138 rows
    scale = results[ROW_MAJOR].abs().max().item()
    assert (results[PANELS] - results[ROW_MAJOR]).abs().max().item() <= 1e-4 * scale
    runner.pool.check_integrity()
