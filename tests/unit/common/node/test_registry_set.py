"""A node's registry links to every bootstrap replica (common/node/registry_set.py).

With fake clients' answers.
"""

from __future__ import annotations

import socket

from common import messages as msg
from common.node.registry_set import RegistrySet, expand_url

REGISTER = msg.RegisterNode(
    node_id="prefill-0",
    role="prefill",
    request_endpoint="tcp://127.0.0.1:1",
    control_endpoint="tcp://127.0.0.1:2",
    http_url="",
    backend="fake",
    backend_metadata=b"",
    kv_layout={},
    num_pages=8,
    max_running_requests=0,
    protocol_version=msg.PROTOCOL_VERSION,
    auth_token=None,
    instance_id="i1",
)


def test_a_name_with_several_addresses_is_one_replica_per_address(monkeypatch):
    def fake(host, port, type=0):  # noqa: A002 - socket.getaddrinfo's name
        assert host == "boot-registry" and port == 8998
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
            for ip in ("10.0.0.7", "10.0.0.5", "10.0.0.7")
        ]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    assert expand_url("http://boot-registry:8998") == [
        "http://10.0.0.5:8998",
        "http://10.0.0.7:8998",
    ]
    assert expand_url("http://127.0.0.1:8998") == ["http://127.0.0.1:8998"]
    assert expand_url("http://localhost:8998") == ["http://localhost:8998"]


def test_an_unresolvable_name_stays_as_given(monkeypatch):
    def fail(*_args, **_kw):
        raise socket.gaierror("no such name")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    assert expand_url("http://boot-registry:8998") == ["http://boot-registry:8998"]


def test_replicas_are_joined_and_left_as_the_name_resolves_and_answers_are_merged():
    answers = {"now": ["http://127.0.0.1:9", "http://127.0.0.1:10"]}
    regs = RegistrySet(
        ["http://boot:8998"], REGISTER, resolve=lambda url: answers["now"], resolve_interval_s=3600
    )
    regs._refresh()
    try:
        by_url = {c.url: c for c in regs.clients()}
        assert set(by_url) == set(answers["now"])
        a, b = by_url["http://127.0.0.1:9"], by_url["http://127.0.0.1:10"]
        assert not regs.is_registered
        # What each replica told us: its gateway and its node table.
        a.gateway_id, a.gateway_heard_at = "gw-a", 100.0
        b.gateway_id, b.gateway_heard_at = "gw-b", 100.0
        a._nodes = {"decode-0": {"id": "decode-0", "role": "decode"}}
        b._nodes = {"decode-1": {"id": "decode-1", "role": "decode"}}
        assert set(regs.peers()) == {"decode-0", "decode-1"}
        assert regs.peer("decode-1") == {"id": "decode-1", "role": "decode"}
        assert regs.is_gateway_alive("gw-a", 101.0) and regs.is_gateway_alive("gw-b", 101.0)
        assert not regs.is_gateway_alive("gw-c", 101.0)
        assert not regs.is_gateway_alive("gw-a", 100.0 + a.lease_s + 1)  # not heard lately
        assert regs.is_gateway_alive("", 0.0)  # requests without a gateway id
        # One replica leaves the Service: its client goes, and with it its gateway.
        answers["now"] = ["http://127.0.0.1:10"]
        regs._refresh()
        assert [c.url for c in regs.clients()] == ["http://127.0.0.1:10"]
        assert not regs.is_gateway_alive("gw-a", 101.0)
    finally:
        regs.stop(deregister=False)
