"""Warm-up's kernel choice kept on disk (common.model.cpu.choice_cache): a second start on
the same machine takes it without measuring, drops the same weight copies, and a file
that is corrupt or does not fit the model is measured over."""

from __future__ import annotations

import pytest
import torch

from common.model.cpu import choice_cache, gemm
from common.model.cpu.gemm import BUCKETS, PACKED, ROW_MAJOR, WEIGHT_MAJOR, KernelChooser
from common.model.runner import ModelRunner
from tests.unit.common.model.test_gemm_kernels import _tiny_runner_inputs


def _runner(cache_dir) -> ModelRunner:
    spec, weights = _tiny_runner_inputs()
    return ModelRunner(spec, weights, num_pages=8, kernel_cache_dir=str(cache_dir))


def _files(cache_dir) -> list:
    return sorted(cache_dir.glob("kernels-*.json"))


def test_adopt_takes_only_a_whole_fitting_choice():
    kernels = (ROW_MAJOR, WEIGHT_MAJOR, PACKED)
    whole = {b: (ROW_MAJOR if gemm.is_prefill_bucket(b) else WEIGHT_MAJOR) for b in BUCKETS}
    partial = {b: k for b, k in whole.items() if b != BUCKETS[-1]}
    not_a_candidate = {**whole, 1024: WEIGHT_MAJOR}  # weight_major's rows are strided
    for bad in (partial, not_a_candidate, {**whole, 3: ROW_MAJOR}):
        chooser = KernelChooser(kernels)
        assert not chooser.adopt(bad) and not chooser.is_frozen and chooser.choices() == {}
    chooser = KernelChooser(kernels)
    assert chooser.adopt(whole) and chooser.is_frozen and chooser.choices() == whole
    assert chooser.pick(3) == WEIGHT_MAJOR and chooser.pick(700) == ROW_MAJOR
    assert not chooser.adopt(whole)  # a frozen choice is never replaced


def test_a_second_start_takes_the_kept_choice_without_measuring(tmp_path, monkeypatch):
    first = _runner(tmp_path)
    first.choose_kernels()
    (kept,) = _files(tmp_path)
    model = first.model
    assert model.chooser is not None and model.head_chooser is not None
    layers, head = model.chooser.choices(), model.head_chooser.choices()
    assert choice_cache.load(kept) == (layers, head)

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr(ModelRunner, "_measure_kernels", no_measuring)
    second = _runner(tmp_path)
    second.choose_kernels()
    again = second.model
    assert again.chooser is not None and again.head_chooser is not None
    assert again.chooser.is_frozen and again.chooser.choices() == layers
    assert again.head_chooser.choices() == head
    # the same weight copies as after measuring: the unchosen ones dropped
    for a, b in zip(model.layer_products(), again.layer_products(), strict=True):
        assert (a[0].packed is None) == (b[0].packed is None)
        assert (a[0].panels is None) == (b[0].panels is None)
    assert (model.lm_head.packed is None) == (again.lm_head.packed is None)
    # and the same numerics
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    for a, b in zip(model.layer_products(), again.layer_products(), strict=True):
        if a[1] == 8:
            kernel = model.chooser.pick(3)
            assert torch.equal(gemm.linear(x, a[0], kernel), gemm.linear(x, b[0], kernel))


@pytest.mark.parametrize("content", ["{not json", '{"version": 1, "layers": {"1": "x"}}'])
def test_a_corrupt_or_unfitting_file_is_measured_over(tmp_path, content):
    _runner(tmp_path).choose_kernels()
    (kept,) = _files(tmp_path)
    good = kept.read_text()
    kept.write_text(content)
    runner = _runner(tmp_path)
    runner.choose_kernels()
    assert runner.model.chooser is not None and runner.model.chooser.is_frozen
    assert set(runner.model.chooser.choices()) == set(BUCKETS)
    assert choice_cache.load(kept) is not None  # written again, whole
    assert kept.read_text().startswith(good[:10])


def test_the_key_changes_with_what_the_choice_depends_on():
    spec, _ = _tiny_runner_inputs()
    kernels = (ROW_MAJOR, WEIGHT_MAJOR)
    key = choice_cache.choice_key(spec, torch.float32, kernels)
    assert key == choice_cache.choice_key(spec, torch.float32, kernels)
    assert key != choice_cache.choice_key(spec, torch.bfloat16, kernels)
    assert key != choice_cache.choice_key(spec, torch.float32, (*kernels, PACKED))
    wider = type(spec)(**{**spec.__dict__, "intermediate_size": 32})
    assert key != choice_cache.choice_key(wider, torch.float32, kernels)


def test_an_unwritable_directory_only_skips_keeping(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    runner = _runner(blocker / "sub")  # a directory under a file: cannot be made
    runner.choose_kernels()
    assert runner.model.chooser is not None and runner.model.chooser.is_frozen
