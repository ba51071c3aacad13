"""bench/gateway.py end to end, briefly: a real bootstrap process and stand-in nodes, every
request answered, the figures it prints present and consistent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCH = Path(__file__).resolve().parents[2] / "bench" / "gateway.py"


def test_the_gateway_bench_streams_and_reports_per_row() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--streams",
            "4",
            "--tokens",
            "16",
            "--duration",
            "1.5",
            "--replicas",
            "1",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["replicas"], r["phase"], r["streams"]) for r in rows] == [
        (1, "stream", 4),
        (1, "requests", 4),
        (2, "stream", 4),
        (2, "requests", 4),
    ]
    gateways = {1: {"gateway"}, 2: {"gateway-0", "gateway-1"}}
    for r in rows:
        assert r["bench"] == "gateway" and r["errors"] == 0, r
        assert r["requests_per_s"] > 0 and r["tokens_per_s"] >= r["requests_per_s"], r
        assert 0 <= r["added_latency_p50_ms"] <= r["added_latency_p99_ms"], r
        procs = gateways[r["replicas"]] | {"prefill", "decode", "load_generator"}
        assert r["gateway_cpu_s"] > 0 and set(r["cpu_s"]) == procs, r
        # Both replicas carried streams: each used CPU of its own.
        assert all(r["cpu_s"][g] > 0 for g in gateways[r["replicas"]]), r
    for stream, requests in (rows[0:2], rows[2:4]):
        assert stream["tokens_per_s"] / stream["requests_per_s"] == pytest.approx(16, rel=0.01)
        assert requests["tokens_per_s"] == pytest.approx(requests["requests_per_s"], rel=0.01)
