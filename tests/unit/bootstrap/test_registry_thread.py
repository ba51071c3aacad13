"""The registry answers on its own thread: a blocked API event loop delays no heartbeat."""

from __future__ import annotations

import json
import threading
import urllib.request

from tests.support import gateway as harness
from tests.support.gateway import Gateway

gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer


def test_the_registry_answers_while_the_api_loop_is_blocked(gateway_factory) -> None:
    gw: Gateway = gateway_factory()
    prefill = gw.node("prefill")
    assert prefill.registry is not None
    loop = gw.server._loop
    assert loop is not None
    blocked, release = threading.Event(), threading.Event()

    def block() -> None:  # what a long synchronous piece of API work does to the loop
        blocked.set()
        release.wait(30)

    loop.call_soon_threadsafe(block)
    assert blocked.wait(5)
    try:
        # Answered while the API loop cannot run anything: a heartbeat, and the table.
        with urllib.request.urlopen(gw.registry_url + "/health", timeout=5) as resp:
            assert json.loads(resp.read())["status"] == "ok"
        beats = prefill.registry  # its heartbeats keep landing: the node stays registered
        before = beats.gateway_heard_at
        assert harness.wait_until(lambda: beats.gateway_heard_at > before, 10)
        assert beats.is_registered
    finally:
        release.set()
    assert gw.call(lambda: [v.node_id for v in gw.service.registry.views("prefill")]) == [
        prefill.node_id
    ]
