"""Readiness: /ready is 503 until a healthy prefill and decode node are registered; /health
(liveness) answers 200 throughout."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx

from common.node.registry_client import wait_until
from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.gateway import Gateway, reply_ids, stream_tokens

gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer


def test_ready_names_the_missing_roles_until_both_are_registered(
    gateway_factory: Callable[..., Gateway],
) -> None:
    gw = gateway_factory(lease_s=1.0)
    url = gw.api_url

    def ready() -> httpx.Response:
        return httpx.get(url + "/ready", timeout=5)

    r = ready()
    assert r.status_code == 503 and r.json()["missing_roles"] == ["prefill", "decode"], r.text
    assert "prefill or decode" in r.json()["message"]
    assert httpx.get(url + "/health", timeout=5).status_code == 200
    prefill = gw.node("prefill")
    r = ready()
    assert r.status_code == 503 and r.json()["missing_roles"] == ["decode"], r.text
    gw.node("decode")
    r = ready()
    assert r.status_code == 200 and r.json() == {
        "status": "ready",
        "missing_roles": [],
        "num_prefill_nodes": 1,
        "num_decode_nodes": 1,
    }
    # A node that stops heartbeating turns the gateway unready again within its lease.
    prefill.registry.stop(deregister=False)
    assert wait_until(lambda: ready().status_code == 503, 5.0)
    assert ready().json()["missing_roles"] == ["prefill"]
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_a_started_gateway_waits_for_its_nodes_instead_of_a_503(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    """Within --registration-window of its start the gateway says not ready, even with a
    pair registered, and a request that finds no node waits for one (before: a 503 "no
    prefill node is registered" at once, while the nodes' next heartbeats were due)."""
    ids = reply_ids(tokenizer)
    window = 3.0
    gw = gateway_factory(registration_window_s=window)
    started = time.monotonic()
    answers: list[httpx.Response] = []
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": len(ids)}
    asking = threading.Thread(
        target=lambda: answers.append(
            httpx.post(gw.api_url + "/v1/chat/completions", json=body, timeout=30)
        )
    )
    asking.start()
    time.sleep(0.5)  # the request is waiting; the nodes register late
    gw.node("prefill")
    gw.node("decode", stream_tokens(ids))
    r = httpx.get(gw.api_url + "/ready", timeout=5)
    if time.monotonic() - started < window - 0.5:
        assert r.status_code == 503 and r.json()["missing_roles"] == [], r.text
        assert "registering" in r.json()["message"]
    asking.join(30)
    assert answers and answers[0].status_code == 200, answers[0].text if answers else "hung"
    assert answers[0].json()["choices"][0]["message"]["content"] == tokenizer.decode(ids)
    assert wait_until(
        lambda: httpx.get(gw.api_url + "/ready", timeout=5).status_code == 200, window + 2
    )


def test_after_the_window_a_request_without_nodes_gets_its_503(
    gateway_factory: Callable[..., Gateway],
) -> None:
    gw = gateway_factory(registration_window_s=0.3)
    time.sleep(0.4)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    r = httpx.post(gw.api_url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_prefill_node", r.text
