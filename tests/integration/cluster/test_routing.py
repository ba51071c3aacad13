"""Where the gateway sends requests: precise routing to the cached context, shared prompts."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.integration.cluster.common import API_KEY, SYSTEM, client
from tests.support.cluster import metric

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")
pytest.importorskip("openai")


def test_precise_routing_sends_a_tenant_back_to_the_node_that_caches_its_context(cluster):
    """Tenants share their first 32 tokens (one affinity key) but not their contexts: the
    KV events tell the gateway which prefill node holds each context. Round one arrives at
    once, so the queued work spreads it over both nodes; in round two affinity would send
    every tenant to the key's one home node, precise routing sends each where it is cached."""
    rng = random.Random(16)
    header = [rng.randrange(100, 49000) for _ in range(32)]
    contexts = [header + [rng.randrange(100, 49000) for _ in range(320)] for _ in range(6)]
    nodes = [cluster["nodes"][f"prefill-{i}"].ready["http_url"] for i in range(2)]
    before = [metric(u, "pdserve_prompt_tokens_total") for u in nodes]
    index_before = metric(cluster["api"], "pdserve_kv_index_pages")
    url = cluster["api"] + "/v1/completions"
    results: list[tuple[int, dict]] = []
    threads = [
        threading.Thread(target=lambda ids=ids: results.append(_completion(url, ids + [7, 8, 9])))
        for ids in contexts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [status for status, _ in results] == [200] * 6, results
    grown = [metric(u, "pdserve_prompt_tokens_total") - b for u, b in zip(nodes, before)]
    assert all(g >= 355 for g in grown), grown  # both nodes took tenants
    deadline = time.monotonic() + 15  # the events reach the gateway's index
    while metric(cluster["api"], "pdserve_kv_index_pages") < index_before + 6 * 20:
        assert time.monotonic() < deadline, "the KV index never learned the contexts"
        time.sleep(0.2)
    hits_before = metric(cluster["api"], "pdserve_router_decisions_total", decision="cache")
    for ids in contexts:  # one at a time: nothing queued, only the cache decides
        status, body = _completion(url, ids + [11, 12, 13])
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 352, body["usage"]
    hits = metric(cluster["api"], "pdserve_router_decisions_total", decision="cache")
    assert hits - hits_before == len(contexts)


def _completion(url: str, ids: list[int]) -> tuple[int, dict]:
    req = urllib.request.Request(
        url,
        method="POST",
        data=json.dumps(
            {"model": "default", "prompt": ids, "max_tokens": 1, "temperature": 0}
        ).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def test_requests_sharing_a_system_prompt_land_on_the_same_prefill_node(cluster):
    nodes = cluster["nodes"]
    before = {
        n: metric(nodes[n].ready["http_url"], "pdserve_prompt_tokens_total")
        for n in ("prefill-0", "prefill-1")
    }
    cl = client(cluster)
    for q in (
        "Is the lamp lit?",
        "How high is the tower?",
        "When is the next storm?",
        "Any ships?",
    ):
        cl.chat.completions.create(
            model="default",
            max_tokens=2,
            temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        )
    grew = [
        n
        for n in before
        if metric(nodes[n].ready["http_url"], "pdserve_prompt_tokens_total") > before[n]
    ]
    assert len(grew) == 1, grew
