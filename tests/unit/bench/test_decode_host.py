"""bench/decode_host.py's measurement runs on this tree (the baseline's needs a worktree and
is the bench's own business): a row per point, host time measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_worker_measures_every_point():
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "decode_host.py"),
            "--worker",
            str(ROOT),
            "--batches",
            "1",
            "4",
            "--contexts",
            "64",
            "--steps",
            "8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 64), (4, 64)]
    assert all(r["host_ms_per_step"] > 0 for r in rows)
