"""The built-in GGUF is converted once, by one process, when several start at the same time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.model.default_model import default_gguf_path

pytestmark = pytest.mark.slow

CONVERT = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from common.model.gguf_convert import convert_gguf
print(convert_gguf(sys.argv[1]))
"""


def test_concurrent_first_starts_convert_once_and_agree(tmp_path: Path) -> None:
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[4]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONVERT, str(default_gguf_path())],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-2000:] for _, err in outs]
    dirs = {out.strip() for out, _ in outs}
    assert len(dirs) == 1
    [converted] = dirs
    assert (Path(converted) / "config.json").exists()
    assert (Path(converted) / "model.safetensors").stat().st_size > 100 << 20
    assert sum(err.count("converting ") for _, err in outs) == 1, [err[-500:] for _, err in outs]
    # Nothing half-written is left beside it (temporary directories are removed).
    assert [p.name for p in Path(converted).parent.iterdir() if p.is_dir()] == [
        Path(converted).name
    ]
