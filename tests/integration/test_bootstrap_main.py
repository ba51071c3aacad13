"""`python -m bootstrap`: READY line once both ports listen, registry and API answer.

SIGTERM exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from common.node.process import READY_PREFIX

ROOT = Path(__file__).resolve().parents[2]


def test_process_announces_serves_and_stops_cleanly() -> None:
    env = {**os.environ, "PDSERVE_AUTH_TOKEN": "tok", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bootstrap",
            "--port",
            "0",
            "--disaggregation-bootstrap-port",
            "0",
            "--lease-timeout",
            "3",
            "--log-level",
            "WARNING",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(READY_PREFIX), line
        info = json.loads(line[len(READY_PREFIX) :])
        assert info["role"] == "bootstrap" and info["reply_endpoint"].startswith("tcp://127.0.0.1:")
        auth = {"Authorization": "Bearer tok"}
        assert httpx.get(info["registry_url"] + "/nodes", headers=auth).json() == {"nodes": []}
        assert httpx.get(info["registry_url"] + "/nodes").status_code == 401
        assert httpx.get(info["api_url"] + "/health").json()["status"] == "ok"
        models = httpx.get(info["api_url"] + "/v1/models", headers=auth).json()
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_flags_exit_2() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bootstrap", "--lease-timeout", "0"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--lease-timeout" in out.stderr


def test_ready_prefix_matches_the_nodes() -> None:
    from bootstrap.__main__ import READY_PREFIX as BOOTSTRAP_READY_PREFIX

    assert BOOTSTRAP_READY_PREFIX == READY_PREFIX
