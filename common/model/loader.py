"""Resolve a model path, load its weights (HF safetensors, sharded or not; GGUF via conversion)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from common.model.spec import ModelSpec

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def resolve_model_dir(model_path: str | None) -> Path:
    """An HF-format directory for --model-path: a directory, a .gguf file, or None (default)."""
    if model_path is None:
        from common.model.default_model import default_model_dir

        return default_model_dir()
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        from common.model.gguf_convert import convert_gguf

        return convert_gguf(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"--model-path {model_path!r} is neither a directory with config.json nor a .gguf file"
        )
    return path


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def load_state_dict(
    model_dir: Path, dtype: torch.dtype, progress: bool = True
) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint by HF name, cast to dtype, on the CPU."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = safetensors_files(model_dir)
    names: list[tuple[Path, str]] = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.extend((f, k) for k in sf.keys())
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(
        total=len(names), desc=f"loading {model_dir.name}", unit="tensor", disable=not progress
    )
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k).to(dtype)
                bar.update(1)
    bar.close()
    return out


def load_spec(model_dir: Path) -> ModelSpec:
    return ModelSpec.from_dir(model_dir)
