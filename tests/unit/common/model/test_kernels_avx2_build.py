"""The C kernels' other variants (common.model.cpu.build), on the machine that runs this.

The other modules' tests check the variant the loader picks for this CPU (amx on an AMX
Xeon). Here the kernel tests and the model's run again in a child process held to each
other variant this CPU can run (common.model.cpu.library.use_variant): avx512 without the
AMX product, avx2 (the float32 panel product in its AVX2 shape, 16-column panels; no AMX,
so in bfloat16 the model falls back to the torch kernels) and portable (plain C: neither
product, attention and the fused steps on GCC's generic vectors), each against their
references. The portable variant runs wherever this test does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.model.cpu import library

ROOT = Path(__file__).resolve().parents[4]
MODULES = [
    "test_prefill_attention.py",
    "test_paged_attention.py",
    "test_fused_ops.py",
    "test_f32_gemm.py",
    "test_amx_gemm.py",
    "test_model_runner.py",
]
# what each variant's library reports: f32_gemm_ready, amx_gemm_ready, f32_gemm_panel
EXPECTED = {
    "avx512": "ready 1 0 panel 32",
    "avx2": "ready 1 0 panel 16",
    "portable": "ready 0 0 panel 0",
}

CHILD = """
import sys
from common.model.cpu import library
library.use_variant(sys.argv[1])
variant, lib = library.load()
assert lib is not None and variant == sys.argv[1], "the variant's library did not load"
print("ready", lib.f32_gemm_ready(), lib.amx_gemm_ready(), "panel", lib.f32_gemm_panel())
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[2:]]))
"""

RUNNABLE = {v.name for v in library.supported()}
OTHERS = [name for name in EXPECTED if name in RUNNABLE and name != library.loaded_variant()]


@pytest.mark.parametrize("variant", OTHERS)
def test_each_other_variant_passes_the_kernel_tests(variant):
    files = [str(Path(__file__).with_name(m)) for m in MODULES]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, variant, *files],
        cwd=ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert EXPECTED[variant] in out
    assert " passed" in out and " failed" not in out


def test_the_portable_variant_is_built_and_runs_here():
    """Built on every architecture, needing no CPU flag: the loader's last resort."""
    assert "portable" in RUNNABLE
    assert (library.LIB_DIR / library.BY_NAME["portable"].filename).exists()
