"""Which attention backend a model gets (common.model.attention.make_attention_backend)."""

from __future__ import annotations

import pytest
import torch

import common.model.attention as attention
from common.model.attention import (
    CpuKernelAttention,
    TorchAttention,
    TritonAttention,
    make_attention_backend,
)
from common.model.spec import ModelSpec

SPEC = ModelSpec(
    architecture="LlamaForCausalLM",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    attention_bias=False,
)
CPU = torch.device("cpu")


def test_auto_is_the_c_kernels_on_the_cpu_and_torch_without_them():
    assert isinstance(make_attention_backend("auto", SPEC, torch.float32, CPU), CpuKernelAttention)
    got = make_attention_backend("auto", SPEC, torch.float32, CPU, cpu_kernels=False)
    assert type(got) is TorchAttention


def test_auto_on_cuda_is_triton_where_it_runs_and_torch_otherwise(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(attention, "triton_usable", lambda _device: False)
    assert type(make_attention_backend("auto", SPEC, torch.bfloat16, cuda)) is TorchAttention
    monkeypatch.setattr(attention, "triton_usable", lambda _device: True)
    monkeypatch.setattr(
        TritonAttention,
        "__init__",
        lambda self, spec, dtype, device: setattr(self, "device", device),
    )
    assert isinstance(make_attention_backend("auto", SPEC, torch.bfloat16, cuda), TritonAttention)


def test_a_backend_that_cannot_run_here_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_attention_backend("flash", SPEC, torch.float32, CPU)
    with pytest.raises(ValueError, match="runs on the CPU"):
        make_attention_backend("cpu", SPEC, torch.float32, torch.device("cuda", 0))
    monkeypatch.setattr(attention, "triton_usable", lambda _device: False)
    with pytest.raises(ValueError, match="needs Triton"):
        make_attention_backend("triton", SPEC, torch.float32, CPU)
