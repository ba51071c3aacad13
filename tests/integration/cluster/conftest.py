"""The whole system on loopback for this package's tests: bootstrap, 2 prefill and 2 decode
processes, NIXL between them, started once for the package (its last module kills a decode
node)."""

from __future__ import annotations

import pytest

from tests.integration.cluster.common import API_KEY, TOKEN
from tests.support.cluster import start, start_bootstrap, wait_healthy, wait_ready
from tests.support.ports import free_port


@pytest.fixture(scope="package")
def cluster():
    pytest.importorskip("nixl._api", reason="NIXL is not installed")
    api, registry, reply = free_port(), free_port(), free_port()
    common = ["--auth-token", TOKEN, "--max-total-tokens", "6144", "--lease-timeout", "3"]
    boot = start_bootstrap(
        api, registry, "--auth-token", TOKEN, "--api-key", API_KEY, "--reply-port", str(reply)
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
        wait_healthy(f"http://127.0.0.1:{api}", 4, token=API_KEY)
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
