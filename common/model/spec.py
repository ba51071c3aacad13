"""ModelSpec: the architecture facts the runner needs, read from an HF config.json."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool = False
    rope_scaling: dict[str, Any] | None = None
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> ModelSpec:
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        arch = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None
        )
        if arch is None and model_type in SUPPORTED_ARCHITECTURES.values():
            arch = model_type
        if arch is None:
            raise ValueError(
                f"unsupported model {archs or model_type!r}; pdserve runs "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
        rope_theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        sliding = None
        if arch == "mistral" or cfg.get("use_sliding_window"):
            sliding = cfg.get("sliding_window")
        return ModelSpec(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            rope_scaling=rope_scaling,
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @staticmethod
    def from_dir(path: str | Path) -> ModelSpec:
        with open(Path(path) / "config.json") as f:
            return ModelSpec.from_hf_config(json.load(f))

    @property
    def context_length(self) -> int:
        if self.sliding_window is not None:
            # Sliding-window attention is not implemented: stay inside the window,
            # where full attention and windowed attention agree.
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return (
            self.num_layers * (attn + mlp + 2 * self.hidden_size) + embed + head + self.hidden_size
        )

    def decode_flops_per_token(self) -> int:
        """Matmul FLOPs for one decoded token, attention over the cache excluded."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return 2 * (self.num_layers * (attn + mlp) + self.vocab_size * self.hidden_size)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse RoPE frequencies (float32), with llama3 / linear scaling when configured."""
    dim = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
