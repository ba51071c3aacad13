"""The whole system on loopback for this package's tests: bootstrap, 2 prefill and 2 decode
processes, NIXL between them, started once for the package (its last module kills a decode
node)."""

from __future__ import annotations

import time

import pytest

from tests.integration.cluster.common import API_KEY, TOKEN
from tests.support.cluster import http, start, wait_ready
from tests.support.ports import free_port


@pytest.fixture(scope="package")
def cluster():
    pytest.importorskip("nixl._api", reason="NIXL is not installed")
    api, registry, reply = free_port(), free_port(), free_port()
    common = ["--auth-token", TOKEN, "--max-total-tokens", "6144", "--lease-timeout", "3"]
    boot = start(
        "bootstrap",
        "bootstrap",
        "--host",
        "127.0.0.1",
        "--port",
        str(api),
        "--disaggregation-bootstrap-port",
        str(registry),
        "--auth-token",
        TOKEN,
        "--api-key",
        API_KEY,
        "--reply-port",
        str(reply),
    )
    url = f"http://127.0.0.1:{registry}"
    nodes = [
        start(
            f"{role}-{i}",
            module,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--node-id",
            f"{role}-{i}",
            "--bootstrap-url",
            url,
            *common,
        )
        for role, module in (("prefill", "prefill_node"), ("decode", "decode_node"))
        for i in range(2)
    ]
    procs = [boot, *nodes]
    try:
        wait_ready(procs)
        deadline = time.monotonic() + 120
        while True:
            status, body = http("GET", f"http://127.0.0.1:{api}/nodes", token=API_KEY)
            healthy = [n for n in body.get("nodes", [])] if status == 200 else []
            if sum(1 for n in healthy if n.get("healthy")) == 4:
                break
            assert time.monotonic() < deadline, f"nodes never registered: {body}"
            time.sleep(0.2)
        yield {
            "api": f"http://127.0.0.1:{api}",
            "registry": url,
            "procs": procs,
            "reply_endpoint": f"tcp://127.0.0.1:{reply}",
            "nodes": {p.name: p for p in nodes},
        }
    finally:
        for p in procs:
            p.stop()
