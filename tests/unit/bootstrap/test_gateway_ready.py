"""Readiness: /ready is 503 until a healthy prefill and decode node are registered; /health
(liveness) answers 200 throughout."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from common.node.registry_client import wait_until
from tests.support import gateway as harness
from tests.support.gateway import Gateway

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
