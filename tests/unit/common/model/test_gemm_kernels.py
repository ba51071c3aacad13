"""The product kernels (common.model.gemm): equal products, and the choice by measurement."""

from __future__ import annotations

import pytest
import torch

from common.model.f32_gemm import f32_gemm
from common.model.gemm import (
    AMX, BUCKETS, PACKED, PANELS, ROW_MAJOR, WEIGHT_MAJOR, KernelChooser, LinearWeight,
    bucket_of, can_pack, linear,
)

KERNELS = (ROW_MAJOR, WEIGHT_MAJOR, PACKED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 32, 64, 100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_every_kernel_computes_the_same_product(dtype, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype) if with_bias else None
    x = torch.randn(rows, 80, generator=g).to(dtype)
    w = LinearWeight.of(weight, bias, pack=True)
    assert (w.packed is not None) == can_pack(weight)
    expect = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    # float32 sums of 80 terms of size ~1; bfloat16 rounds the result to 8 bits of mantissa
    tol = 1e-4 if dtype == torch.float32 else 4e-2
    scale = expect.abs().max().item()
    for kernel in KERNELS:
        out = linear(x, w, kernel)
        assert out.shape == (rows, 96) and out.dtype == dtype, kernel
        err = (out.double() - expect).abs().max().item()
        assert err <= tol * scale, (kernel, err, scale)


def test_packed_without_a_pack_is_row_major():
    weight = torch.randn(16, 8)
    w = LinearWeight.of(weight)  # pack not asked
    assert w.packed is None
    x = torch.randn(4, 8)
    assert torch.equal(linear(x, w, PACKED), torch.nn.functional.linear(x, weight))


def test_buckets():
    assert [bucket_of(n) for n in (1, 2, 3, 5, 9, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 64, 64]
    assert [bucket_of(n) for n in (65, 128, 129, 1000, 4097, 8192)] == [128, 128, 256, 1024,
                                                                       8192, 8192]
    assert bucket_of(100_000) == BUCKETS[-1] == 8192


def test_chooser_explores_each_kernel_then_keeps_the_fastest_median():
    chooser = KernelChooser(KERNELS, trials=3, recheck_uses=1000)
    seconds = {ROW_MAJOR: [5.0, 1.0, 5.0], WEIGHT_MAJOR: [2.0, 2.0, 9.0], PACKED: [3.0, 3.0, 3.0]}
    tried = []
    for _ in range(9):
        kernel = chooser.pick(8)
        tried.append(kernel)
        chooser.record(8, kernel, seconds[kernel][tried.count(kernel) - 1])
    # round robin in the given order, three passes each
    assert tried == list(KERNELS) * 3
    # medians: row_major 5, weight_major 2, packed 3 -> weight_major (one fast row_major
    # pass and one slow weight_major pass do not decide)
    assert chooser.pick(5) == WEIGHT_MAJOR and chooser.choices() == {8: WEIGHT_MAJOR}
    # another bucket explores on its own
    assert chooser.pick(1) == ROW_MAJOR and 1 not in chooser.choices()


def test_chooser_explores_again_after_recheck_uses():
    chooser = KernelChooser((ROW_MAJOR, PACKED), trials=1, recheck_uses=3)
    chooser.record(32, ROW_MAJOR, 1.0)
    chooser.record(32, PACKED, 2.0)
    assert chooser.choices() == {32: ROW_MAJOR}
    for _ in range(3):
        chooser.record(32, chooser.pick(32), 1.0)
    assert chooser.choices() == {}  # the machine may have changed: measure again
    chooser.record(32, chooser.pick(32), 3.0)  # row_major is slow now
    chooser.record(32, chooser.pick(32), 2.0)
    assert chooser.pick(32) == PACKED


def test_prefill_buckets_choose_between_row_output_kernels_by_seconds_per_row():
    chooser = KernelChooser(KERNELS, prefill_trials=2)
    assert chooser.candidates(1024) == (ROW_MAJOR, PACKED)  # weight_major's rows are strided
    # One bucket's passes differ in length: packed's time per row is lower, though its
    # longer passes took more seconds in all.
    passes = [(600, ROW_MAJOR, 6.0), (1000, PACKED, 5.0), (600, ROW_MAJOR, 6.0),
              (1000, PACKED, 5.0)]
    for rows, kernel, seconds in passes:
        assert chooser.pick(rows) == kernel
        chooser.record(rows, kernel, seconds)
    assert chooser.choices() == {1024: PACKED} and chooser.pick(513) == PACKED
    chooser.record(600, WEIGHT_MAJOR, 0.0)  # not a candidate there: ignored
    assert chooser.choices() == {1024: PACKED}
    # decode buckets keep comparing seconds per pass, every kernel
    assert chooser.candidates(64) == KERNELS
    # the panel product writes whole rows too (common.model.f32_gemm)
    with_panels = KernelChooser((*KERNELS, PANELS))
    assert with_panels.candidates(256) == (ROW_MAJOR, PACKED, PANELS)


def test_prefill_without_a_row_output_kernel_is_row_major():
    for kernels in ((WEIGHT_MAJOR,), (ROW_MAJOR, WEIGHT_MAJOR, AMX)):
        chooser = KernelChooser(kernels, prefill_trials=1)
        assert chooser.pick(4096) == ROW_MAJOR
        chooser.record(4096, ROW_MAJOR, 1.0)
        assert chooser.choices() == {4096: ROW_MAJOR}


def _tiny_runner_inputs():
    from common.model.spec import ModelSpec

    spec = ModelSpec(architecture="llama", vocab_size=32, hidden_size=8, intermediate_size=16,
                     num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6,
                     rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=True,
                     attention_bias=False)
    g = torch.Generator().manual_seed(0)
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    shapes = {"model.embed_tokens.weight": (32, 8), "model.norm.weight": (8,)}
    p = "model.layers.0."
    for name, shape in {"self_attn.q_proj.weight": (8, 8), "self_attn.k_proj.weight": (4, 8),
                        "self_attn.v_proj.weight": (4, 8), "self_attn.o_proj.weight": (8, 8),
                        "mlp.gate_proj.weight": (16, 8), "mlp.up_proj.weight": (16, 8),
                        "mlp.down_proj.weight": (8, 16), "input_layernorm.weight": (8,),
                        "post_attention_layernorm.weight": (8,)}.items():
        names.append(p + name)
        shapes[p + name] = shape
    return spec, {n: torch.randn(*shapes[n], generator=g) for n in names}


def test_a_runner_without_packed_weights_chooses_between_the_other_two():
    from common.model.runner import ModelRunner

    spec, weights = _tiny_runner_inputs()
    plain = ModelRunner(spec, weights, num_pages=8, pack_weights=False)
    assert plain.model.lm_head.packed is None and plain.model.layers[0].qkv.packed is None
    assert plain.model.chooser is not None and PACKED not in plain.model.chooser.kernels
    assert PANELS not in plain.model.chooser.kernels and plain.model.lm_head.panels is None
    packed = ModelRunner(spec, weights, num_pages=8)
    down = weights["model.layers.0.mlp.down_proj.weight"]
    assert (packed.model.layers[0].down.packed is not None) == can_pack(down)
    # the float32 panel copy too, where the CPU has AVX-512 (common.model.f32_gemm)
    assert (packed.model.layers[0].down.panels is not None) == (f32_gemm() is not None)


def test_bfloat16_where_onednn_has_no_bfloat16_runs_without_packed_weights(monkeypatch):
    """oneDNN's bfloat16 reorder raises on a CPU without AVX-512 BW/VL/DQ (an AVX2 AMD EPYC):
    there a bfloat16 runner keeps no packed copy, chooses between the other two kernels, and
    runs (a bfloat16 model failed to load there before)."""
    from common.model import gemm
    from common.kv_pool import pages_needed
    from common.model.runner import ExtendRequest, ModelRunner

    monkeypatch.setattr(gemm, "mkldnn_bf16", lambda: False)
    spec, weights = _tiny_runner_inputs()
    assert not can_pack(weights["model.norm.weight"].to(torch.bfloat16))
    assert can_pack(weights["model.norm.weight"])  # float32 packs as before
    runner = ModelRunner(spec, weights, dtype="bfloat16", num_pages=8, cpu_kernels=False)
    assert runner.model.layers[0].qkv.packed is None and runner.model.lm_head.packed is None
    assert runner.model.chooser is not None and PACKED not in runner.model.chooser.kernels
    pages = runner.pool.allocator.allocate(pages_needed(5, runner.page_size))
    logits = runner.extend([ExtendRequest([1, 2, 3, 4, 5], 0, pages)]).logits[0]
    assert logits.shape == (32,) and bool(torch.isfinite(logits.float()).all())
