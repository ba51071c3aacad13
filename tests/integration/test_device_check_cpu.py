"""bench/device_check.sh --cpu: every phase of the prepared GPU check runs here on tiny shapes
and really compares numbers, so the script cannot rot between GPU runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tolerance import FLOAT32_REL

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("a", "b", "c", "d", "e")
HAS_NIXL = importlib.util.find_spec("nixl") is not None  # without it phase d fails, e runs fake
TIMEOUT_S = 420  # measured about 50 s on 2 idle cores; the limits of its phases sum to 300


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("device-check")
    out = tmp / "results.jsonl"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "bench" / "device_check.sh"),
            "--cpu",
            "--out",
            str(out),
            "--work",
            str(tmp / "work"),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert proc.returncode == 0 or not HAS_NIXL, proc.stdout[-4000:]
    return lines


def _of(results: list[dict], phase: str, kind: str) -> list[dict]:
    return [r for r in results if r["phase"] == phase and r.get("kind") == kind]


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_ran_to_its_end_and_passed(results: list[dict], phase: str) -> None:
    if phase == "d" and not HAS_NIXL:
        pytest.skip("NIXL is not installed")
    [end] = _of(results, phase, "phase_end")
    assert end["rc"] == 0 and not end["timed_out"]
    [summary] = _of(results, phase, "summary")
    assert summary["ok"] and summary["num_checks"] > 0
    checks = [r for r in results if r["phase"] == phase and "ok" in r]
    assert checks and all(r["ok"] for r in checks), [r for r in checks if not r["ok"]]


def test_equivalence_is_within_the_cpu_tests_tolerances(results: list[dict]) -> None:
    rows = _of(results, "a", "equivalence")
    seen = {(r["model"], r["dtype"], r["case"]) for r in rows}
    assert seen == {
        (m, d, c)
        for m in ("tiny-llama", "tiny-qwen2")
        for d in ("float32", "bfloat16")
        for c in ("full", "chunked", "decode")
    }
    for r in rows:
        assert r["err"] <= r["bound"], r
        if r["dtype"] == "float32":
            assert r["bound"] == FLOAT32_REL and r["argmax_agree"] == 1.0, r
        else:
            # bfloat16 against a float32 reference cannot be exact: a real comparison ran
            assert 0 < r["err"] <= max(0.02, 2 * r["hf_bf16_err"]), r
    assert all(r["num_vectors"] > 1 for r in rows if r["case"] != "full")


def test_speed_phases_measured_against_their_limits(results: list[dict]) -> None:
    [bw] = _of(results, "b", "bandwidth")
    assert bw["copy_gbps"] > 0
    decode = _of(results, "b", "decode")
    assert {r["batch"] for r in decode} == {1, 4, 16}
    assert all(
        r["ms_per_step"] > 0 and r["hf_ms_per_step"] > 0 and r["bound_ms"] > 0 for r in decode
    )
    [peak] = _of(results, "c", "matmul_peak")
    assert peak["tflops"] > 0
    prefill = _of(results, "c", "prefill")
    assert [r["tokens"] for r in prefill] == [128, 256, 512]
    assert all(r["logits_err_vs_hf"] <= 1e-4 and r["fraction_of_peak"] > 0 for r in prefill)


def test_nixl_moved_every_byte_and_one_request_went_end_to_end(results: list[dict]) -> None:
    if HAS_NIXL:
        [nixl] = _of(results, "d", "nixl")
        assert nixl["bytes_equal"] and nixl["bad_pages"] == [0, 0] and nixl["gbps"] > 0
    [e2e] = _of(results, "e", "e2e")
    assert e2e["transfer_backend"] == ("nixl" if HAS_NIXL else "fake")
    assert e2e["completion_tokens"] == 16 and e2e["finish_reason"] == "length"
    assert e2e["prompt_logprobs"] == e2e["prompt_tokens"] > 1
    assert e2e["prompt_logprobs_finite"] is True
    assert e2e["n_choices_equal"] is True
    assert e2e["exit_codes"] == {"decode-0": 0, "prefill-0": 0, "bootstrap": 0}


def test_the_rehearsal_counts_each_phases_gpu_compiles_against_its_budget(results: list[dict]):
    """The variants each phase's runners launch on a GPU (a meta-tensor walk), new after the
    phases before it: phase a compiles its four configurations' kernels, the rest reuse
    them (before the kernels stopped specialising, phase a alone made about 128)."""
    rows = {r["phase"]: r for r in results if r.get("kind") == "gpu_compiles"}
    assert set(rows) == set(PHASES)
    assert all(r["ok"] and r["num_new"] <= r["budget"] for r in rows.values())
    assert 20 <= rows["a"]["num_new"] <= 30
    assert rows["b"]["num_new"] == rows["c"]["num_new"] == rows["e"]["num_new"] == 0
    assert rows["d"]["num_variants"] == 0
    [plan] = [r for r in results if r.get("kind") == "plan"]
    assert plan["phases"] == ",".join(PHASES)
