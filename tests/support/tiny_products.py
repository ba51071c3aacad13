"""A tiny qwen2 model (biases on q, k, v) and extend + decode on one product kernel: the
model-level check of the C products (tests/unit/common/model/test_amx_gemm.py, test_f32_gemm.py)."""

from __future__ import annotations

import torch

from common.kv_pool import pages_needed
from common.model.cpu.gemm import KernelChooser
from common.model.runner import ExtendRequest, ModelRunner
from common.model.spec import ModelSpec


def tiny_runner(
    dtype: str, vocab: int, intermediate: int, seed: int, num_pages: int = 64
) -> ModelRunner:
    """2 layers, hidden 64, 4 heads over 2 KV heads of 16, random weights of scale 0.3."""
    spec = ModelSpec(
        architecture="qwen2",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=intermediate,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        attention_bias=True,
    )
    g = torch.Generator().manual_seed(seed)
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, 64),
        "model.norm.weight": (64,),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (64, 64),
                p + "self_attn.q_proj.bias": (64,),
                p + "self_attn.k_proj.weight": (32, 64),
                p + "self_attn.k_proj.bias": (32,),
                p + "self_attn.v_proj.weight": (32, 64),
                p + "self_attn.v_proj.bias": (32,),
                p + "self_attn.o_proj.weight": (64, 64),
                p + "mlp.gate_proj.weight": (intermediate, 64),
                p + "mlp.up_proj.weight": (intermediate, 64),
                p + "mlp.down_proj.weight": (64, intermediate),
                p + "input_layernorm.weight": (64,),
                p + "post_attention_layernorm.weight": (64,),
            }
        )
    weights = {
        n: torch.randn(*s, generator=g) * (0.3 if len(s) == 2 else 1.0) for n, s in shapes.items()
    }
    return ModelRunner(spec, weights, dtype=dtype, page_size=4, num_pages=num_pages)


def logits_on(
    runner: ModelRunner, kernel: str, prompts: list[list[int]], fed: list[list[int]]
) -> torch.Tensor:
    """The extend's last-token logits, then each decode step's (feeding `fed`: per sequence,
    per step), with every product on `kernel`; the pages are freed after."""
    model = runner.model
    model.chooser = KernelChooser((kernel,), trials=1, prefill_trials=1)
    model.head_chooser = KernelChooser((kernel,), trials=1, prefill_trials=1)
    steps = len(fed[0])
    tables = [
        runner.pool.allocator.allocate(pages_needed(len(p) + steps, runner.page_size))
        for p in prompts
    ]
    try:
        logits = [runner.extend([ExtendRequest(p, 0, t) for p, t in zip(prompts, tables)]).logits]
        lens = [len(p) for p in prompts]
        for step in range(steps):
            lens = [n + 1 for n in lens]
            logits.append(runner.decode([f[step] for f in fed], lens, tables))
    finally:
        for t in tables:
            runner.pool.allocator.free(t)
    return torch.stack(logits)
