"""The READY line (common.ready): written in one call, read back from a shared pipe's lines."""

from __future__ import annotations

import io
import subprocess
import sys
from types import SimpleNamespace

from common.ready import READY_PREFIX, parse_ready, ready_line

INFO = {"role": "decode", "node_id": "decode-1", "http_url": "http://127.0.0.1:5", "n": [1, 2]}


def test_round_trip():
    line = ready_line(INFO)
    assert line.endswith("\n") and line.count("\n") == 1
    assert parse_ready(line) == INFO


def test_a_log_write_after_the_json_on_the_same_line_is_ignored():
    """stderr merged into stdout: another thread's log lands before the READY line's newline.
    The reader took the rest of the line as JSON, raised, and its thread died: the node was
    waited for 300 s and restarted (seen in a clean-clone run)."""
    line = READY_PREFIX + '{"role": "decode", "node_id": "decode-1"}2026-12-02 04:26:18 INFO x\n'
    assert parse_ready(line) == {"role": "decode", "node_id": "decode-1"}


def test_a_progress_bar_before_the_prefix_is_skipped():
    line = "\rloading: 100%|#####| 272/272" + ready_line(INFO)
    assert parse_ready(line) == INFO


def test_other_lines_are_not_ready():
    assert parse_ready("2026-12-02 INFO joining bootstrap replica\n") is None
    assert parse_ready(READY_PREFIX + "not json\n") is None
    assert parse_ready(READY_PREFIX + "[1, 2]\n") is None  # an object, nothing else


def test_a_node_announces_in_one_write(monkeypatch):
    """NodeProcess.announce writes the whole line at once: the pipe gets it in one piece
    (under PIPE_BUF), so no other writer can land between the JSON and its newline (print
    wrote the text and the newline apart)."""
    from common.node.process import NodeProcess

    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, s: str) -> int:
            writes.append(s)
            return len(s)

    monkeypatch.setattr(sys, "stdout", Recorder())
    node = SimpleNamespace(
        node=SimpleNamespace(role="decode", node_id="decode-1"), http_url="http://127.0.0.1:5"
    )
    NodeProcess.announce(node, n=[1, 2])  # type: ignore[arg-type]
    assert writes == [ready_line(INFO)]


def test_the_bootstrap_prints_the_same_line():
    """bootstrap/__main__.py takes the prefix and the line from common.ready (no copy)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import bootstrap.__main__ as b, common.ready as r; "
            "print(b.READY_PREFIX is r.READY_PREFIX, b.ready_line is r.ready_line)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.split() == ["True", "True"]
