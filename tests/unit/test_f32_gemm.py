"""The float32 panel product (common.model.f32_gemm, csrc/f32_gemm.c) on the real kernel:
products within float32 accumulation error of the exact one at every row count, column
tail and input length, and the model on it. Skipped where the machine has no AVX-512; the
fallback is checked everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.model.f32_gemm import F32Gemm, f32_gemm
from common.model.gemm import PANELS, PREFILL_KERNELS, ROW_MAJOR, KernelChooser, LinearWeight, linear
from common.model.runner import ExtendRequest, ModelRunner
from common.model.spec import ModelSpec
from common.kv_pool import pages_needed

KERNEL = f32_gemm()
needs_avx512 = pytest.mark.skipif(KERNEL is None, reason="no AVX-512 here (or no C compiler)")


def _check(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None) -> None:
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


def test_pack_layout():
    """Panel p holds W[32p + j, i] at [p, i, j], zero past the last column."""
    w = torch.arange(40 * 3, dtype=torch.float32).reshape(40, 3)
    packed = F32Gemm.pack(w)
    assert packed.shape == (2, 3, 32)
    for p, i, j in [(0, 0, 0), (0, 2, 31), (1, 1, 7), (1, 0, 5)]:
        assert packed[p, i, j] == w[32 * p + j, i]
    assert bool((packed[1, :, 8:] == 0).all())


def test_panels_without_its_copy_is_row_major():
    """No AVX-512 here, or a dtype it does not take: the kernel name falls back to F.linear."""
    weight = torch.randn(40, 48).to(torch.bfloat16)
    w = LinearWeight.of(weight, panels=KERNEL)
    assert w.panels is None
    x = torch.randn(3, 48).to(torch.bfloat16)
    assert torch.equal(linear(x, w, PANELS), F.linear(x, weight))
    assert PANELS in PREFILL_KERNELS  # its output rows are contiguous


@needs_avx512
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


@needs_avx512
def test_rows_in_several_chunks_and_long_inputs():
    """More rows than one chunk holds (512 KiB of x: 88 rows of 1500 inputs) and k not a
    multiple of anything: every chunk and every panel of both threads' ranges is written."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 1500, generator=g)
    x = torch.randn(301, 1500, generator=g)
    w = LinearWeight.of(weight, panels=KERNEL)
    out = torch.full((301, 200), float("nan"))
    assert linear(x, w, PANELS, out) is out  # the caller's buffer (a prefill workspace)
    _check(out, x, weight, None)


@needs_avx512
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


@needs_avx512
def test_bad_shapes_are_refused():
    w = LinearWeight.of(torch.randn(40, 48), panels=KERNEL)
    assert w.panels is not None
    with pytest.raises(ValueError):
        w.panels(torch.randn(3, 47), None)  # inputs of another length
    with pytest.raises(ValueError):
        w.panels(torch.randn(3, 48), None, torch.empty(3, 41))  # an output of another shape
    assert w.panels(torch.randn(0, 48), None).shape == (0, 40)


def _tiny_runner() -> ModelRunner:
    """A 2-layer float32 model with biases; its widths are not whole panels (vocab 250)."""
    spec = ModelSpec(architecture="qwen2", vocab_size=250, hidden_size=64, intermediate_size=80,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                     rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True,
                     attention_bias=True)
    g = torch.Generator().manual_seed(5)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (250, 64),
                                          "model.norm.weight": (64,)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.q_proj.bias": (64,),
                       p + "self_attn.k_proj.weight": (32, 64), p + "self_attn.k_proj.bias": (32,),
                       p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.v_proj.bias": (32,),
                       p + "self_attn.o_proj.weight": (64, 64),
                       p + "mlp.gate_proj.weight": (80, 64), p + "mlp.up_proj.weight": (80, 64),
                       p + "mlp.down_proj.weight": (64, 80),
                       p + "input_layernorm.weight": (64,), p + "post_attention_layernorm.weight": (64,)})
    weights = {n: torch.randn(*s, generator=g) * (0.3 if len(s) == 2 else 1.0)
               for n, s in shapes.items()}
    return ModelRunner(spec, weights, dtype="float32", page_size=4, num_pages=128)


@needs_avx512
def test_extend_and_decode_on_panels_match_row_major():
    """The float32 model offers the panel product beside oneDNN's, and a prefill of 130
    rows (a workspace pass, bucket 256) plus decode on it give row_major's logits within
    float32 rounding (the same tokens fed)."""
    runner = _tiny_runner()
    model = runner.model
    assert model.chooser is not None and PANELS in model.chooser.kernels
    assert model.layers[0].qkv.panels is not None and model.lm_head.panels is not None
    prompts = [[(7 * i) % 250 for i in range(130)], [44, 2, 8], [100, 101, 102, 103, 7]]
    fed = [[11, 12, 13, 14], [249, 0, 31, 9], [60, 61, 62, 63]]  # per step, per sequence
    results = {}
    for kernel in (ROW_MAJOR, PANELS):
        model.chooser = KernelChooser((kernel,), trials=1, prefill_trials=1)
        model.head_chooser = KernelChooser((kernel,), trials=1, prefill_trials=1)
        tables = [runner.pool.allocator.allocate(pages_needed(len(p) + 4, 4)) for p in prompts]
        logits = [runner.extend([ExtendRequest(p, 0, t) for p, t in zip(prompts, tables)]).logits]
        lens = [len(p) for p in prompts]
        for step in range(4):
            lens = [n + 1 for n in lens]
            logits.append(runner.decode([f[step] for f in fed], lens, tables))
        for t in tables:
            runner.pool.allocator.free(t)
        assert model.chooser.choices()[4] == kernel  # decode's 3 rows
        assert model.chooser.choices()[256] == kernel  # the extend's 138 rows
        results[kernel] = torch.stack(logits)
    scale = results[ROW_MAJOR].abs().max().item()
    assert (results[PANELS] - results[ROW_MAJOR]).abs().max().item() <= 1e-4 * scale
    runner.pool.check_integrity()
