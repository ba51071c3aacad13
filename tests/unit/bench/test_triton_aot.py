"""bench/triton_aot.py: every Triton kernel variant the device check and serving use compiles
ahead of time for an H100 (sm_90) here, with no GPU (Triton's compiler and the ptxas in its
wheel): no register spills in bfloat16 and float16, shared memory within the H100's limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
KERNELS = {
    "_decode_kernel",
    "_merge_splits_kernel",
    "_extend_kernel",
    "_rope_store_kernel",
    "_silu_mul_kernel",
    "_add_rms_norm_kernel",
}


def test_every_variant_compiles_for_sm_90_without_spills(tmp_path):
    out = tmp_path / "aot.jsonl"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compiled here, not found
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "triton_aot.py"),
            "--workers",
            "2",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    summary = rows.pop()
    failed = [(r["kernel"], r["variant"], r["problems"]) for r in rows if not r["ok"]]
    assert done.returncode == 0 and not failed, failed
    # 3 shapes x 3 dtypes, each kernel once (the residual add with RMSNorm twice), but
    # silu's product, whose code no model shape changes: once per dtype
    counts = Counter(r["kernel"] for r in rows)
    assert counts["_add_rms_norm_kernel"] == 18 and counts["_silu_mul_kernel"] == 3
    assert summary["num_variants"] == len(rows) == 3 * (3 * 6 + 1)
    assert {r["kernel"] for r in rows} == KERNELS
    assert {r["dtype"] for r in rows} == {"bf16", "fp16", "fp32"}
    for r in rows:
        assert r["registers"] > 0 and r["shared_bytes"] <= 227 * 1024, r
        if r["dtype"] != "fp32":
            assert r["spill_stores"] == r["spill_loads"] == 0, r


_TWICE = r"""
import json, sys
sys.path.insert(0, "bench")
from triton_aot import variants_for
from common.model.kernel_variants import precompile
merge = [v for v in variants_for(["tiny-llama"], ["bfloat16"]) if "merge" in v.kernel]
first = precompile(merge, ("cuda", 90, 32), workers=1)
second = precompile(merge, ("cuda", 90, 32), workers=1)
print(json.dumps([len(merge), len(first), [c.error for c in first], len(second)]))
"""


def test_a_precompiled_variant_is_not_compiled_again(tmp_path):
    """A node's restart (or a second node) finds its variants marked in Triton's cache and
    spawns no compile process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", _TWICE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    num, first, errors, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert num == first == 1 and errors == [""] and second == 0
