"""Warm-up's kernel choice (common.model.cpu.gemm) kept on disk, keyed by everything it
depends on, so that a node started again on the same machine skips the measuring (about
15 s of a 25 s start on a 2-core VM for the built-in model) and runs with the numerics it
had before: the kernels round differently, and a choice timed afresh can differ from
restart to restart.

The key: the CPU (model name and flags), the C kernels' variant, torch's version and
threads, the dtype, the candidate kernels and the model's shapes (the products' sizes; the
weights' values do not matter). A file that cannot be read, or does not fit the model, is
ignored and the choice measured again; one that cannot be written is logged and skipped.
Delete the directory to measure again (say, after moving the node to a quieter machine:
the first measurement is what every later start adopts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

from common.cpu_features import cpu_flags
from common.model.cpu.library import loaded_variant
from common.model.spec import ModelSpec

log = logging.getLogger(__name__)

VERSION = 1  # of the file's layout and of what the choice means


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def choice_key(spec: ModelSpec, dtype: torch.dtype, kernels: tuple[str, ...]) -> str:
    """What a choice depends on, hashed."""
    fields = {
        "version": VERSION,
        "cpu": _cpu_name(),
        "flags": sorted(cpu_flags()),
        "variant": loaded_variant(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "kernels": list(kernels),
        "shapes": [
            spec.vocab_size,
            spec.hidden_size,
            spec.intermediate_size,
            spec.num_layers,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.tie_word_embeddings,
        ],
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def path_for(cache_dir: str, key: str) -> Path:
    return Path(cache_dir) / f"kernels-{key}.json"


def load(path: Path) -> tuple[dict[int, str], dict[int, str]] | None:
    """(layers' choice, LM head's choice) from `path`, or None if absent or unreadable."""
    try:
        saved: Any = json.loads(path.read_text())
        if saved.get("version") != VERSION:
            return None
        layers = {int(b): str(k) for b, k in saved["layers"].items()}
        head = {int(b): str(k) for b, k in saved["head"].items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring the kernel choice in %s: %s", path, exc)
        return None
    return layers, head


def store(path: Path, layers: dict[int, str], head: dict[int, str]) -> None:
    """Write atomically (nodes starting together may race; the last one wins whole)."""
    body = json.dumps({"version": VERSION, "layers": layers, "head": head}, sort_keys=True)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernels-")
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not keep the kernel choice in %s: %s", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
