"""Test clusters' start-up wait: a silent process is dumped, warned about and started once more."""

from __future__ import annotations

import sys

import pytest

from common.node.process import READY_PREFIX
from tests.support.cluster import Proc, _spawn, wait_ready

# The first run leaves a marker and hangs; a second run finds it and says READY.
SCRIPT = f"""
import os, sys, time
marker = sys.argv[1]
if not os.path.exists(marker):
    open(marker, "w").close()
    print("hanging", flush=True)
    time.sleep(60)
print({READY_PREFIX!r} + '{{"ok": true}}', flush=True)
time.sleep(60)
"""


def _proc(tmp_path) -> Proc:
    proc = Proc("flaky", None, argv=[sys.executable, "-c", SCRIPT, str(tmp_path / "marker")])  # type: ignore[arg-type]
    _spawn(proc)
    return proc


def test_a_process_silent_at_the_deadline_is_started_again(tmp_path):
    proc = _proc(tmp_path)
    try:
        with pytest.warns(UserWarning, match="flaky did not start within 1 s and is started again"):
            wait_ready([proc], timeout=1.0)
        assert proc.ready == {"ok": True}
    finally:
        proc.popen.kill()


def test_without_restarts_a_silent_process_fails_with_its_lines(tmp_path):
    proc = _proc(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="flaky did not start:\nhanging"):
            wait_ready([proc], timeout=1.0, restarts=0)
    finally:
        proc.popen.kill()
