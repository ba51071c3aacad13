"""Convert a GGUF file (llama / mistral / qwen2) once into a cached HF-format directory."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# GGUF architecture name -> (HF architecture, model_type).
_ARCHS = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))


def converted_dir_for(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{st.st_size}:{int(st.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{gguf_path.stem}-{digest}"


def hf_name(gguf_name: str) -> str:
    """HF parameter name for a GGUF tensor name, e.g. blk.3.attn_q.weight."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, base, suffix = parts[1], parts[2], parts[3]
        return f"model.layers.{layer}.{_LAYER_TENSORS[base]}.{suffix}"
    return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of attn_q / attn_k (and their biases)."""
    rows = w.shape[0]
    head_dim = rows // num_heads
    rest = w.shape[1:]
    return w.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest).copy()


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def hf_config_from_gguf(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHS)}")
    hf_arch, model_type = _ARCHS[arch]
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    names = {t.name for t in reader.tensors}
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if factor and kind == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    return cfg


def _dequantized_tensors(reader: Any, cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    import gguf
    from tqdm import tqdm

    unpermute = cfg["model_type"] in ("llama", "mistral")
    out: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="dequantizing GGUF", unit="tensor", leave=False):
        arr = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if unpermute and ".attn_q." in t.name:
            arr = unpermute_rope_rows(arr, cfg["num_attention_heads"])
        elif unpermute and ".attn_k." in t.name:
            arr = unpermute_rope_rows(arr, cfg["num_key_value_heads"])
        out[hf_name(t.name)] = np.ascontiguousarray(arr)
    return out


@contextlib.contextmanager
def _conversion_lock(target: Path) -> Any:
    """One converter per target across processes: the bootstrap, prefill and decode
    processes of a first start would otherwise all convert at once. The others wait."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(gguf_path: str | Path) -> Path:
    """Return a cached HF directory for this GGUF, converting it on first use (atomically,
    by one process at a time)."""
    gguf_path = Path(gguf_path)
    target = converted_dir_for(gguf_path)
    if (target / "config.json").exists():
        return target
    with _conversion_lock(target):
        if not (target / "config.json").exists():  # converted while we waited
            _convert(gguf_path, target)
    return target


def _convert(gguf_path: Path, target: Path) -> None:
    import gguf
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    logger.info("converting %s into %s (once)", gguf_path, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        reader = gguf.GGUFReader(str(gguf_path))
        cfg = hf_config_from_gguf(reader)
        save_file(_dequantized_tensors(reader, cfg), str(tmp / "model.safetensors"))
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(str(tmp))
        # config.json last: its presence marks a complete directory.
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
            # Another process finished the same conversion first; keep theirs.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
