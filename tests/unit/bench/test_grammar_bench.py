"""bench/grammar.py --quick on the built-in model: every grammar output valid, JSON lines whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_quick_bench_reports_valid_outputs_and_ratios() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "grammar.py"), "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("cpu: ")
    # the bench prints each grammar output that failed the schema or was cut at max tokens
    assert not [line for line in lines if line.startswith(("# invalid", "# cut"))], done.stdout
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    points = [r for r in rows if "batch" in r]
    assert sorted((r["batch"], r["variant"]) for r in points) == [
        (1, "greedy"),
        (1, "sampled"),
        (8, "greedy"),
        (8, "sampled"),
    ]
    for r in points:
        assert r["bench"] == "grammar"
        assert r["valid"] == r["total"] == r["batch"] and r["cut"] == 0, r  # one round
        for name in ("plain_ms_per_token", "grammar_ms_per_token", "ratio"):
            assert isinstance(r[name], float) and r[name] > 0, (name, r)
        assert r["steps"] > 0 and r["mean_output_tokens"] > 1
    (compile_row,) = [r for r in rows if "compile_cold_ms" in r]
    assert compile_row["bench"] == "grammar"
    assert compile_row["compile_cold_ms"] > 0 and compile_row["tokenizer_info_ms"] > 0
    assert compile_row["compile_cached_ms"] >= 0
