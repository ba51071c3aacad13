"""The KV pool sized by --mem-fraction-static (common.model.memory): the rule, its error,
the flags, and a runner that follows it."""

from __future__ import annotations

import pytest

import common.model.runner as runner_module
from common.config import ConfigError, ModelConfig
from common.model.memory import DeviceMemory, device_memory, kv_pool_bytes
from common.model.runner import ModelRunner
from tests.unit.common.model.test_model_runner import _save_tiny

MIB = 1 << 20


def test_the_pool_takes_the_fraction_less_what_is_in_use_and_the_forward_peak():
    memory = DeviceMemory(total=1000 * MIB, free=700 * MIB)
    assert kv_pool_bytes(memory, 0.9, 0) == 900 * MIB - 300 * MIB
    assert kv_pool_bytes(memory, 0.9, 100 * MIB) == 500 * MIB
    assert kv_pool_bytes(memory, 1.0, 0) == 700 * MIB


def test_a_fraction_that_leaves_nothing_says_what_is_in_use():
    memory = DeviceMemory(total=1000 * MIB, free=400 * MIB)  # another process holds 600
    with pytest.raises(ValueError, match=r"0\.6 GiB are in use.*--gpus") as err:
        kv_pool_bytes(memory, 0.5, 0)
    assert "--mem-fraction-static 0.5" in str(err.value)
    with pytest.raises(ValueError):
        kv_pool_bytes(memory, 1.5, 0)


def test_the_cpu_reads_the_machine_memory():
    memory = device_memory(__import__("torch").device("cpu"))
    assert memory.total > memory.free > 0


def test_a_runner_sizes_its_pool_by_the_fraction(tmp_path, monkeypatch):
    _save_tiny(tmp_path, "llama")
    monkeypatch.setattr(
        runner_module, "device_memory", lambda device: DeviceMemory(total=64 * MIB, free=48 * MIB)
    )
    runner = ModelRunner.from_path(
        str(tmp_path), progress=False, page_size=4, mem_fraction_static=0.5
    )
    want = (32 * MIB - 16 * MIB) // runner.layout.bytes_per_page
    assert runner.pool.num_pages == want
    with pytest.raises(ValueError, match="leaves no KV pool"):
        ModelRunner.from_path(str(tmp_path), progress=False, page_size=4, mem_fraction_static=0.2)


def test_the_flags_are_checked():
    assert ModelConfig(mem_fraction_static=0.8).mem_fraction_static == 0.8
    with pytest.raises(ConfigError):
        ModelConfig(mem_fraction_static=0.0)
    with pytest.raises(ConfigError):
        ModelConfig(mem_fraction_static=0.5, max_total_tokens=4096)
    with pytest.raises(ConfigError):
        ModelConfig(cuda_graph_max_bs=0)
    with pytest.raises(ConfigError):
        ModelConfig(attention_backend="flash")
