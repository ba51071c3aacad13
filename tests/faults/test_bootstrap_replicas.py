"""Two bootstrap replicas in front of one prefill and one decode node: kill -9 one under load.

Each node registers with both replicas (two --bootstrap-url). Losing a replica loses only
the streams it carried: the other replica's streams finish, new requests through it
succeed at once, and the nodes abort the dead replica's requests (its gateway is no
longer heard from) and free every page within lease + 1 s (plus this machine's slack).
"""

from __future__ import annotations

import os

import pytest

from tests.faults.harness import API_KEY, LEASE_S, PAGES_BOUND_S, START_TIMEOUT_S, TOKEN
from tests.faults.streams import Stream
from tests.support.cluster import Proc, http, metric, start, wait_ready
from tests.support.ports import free_port
from tests.support.waits import wait_for

HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def replicas():
    pytest.importorskip("nixl._api", reason="NIXL is not installed")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    apis, registries, procs = [], [], []
    for i in range(2):
        api, registry = free_port(), free_port()
        apis.append(f"http://{HOST}:{api}")
        registries.append(f"http://{HOST}:{registry}")
        procs.append(
            start(
                f"bootstrap-{i}",
                "bootstrap",
                "--host",
                HOST,
                "--port",
                str(api),
                "--disaggregation-bootstrap-port",
                str(registry),
                "--auth-token",
                TOKEN,
                "--api-key",
                API_KEY,
                "--lease-timeout",
                str(LEASE_S),
            )
        )
    nodes = {}
    for name, module in (("prefill-0", "prefill_node"), ("decode-0", "decode_node")):
        http_port = free_port()
        nodes[name] = f"http://{HOST}:{http_port}"
        procs.append(
            start(
                name,
                module,
                "--host",
                HOST,
                "--port",
                str(http_port),
                "--node-id",
                name,
                "--bootstrap-url",
                registries[0],
                "--bootstrap-url",
                registries[1],
                "--auth-token",
                TOKEN,
                "--max-total-tokens",
                "4096",
                "--lease-timeout",
                str(LEASE_S),
            )
        )
    try:
        wait_ready(procs, START_TIMEOUT_S)
        for api in apis:  # every replica sees both nodes
            wait_for(lambda api=api: http("GET", api + "/ready")[0] == 200, 60, f"{api}/ready")
        yield {"apis": apis, "nodes": nodes, "procs": procs}
    finally:
        for p in procs:
            p.stop(timeout=10)


def _ok(api: str) -> bool:
    status, body = http(
        "POST",
        api + "/v1/completions",
        {"model": "default", "prompt": "The tide comes in", "max_tokens": 4, "temperature": 0},
        token=API_KEY,
        timeout=30,
    )
    return status == 200 and body["usage"]["completion_tokens"] > 0


def test_both_replicas_serve_and_their_room_ids_never_collide(replicas):
    for api in replicas["apis"]:
        assert _ok(api)
    # Both gateways route onto the same two nodes; neither node holds anything after.
    for url in replicas["nodes"].values():
        wait_for(lambda url=url: metric(url, "pdserve_kv_pages_held") == 0, 10, "idle nodes")


def test_killing_one_replica_loses_only_its_streams(replicas):
    a, b = replicas["apis"]
    doomed = [Stream(a, f"Tell the story of ship {i}.", max_tokens=120).start() for i in range(3)]
    kept = [Stream(b, f"Tell the story of boat {i}.", max_tokens=40).start() for i in range(2)]
    wait_for(lambda: all(s.num_chunks >= 2 for s in doomed + kept), 120, "streams under way")
    decode = replicas["nodes"]["decode-0"]

    def aborted() -> float:
        try:
            return metric(decode, "pdserve_requests_total", outcome="aborted")
        except KeyError:
            return 0.0

    aborted_before = aborted()
    boot_a: Proc = replicas["procs"][0]
    boot_a.kill()
    # New requests through the live replica succeed at once.
    took = wait_for(lambda: _ok(b), 2.0 + 8.0, "a request through the live replica")
    # The decode node aborts the dead replica's streams once its gateway is not heard from.
    orphaned_s = wait_for(
        lambda: aborted() - aborted_before >= len(doomed),
        PAGES_BOUND_S + 3.0,
        "the dead replica's requests aborted",
    )
    orphaned_s += took
    outcomes = [s.wait(120) for s in kept]
    assert all(o.is_completed for o in outcomes), outcomes  # the live replica's streams
    for s in doomed:
        s.wait(30)
        assert not s.outcome.is_completed  # its gateway died under it
    for name, url in replicas["nodes"].items():
        wait_for(
            lambda url=url: metric(url, "pdserve_kv_pages_held") == 0, 30, f"{name} holds no page"
        )
    print(
        f"replica kill: first new request ok after {took:.2f} s, the dead replica's "
        f"requests aborted {orphaned_s:.2f} s after the kill (lease {LEASE_S:g} s)"
    )
    assert _ok(b)
