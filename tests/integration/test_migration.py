"""Mid-stream migration on real processes: one prefill node, two decode nodes (NIXL), the
built-in model in float32. A decode node killed (SIGKILL) mid-stream hands its streams to
the other one; the client sees no error and exactly the tokens an unfaulted run gives."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from typing import Any

import pytest

from tests.support.cluster import http, metric, pd_pair, respawn, wait_ready

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")

PROMPT = "Write a long story about a lighthouse keeper and the sea."
NUM_TOKENS = 48
LEASE = ["--lease-timeout", "3"]  # a killed node's id is free again for its restart soon


@pytest.fixture(scope="module")
def pd():
    with pd_pair(
        ["--max-total-tokens", "4096", *LEASE],
        ["--max-total-tokens", "4096", *LEASE],
        2,
        tuple(LEASE),
    ) as cluster:
        yield cluster


def revive(pd: dict[str, Any]) -> None:
    """Start again a decode node an earlier case killed; wait until all 3 are healthy."""
    dead = [p for p in pd["decodes"] if p.popen.poll() is not None]
    for proc in dead:
        respawn(proc)
    wait_ready(dead)
    deadline = time.monotonic() + 60
    while True:
        status, body = http("GET", pd["api"] + "/nodes")
        if status == 200 and sum(1 for n in body["nodes"] if n.get("healthy")) == 3:
            return
        assert time.monotonic() < deadline, body
        time.sleep(0.2)


def generate(api: str, **sampling: Any) -> list[int]:
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": NUM_TOKENS, "ignore_eos": True, **sampling},
    }
    status, out = http("POST", api + "/generate", body, timeout=120)
    assert status == 200, out
    return out["output_ids"]


def stream(api: str, events: list[dict[str, Any]], **sampling: Any) -> None:
    """/generate streamed; each parsed event is appended as it arrives."""
    body = {
        "text": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": NUM_TOKENS, "ignore_eos": True, **sampling},
    }
    req = urllib.request.Request(
        api + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=180) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))


def migrations(api: str) -> float:
    try:
        return metric(api, "pdserve_migrations_total")
    except KeyError:  # a counter with labels is exported from its first increment on
        return 0.0


def serving(decodes: list[Any]) -> Any:
    """The decode node holding pages (of the one request in flight)."""
    for _ in range(600):
        for proc in decodes:
            if proc.popen.poll() is None and metric(
                proc.ready["http_url"], "pdserve_kv_pages_held"
            ):
                return proc
        time.sleep(0.05)
    raise AssertionError("no decode node holds the request")


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 77}])
def test_a_decode_node_killed_mid_stream_hands_the_stream_over(pd, sampling) -> None:
    revive(pd)
    live = pd["decodes"]
    reference = generate(pd["api"], **sampling)
    assert len(reference) == NUM_TOKENS
    before = migrations(pd["api"])
    events: list[dict[str, Any]] = []
    client = threading.Thread(target=stream, args=(pd["api"], events), kwargs=sampling)
    client.start()
    victim = serving(live)
    while len(events) < 8:
        assert client.is_alive(), events[-1:]
        time.sleep(0.01)
    victim.kill()
    client.join(120)
    assert not any("error" in e for e in events), events[-1]
    assert events[-1]["output_ids"] == reference  # no token lost, none twice, same draws
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert migrations(pd["api"]) == before + 1
    gap = metric(pd["api"], "pdserve_migration_gap_seconds_sum")
    print(f"migration gaps so far (sum): {gap:.3f} s")
    for proc in [pd["prefill"], *(p for p in pd["decodes"] if p.popen.poll() is None)]:
        deadline = time.monotonic() + 30
        while metric(proc.ready["http_url"], "pdserve_kv_pages_held") != 0:
            assert time.monotonic() < deadline, f"{proc.name} still holds pages"
            time.sleep(0.2)
