"""bench/device_check.sh --rerun: only the phases an earlier run's results say failed, timed
out or never ended run again (the GPU machine's second call costs only those)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))

from device_check import failed_phases  # noqa: E402


def _results(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "earlier.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _phase(phase: str, ok: bool = True, rc: int = 0) -> list[dict]:
    return [
        {"phase": phase, "kind": "summary", "ok": ok},
        {"phase": phase, "kind": "phase_end", "rc": rc, "timed_out": rc in (124, 137)},
    ]


def test_failed_timed_out_and_missing_phases_run_again(tmp_path):
    rows = [{"phase": "-", "kind": "plan", "phases": "a,b,c,d,e"}]
    rows += _phase("a") + _phase("b", ok=False) + _phase("c", rc=124)
    rows += [{"phase": "d", "kind": "summary", "ok": True}]  # cut off before its end
    assert failed_phases(_results(tmp_path, rows)) == ["b", "c", "d", "e"]


def test_a_run_that_passed_reruns_nothing(tmp_path):
    rows = [{"phase": "-", "kind": "plan", "phases": "a,c"}, *_phase("a"), *_phase("c")]
    assert failed_phases(_results(tmp_path, rows)) == []
    assert failed_phases(str(tmp_path / "missing.jsonl")) == list("abcde")


@pytest.mark.slow
def test_the_script_runs_only_the_failed_phase(tmp_path):
    rows = [{"phase": "-", "kind": "plan", "phases": "a,c"}, *_phase("a"), *_phase("c", ok=False)]
    earlier = _results(tmp_path, rows)
    out = tmp_path / "results.jsonl"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    done = subprocess.run(
        [
            "bash",
            str(ROOT / "bench" / "device_check.sh"),
            "--cpu",
            "--rerun",
            earlier,
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    ran = {json.loads(line)["phase"] for line in out.read_text().splitlines()}
    assert ran == {"-", "c"}
