"""The C kernels' AVX2 code, on a machine with AVX-512 too.

The kernels are compiled with -march=native, so where the CPU has AVX-512 the tests of the
other modules check only its AVX-512 branches, while an AVX2-only node (an AMD EPYC Zen 3)
runs the others. Here the kernel tests and the model's run again in a child process whose
library is built with -march=haswell (AVX2 and FMA, no AVX-512) into its own cache
directory: attention, the fused steps, the float32 panel product (its AVX2 shape, 16-column
panels) and the model against their references, and the AMX product reduced to its stub,
so in bfloat16 the model falls back to the torch kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.cpu_features import cpu_flags

ROOT = Path(__file__).resolve().parents[4]
MODULES = ["test_prefill_attention.py", "test_paged_attention.py", "test_fused_ops.py",
           "test_f32_gemm.py", "test_amx_gemm.py", "test_model_runner.py"]

CHILD = """
import sys
from common.model import cpu_kernels as ck
ck.use_march("haswell")
lib = ck.load_library()
assert lib is not None, "the -march=haswell build failed"
print("ready", lib.f32_gemm_ready(), lib.amx_gemm_ready(), "panel", lib.f32_gemm_panel())
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


@pytest.mark.skipif("avx512f" not in cpu_flags(),
                    reason="no AVX-512 here: the other modules' tests run the AVX2 code")
def test_kernels_built_for_avx2_pass_their_tests(tmp_path):
    env = dict(os.environ, PDSERVE_CACHE_DIR=str(tmp_path / "cache"))
    files = [str(Path(__file__).with_name(m)) for m in MODULES]
    proc = subprocess.run([sys.executable, "-c", CHILD, *files], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "ready 1 0 panel 16" in out  # the AVX2 panel product; no AMX code in that build
    assert " passed" in out and " failed" not in out
    built = list((tmp_path / "cache" / "kernels").glob("pdserve-kernels-*.so"))
    assert len(built) == 1  # its own library, beside (not over) the native one
