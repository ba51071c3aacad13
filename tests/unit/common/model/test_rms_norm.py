"""The model's RMSNorm is bit-equal to transformers' LlamaRMSNorm, in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from common.model.llama import rms_norm

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_bit_equal_to_transformers(dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows * hidden)
    ref = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(hidden, generator=g) * 0.5 + 1.0)
    ref = ref.to(dtype)
    # a spread of magnitudes, as hidden states have (a few large outlier channels)
    x = (
        torch.randn(rows, hidden, generator=g)
        * torch.logspace(-2, 2, hidden)[torch.randperm(hidden, generator=g)]
    )
    x = x.to(dtype)
    with torch.no_grad():
        expect = ref(x)
    got = rms_norm(x, ref.weight.detach(), 1e-5)
    assert got.dtype == dtype
    assert torch.equal(got, expect)
