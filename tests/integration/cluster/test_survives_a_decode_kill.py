"""Runs last in the package: a decode node killed mid-stream, then nothing held anywhere."""

from __future__ import annotations

import threading
import time

import pytest

from tests.integration.cluster.common import client, metric_or_0
from tests.support.cluster import Proc, metric
from tests.support.waits import wait_for

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")
pytest.importorskip("openai")


def test_killing_a_decode_node_mid_stream_migrates_its_streams(cluster):
    """Six streams over two decode nodes; one node is killed (SIGKILL) mid-stream. Its
    streams move to the other pair with their output so far: every client gets its whole
    answer without an error event, and the gateway counts each move."""
    cl = client(cluster)
    outcomes: dict[int, str] = {}
    texts = [""] * 6
    chunks = [0] * 6

    def one(i: int) -> None:
        try:
            for ch in cl.completions.create(
                model="default", prompt=f"Story {i}:", max_tokens=120, temperature=0, stream=True
            ):
                chunks[i] += 1
                texts[i] += ch.choices[0].text if ch.choices else ""
                if ch.choices and ch.choices[0].finish_reason:
                    outcomes[i] = f"ok {ch.choices[0].finish_reason}"
        except Exception as exc:  # noqa: BLE001
            outcomes[i] = f"error {type(exc).__name__}: {exc}"

    migrated_before = metric_or_0(cluster["api"], "pdserve_migrations_total")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    # Every stream is decoding (a token each) before the victim dies.
    wait_for(lambda: all(chunks), 120, "a first token on every stream")
    victim: Proc = cluster["nodes"]["decode-1"]
    victim.kill()
    for t in threads:
        t.join(300)
    assert sorted(outcomes) == list(range(6)), outcomes
    assert all(v.startswith("ok") for v in outcomes.values()), outcomes
    # Least-load decode choice spreads six concurrent requests over both decode nodes,
    # so the victim held at least one of them.
    assert metric_or_0(cluster["api"], "pdserve_migrations_total") > migrated_before
    for i, text in enumerate(texts):
        whole = cl.completions.create(
            model="default", prompt=f"Story {i}:", max_tokens=120, temperature=0
        )
        # No token twice, none missing: the unfaulted answer (float32 greedy).
        assert text == whole.choices[0].text, (i, text)


def test_no_node_holds_a_page_when_idle(cluster):
    deadline = time.monotonic() + 30
    for name, p in cluster["nodes"].items():
        if p.popen.poll() is not None:
            continue
        while metric(p.ready["http_url"], "pdserve_kv_pages_held") != 0:
            assert time.monotonic() < deadline, f"{name} still holds pages"
            time.sleep(0.2)
