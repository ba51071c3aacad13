"""The product kernels (common.model.cpu.gemm): equal products, and the choice by measurement."""

from __future__ import annotations

import pytest
import torch

from common.model.cpu.f32_gemm import f32_gemm
from common.model.cpu.gemm import (
    AMX,
    BUCKETS,
    PACKED,
    PANELS,
    ROW_MAJOR,
    WEIGHT_MAJOR,
    KernelChooser,
    LinearWeight,
    bucket_of,
    can_pack,
    linear,
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
    assert [bucket_of(n) for n in (65, 128, 129, 1000, 4097, 8192)] == [
        128,
        128,
        256,
        1024,
        8192,
        8192,
    ]
    assert bucket_of(100_000) == BUCKETS[-1] == 8192


def test_chooser_explores_each_kernel_then_keeps_the_fastest_median():
    chooser = KernelChooser(KERNELS, trials=3)
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


def test_a_choice_is_never_revisited_whatever_later_passes_measure():
    """The kernels round differently: once a bucket has chosen, no timing changes it (a
    node's greedy output must not change in the middle of its life)."""
    chooser = KernelChooser((ROW_MAJOR, PACKED), trials=1)
    chooser.record(32, ROW_MAJOR, 1.0)
    chooser.record(32, PACKED, 2.0)
    assert chooser.choices() == {32: ROW_MAJOR}
    for _ in range(10_000):  # packed 100x faster from now on
        kernel = chooser.pick(32)
        chooser.record(32, kernel, 1.0)
        chooser.record(32, PACKED, 0.01)
    assert chooser.pick(32) == ROW_MAJOR and chooser.choices() == {32: ROW_MAJOR}


def _fake_clock(monkeypatch, fast):
    """gemm.time_products timed by a table: `fast(rows)` is the kernel that wins there."""
    from common.model.cpu import gemm

    calls = []

    def timed(products, rows, kernel, dtype):
        calls.append((rows, kernel))
        return rows * (1.0 if kernel == fast(rows) else 2.0)

    monkeypatch.setattr(gemm, "time_products", timed)
    return calls


def test_warm_up_measures_then_fixes_every_bucket(monkeypatch):
    from common.model.cpu.gemm import MEASURED_PREFILL_ROWS, PREFILL_BUCKETS, measure

    calls = _fake_clock(monkeypatch, lambda rows: PACKED if rows in (8, 512) else ROW_MAJOR)
    chooser = KernelChooser(KERNELS, trials=3, prefill_trials=2)
    measure(chooser, [], torch.float32)
    assert chooser.is_frozen and set(chooser.choices()) == set(BUCKETS)
    expect = {b: PACKED if b in (8, 512) else ROW_MAJOR for b in BUCKETS if b <= 1024}
    # buckets warm-up did not reach take the nearest measured one below: 1024's choice
    expect |= {
        b: expect[MEASURED_PREFILL_ROWS] for b in PREFILL_BUCKETS if b > MEASURED_PREFILL_ROWS
    }
    assert chooser.choices() == expect
    assert max(rows for rows, _ in calls) == MEASURED_PREFILL_ROWS
    # from here on, timings favouring another kernel change nothing, over many passes
    for _ in range(3000):
        for rows in (1, 8, 40, 512, 3000):
            chooser.record(rows, WEIGHT_MAJOR, 1e-9)
            chooser.record(rows, chooser.pick(rows), 100.0)
    assert chooser.choices() == expect
    calls.clear()
    measure(chooser, [], torch.float32)  # a second warm-up measures nothing
    assert not calls and chooser.choices() == expect


def test_a_hand_written_kernel_is_chosen_only_where_it_beats_the_libraries_by_min_gain():
    from common.model.cpu.gemm import MIN_GAIN, choose

    assert 0 < MIN_GAIN < 0.1
    # less than MIN_GAIN faster than the best library kernel: the library kernel is kept
    assert choose({ROW_MAJOR: 1.0, PACKED: 1.2, PANELS: 1 - MIN_GAIN / 2}) == ROW_MAJOR
    # MIN_GAIN or more: the hand-written one, the fastest of them
    assert choose({ROW_MAJOR: 1.0, PACKED: 1.2, PANELS: 1 - MIN_GAIN}) == PANELS
    assert choose({ROW_MAJOR: 1.0, WEIGHT_MAJOR: 0.95, AMX: 0.5}) == AMX
    # among library kernels, plainly the fastest
    assert choose({ROW_MAJOR: 1.0, WEIGHT_MAJOR: 0.99, PACKED: 1.5}) == WEIGHT_MAJOR
    # through the chooser's medians
    chooser = KernelChooser((ROW_MAJOR, PACKED, PANELS), trials=3)
    almost = 1 - MIN_GAIN / 2
    for row_major, packed, panels in ((1.0, 1.1, 0.99), (1.0, 1.1, 0.5), (1.0, 1.1, almost)):
        chooser.record(4, ROW_MAJOR, row_major)
        chooser.record(4, PACKED, packed)
        chooser.record(4, PANELS, panels)
    assert chooser.choices() == {4: ROW_MAJOR}  # panels' median: under MIN_GAIN better


def test_warm_up_drops_the_weight_copies_no_bucket_chose(monkeypatch):
    from common.model.cpu import gemm

    w = LinearWeight.of(torch.randn(16, 8), pack=True)
    other = LinearWeight.of(torch.randn(16, 8), pack=True)
    if w.packed is None:
        pytest.skip("oneDNN does not pack here")
    _fake_clock(monkeypatch, lambda rows: ROW_MAJOR)
    chooser = KernelChooser(KERNELS, trials=1, prefill_trials=1)
    gemm.measure(chooser, [(w, 8), (other, 8)], torch.float32)
    assert chooser.chosen_kernels() == {ROW_MAJOR}
    assert w.packed is None and other.packed is None  # no bucket reads oneDNN's copy
    x = torch.randn(3, 8)
    torch.testing.assert_close(linear(x, w, chooser.pick(3)), x @ w.weight.t())
    # a copy some bucket chose stays
    kept = LinearWeight.of(torch.randn(16, 8), pack=True)
    _fake_clock(monkeypatch, lambda rows: PACKED if rows == 1 else ROW_MAJOR)
    chooser = KernelChooser(KERNELS, trials=1, prefill_trials=1)
    gemm.measure(chooser, [(kept, 8)], torch.float32)
    assert chooser.chosen_kernels() == {PACKED, ROW_MAJOR} and kept.packed is not None


def test_long_prefill_buckets_are_timed_over_their_own_products(monkeypatch):
    from common.model.cpu import gemm

    seen: dict[str, set[int]] = {"decode": set(), "short prefill": set(), "prefill": set()}

    def timed(products, rows, kernel, dtype):
        if not gemm.is_prefill_bucket(rows):
            seen["decode"].add(len(products))
        else:
            seen["prefill" if rows >= gemm.SUBSET_FROM_ROWS else "short prefill"].add(len(products))
        return 1.0

    monkeypatch.setattr(gemm, "time_products", timed)
    weights = [(LinearWeight.of(torch.randn(4, 4)), 4) for _ in range(12)]
    gemm.measure(
        KernelChooser(KERNELS, trials=1, prefill_trials=1),
        weights,
        torch.float32,
        prefill_products=weights[:4],
    )
    assert seen == {"decode": {12}, "short prefill": {12}, "prefill": {4}}


def test_freeze_rule_for_buckets_never_measured():
    chooser = KernelChooser(KERNELS, trials=1, prefill_trials=1)
    for kernel, seconds in ((ROW_MAJOR, 2.0), (WEIGHT_MAJOR, 1.0), (PACKED, 3.0)):
        chooser.record(4, kernel, seconds)
    chooser.record(16, ROW_MAJOR, 5.0)  # half measured: ruled like the unmeasured
    chooser.freeze()
    got = chooser.choices()
    assert got[4] == WEIGHT_MAJOR
    assert got[1] == got[2] == WEIGHT_MAJOR  # none below: the nearest above
    assert got[8] == got[16] == got[64] == WEIGHT_MAJOR  # the nearest below
    # no prefill bucket measured: the first candidate (weight_major cannot run prefill)
    assert {got[b] for b in BUCKETS if b > 64} == {ROW_MAJOR}


def test_a_runner_chooses_at_warm_up_and_keeps_its_choices(monkeypatch):
    from common.kv_pool import pages_needed
    from common.model.runner import ExtendRequest, ModelRunner

    spec, weights = _tiny_runner_inputs()
    runner = ModelRunner(spec, weights, num_pages=8)
    runner.warmup(num_tokens=8)
    model = runner.model
    assert model.chooser is not None and model.head_chooser is not None
    assert model.chooser.is_frozen and set(model.chooser.choices()) == set(BUCKETS)
    before = (model.chooser.choices(), model.head_chooser.choices())
    pages = runner.pool.allocator.allocate(pages_needed(6, runner.page_size))
    for _ in range(300):
        runner.extend([ExtendRequest([1, 2, 3, 4, 5], 0, pages)])
    assert (model.chooser.choices(), model.head_chooser.choices()) == before


def test_warm_up_times_the_head_up_to_its_rows_and_the_layers_prefill_on_four_layers(
    monkeypatch,
):
    from common.model.cpu import gemm
    from common.model.runner import ModelRunner

    spec, weights = _tiny_runner_inputs()
    runner = ModelRunner(spec, weights, num_pages=8)
    model = runner.model
    rows_by_target: dict[str, set[int]] = {"head": set(), "layers": set()}

    def timed(products, rows, kernel, dtype):
        head = products[0][0] is model.lm_head
        rows_by_target["head" if head else "layers"].add(rows)
        return 1.0

    monkeypatch.setattr(gemm, "time_products", timed)
    model.choose_kernels()
    assert max(rows_by_target["head"]) == gemm.HEAD_MEASURED_ROWS
    assert max(rows_by_target["layers"]) == gemm.MEASURED_PREFILL_ROWS
    assert model.head_chooser is not None and model.head_chooser.is_frozen
    assert set(model.head_chooser.choices()) == set(BUCKETS)


def test_a_runner_chooses_decode_buckets_in_forward_passes_and_frees_their_pages(monkeypatch):
    from common.model.cpu import gemm
    from common.model.runner import ModelRunner

    spec, weights = _tiny_runner_inputs()
    runner = ModelRunner(spec, weights, num_pages=8)
    timed_rows: list[int] = []

    def timed(products, rows, kernel, dtype):
        timed_rows.append(rows)
        return 1.0

    monkeypatch.setattr(gemm, "time_products", timed)
    free = runner.pool.allocator.num_free_pages
    runner.choose_kernels()
    model = runner.model
    assert model.chooser is not None and model.head_chooser is not None
    # decode's buckets were chosen in the passes: product timing started at prefill's
    assert min(timed_rows) >= gemm.PREFILL_BUCKETS[0]
    for chooser in (model.chooser, model.head_chooser):
        assert chooser.is_frozen and set(chooser.choices()) == set(BUCKETS)
    assert runner.pool.allocator.num_free_pages == free


def test_prefill_buckets_choose_between_row_output_kernels_by_seconds_per_row():
    chooser = KernelChooser(KERNELS, prefill_trials=2)
    assert chooser.candidates(1024) == (ROW_MAJOR, PACKED)  # weight_major's rows are strided
    # One bucket's passes differ in length: packed's time per row is lower, though its
    # longer passes took more seconds in all.
    passes = [
        (600, ROW_MAJOR, 6.0),
        (1000, PACKED, 5.0),
        (600, ROW_MAJOR, 6.0),
        (1000, PACKED, 5.0),
    ]
    for rows, kernel, seconds in passes:
        assert chooser.pick(rows) == kernel
        chooser.record(rows, kernel, seconds)
    assert chooser.choices() == {1024: PACKED} and chooser.pick(513) == PACKED
    chooser.record(600, WEIGHT_MAJOR, 0.0)  # not a candidate there: ignored
    assert chooser.choices() == {1024: PACKED}
    # decode buckets keep comparing seconds per pass, every kernel
    assert chooser.candidates(64) == KERNELS
    # the panel product writes whole rows too (common.model.cpu.f32_gemm)
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

    spec = ModelSpec(
        architecture="llama",
        vocab_size=32,
        hidden_size=8,
        intermediate_size=16,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    g = torch.Generator().manual_seed(0)
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    shapes = {"model.embed_tokens.weight": (32, 8), "model.norm.weight": (8,)}
    p = "model.layers.0."
    for name, shape in {
        "self_attn.q_proj.weight": (8, 8),
        "self_attn.k_proj.weight": (4, 8),
        "self_attn.v_proj.weight": (4, 8),
        "self_attn.o_proj.weight": (8, 8),
        "mlp.gate_proj.weight": (16, 8),
        "mlp.up_proj.weight": (16, 8),
        "mlp.down_proj.weight": (8, 16),
        "input_layernorm.weight": (8,),
        "post_attention_layernorm.weight": (8,),
    }.items():
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
    # the float32 panel copy too, where the CPU has AVX-512 (common.model.cpu.f32_gemm)
    assert (packed.model.layers[0].down.panels is not None) == (f32_gemm() is not None)


def test_bfloat16_where_onednn_has_no_bfloat16_runs_without_packed_weights(monkeypatch):
    """oneDNN's bfloat16 reorder raises on a CPU without AVX-512 BW/VL/DQ (an AVX2 AMD EPYC):
    there a bfloat16 runner keeps no packed copy, chooses between the other two kernels, and
    runs (a bfloat16 model failed to load there before)."""
    from common.kv_pool import pages_needed
    from common.model.cpu import gemm
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
