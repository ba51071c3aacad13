"""Registry: cluster token, protocol version, leases, 404 then re-register, the node table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from bootstrap.registry import NodeRegistry, RegistryError, bearer_token
from bootstrap.registry_app import build_registry_app
from common import messages as msg
from common.node.registry_client import wait_until
from tests.support import gateway as harness
from tests.support.gateway import Gateway
from tests.support.ports import free_port

# The harness's fixtures, used here by name.
gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer

TOKEN = "cluster-secret"


def register_msg(node_id: str = "p0", role: str = "prefill", **changes: object) -> msg.RegisterNode:
    base = msg.RegisterNode(
        node_id=node_id,
        role=role,
        request_endpoint="tcp://127.0.0.1:5000",
        control_endpoint="tcp://127.0.0.1:5001",
        http_url="http://127.0.0.1:30000/",
        backend="fake",
        backend_metadata=b"\x01\x02",
        kv_layout={"page_size": 16},
        num_pages=512,
        max_running_requests=8,
        protocol_version=msg.PROTOCOL_VERSION,
        auth_token=TOKEN,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- the table, with a fake clock --------------------------------------------------------------


def test_token_is_required_from_body_or_header() -> None:
    reg = NodeRegistry(TOKEN)
    for bad in (None, "nope"):
        with pytest.raises(RegistryError) as exc:
            reg.register(register_msg(auth_token=bad))
        assert exc.value.status == 401
    assert len(reg) == 0
    reg.register(register_msg(auth_token=None), header_token=TOKEN)
    reg.register(register_msg("p1"))
    assert len(reg) == 2
    assert bearer_token("Bearer abc") == "abc" and bearer_token("Basic abc") is None


def test_no_token_configured_accepts_anyone() -> None:
    reg = NodeRegistry(None)
    reg.register(register_msg(auth_token=None))
    assert [v.node_id for v in reg.views()] == ["p0"]


def test_protocol_version_and_role_are_checked() -> None:
    reg = NodeRegistry(TOKEN)
    with pytest.raises(RegistryError) as exc:
        reg.register(register_msg(protocol_version=msg.PROTOCOL_VERSION + 1))
    assert exc.value.status == 400 and "protocol version" in exc.value.message
    with pytest.raises(RegistryError) as exc:
        reg.register(register_msg(role="gateway"))
    assert exc.value.status == 400
    assert len(reg) == 0


def test_a_node_that_closed_its_connection_is_unreachable_until_it_is_heard_again() -> None:
    clock = Clock()
    reg = NodeRegistry(TOKEN, lease_s=10.0, clock=clock)
    reg.register(register_msg("p0"))
    reg.register(register_msg("d0", role="decode", request_endpoint="tcp://127.0.0.1:6000"))
    assert reg.mark_unreachable("tcp://127.0.0.1:6000") == ["d0"]
    assert reg.mark_unreachable("tcp://127.0.0.1:7777") == []
    views = {v.node_id: (v.is_healthy, v.is_reachable) for v in reg.views()}
    assert views == {"p0": (True, True), "d0": (False, False)}
    clock.now += 1.0
    reg.heartbeat(msg.Heartbeat(node_id="d0", load={}, auth_token=TOKEN))  # it was alive
    assert all(v.is_healthy and v.is_reachable for v in reg.views())


def test_lease_expiry_removes_the_node_and_tells_listeners() -> None:
    clock = Clock()
    reg = NodeRegistry(TOKEN, lease_s=10.0, clock=clock)
    lost: list[tuple[str, str]] = []
    reg.add_lost_listener(lambda node_id, reason: lost.append((node_id, reason)))
    reg.register(register_msg("p0"))
    reg.register(register_msg("d0", role="decode"))
    clock.now += 6
    reg.heartbeat(msg.Heartbeat(node_id="d0", load={"free_pages": 7}, auth_token=TOKEN))
    assert {v.node_id: v.is_healthy for v in reg.views()} == {"p0": True, "d0": True}
    clock.now += 1.0  # p0 silent for 7 s: over 2/3 of its lease, still registered
    assert {v.node_id: v.is_healthy for v in reg.views()} == {"p0": False, "d0": True}
    clock.now += 3.5
    assert reg.expire() == ["p0"]
    assert lost == [("p0", "node p0 lost: its lease expired")]
    assert [v.node_id for v in reg.views()] == ["d0"] and reg.views()[0].load == {"free_pages": 7}


def test_a_pause_of_the_registry_itself_does_not_count_against_the_leases() -> None:
    """The gateway's process was stopped for 5 s (past a 2 s lease): on resuming it must not
    drop every node (before: expire() removed both and admission answered 503). Leases run
    on again from there: a node that stays silent is dropped one lease of running time on."""
    clock = Clock()
    reg = NodeRegistry(TOKEN, lease_s=2.0, clock=clock, pause_after_s=1.0)
    lost: list[str] = []
    reg.add_lost_listener(lambda node_id, _: lost.append(node_id))
    reg.register(register_msg("p0"))
    reg.register(register_msg("d0", role="decode", request_endpoint="tcp://127.0.0.1:6000"))
    reg.mark_unreachable("tcp://127.0.0.1:6000")
    clock.now += 0.5
    assert reg.expire() == []
    clock.now += 5.0  # SIGSTOP ... SIGCONT: no call ran meanwhile
    assert reg.expire() == [] and lost == []
    assert {v.node_id: (v.is_healthy, v.is_reachable) for v in reg.views()} == {
        "p0": (True, True),
        "d0": (False, False),  # still unreachable: no heartbeat came after its disconnect
    }
    assert reg.paused_s == pytest.approx(5.0)
    for _ in range(3):  # running again, ticking every 0.5 s; only d0 beats
        clock.now += 0.5
        reg.heartbeat(msg.Heartbeat(node_id="d0", load={}, auth_token=TOKEN))
        assert reg.expire() == []
    assert {v.node_id: v.is_healthy for v in reg.views()} == {"p0": False, "d0": True}
    clock.now += 0.5  # p0: 2.5 s of running time without a beat
    assert reg.expire() == ["p0"] and lost == ["p0"]
    assert reg.paused_s == pytest.approx(5.0)


def test_without_pause_detection_a_long_silence_expires_every_node() -> None:
    clock = Clock()
    reg = NodeRegistry(TOKEN, lease_s=2.0, clock=clock)
    reg.register(register_msg("p0"))
    clock.now += 5.0
    assert reg.expire() == ["p0"] and reg.paused_s == 0.0
    with pytest.raises(ValueError):
        NodeRegistry(TOKEN, pause_after_s=0.0)


def test_heartbeat_of_unknown_node_is_404_and_deregister_is_not_a_loss() -> None:
    reg = NodeRegistry(TOKEN)
    lost: list[str] = []
    reg.add_lost_listener(lambda node_id, _: lost.append(node_id))
    with pytest.raises(RegistryError) as exc:
        reg.heartbeat(msg.Heartbeat(node_id="ghost", load={}, auth_token=TOKEN))
    assert exc.value.status == 404
    reg.register(register_msg())
    assert reg.deregister(msg.Deregister(node_id="p0", auth_token=TOKEN))
    assert not reg.deregister(msg.Deregister(node_id="p0", auth_token=TOKEN))
    assert lost == []
    reg.register(register_msg())
    reg.register(register_msg())  # the same process again (it lost our answer): no loss
    assert lost == []


# ---- the HTTP API -----------------------------------------------------------------------------


@pytest.fixture
def api() -> TestClient:
    return TestClient(build_registry_app(NodeRegistry(TOKEN, lease_s=7.5)))


def test_http_register_heartbeat_nodes(api: TestClient) -> None:
    r = api.post("/register", content=msg.encode_json(register_msg()))
    assert r.status_code == 200, r.text
    assert r.json()["lease_s"] == 7.5
    beat = msg.Heartbeat(node_id="p0", load={"waiting": 3, "free_pages": 100}, auth_token=TOKEN)
    r = api.post("/heartbeat", content=msg.encode_json(beat))
    assert r.status_code == 200
    (node,) = r.json()["nodes"]
    assert node["load"] == {"waiting": 3, "free_pages": 100}
    expected = {
        "id": "p0",
        "role": "prefill",
        "healthy": True,
        "metrics_url": "http://127.0.0.1:30000/metrics",
        "http_url": "http://127.0.0.1:30000",
        "request_endpoint": "tcp://127.0.0.1:5000",
        "control_endpoint": "tcp://127.0.0.1:5001",
        "num_pages": 512,
    }
    assert expected.items() <= node.items()
    assert node["backend_metadata"] == "AQI=" and "auth_token" not in node
    listed = api.get("/nodes", headers={"Authorization": f"Bearer {TOKEN}"}).json()["nodes"]
    assert [n["id"] for n in listed] == ["p0"]
    assert api.get("/nodes").status_code == 401
    assert api.post(
        "/deregister", content=msg.encode_json(msg.Deregister(node_id="p0", auth_token=TOKEN))
    ).json() == {"deregistered": True}


def test_http_refusals(api: TestClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = api.post("/register", content=msg.encode_json(register_msg(auth_token=None)))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_auth_token"
    r = api.post("/register", content=msg.encode_json(register_msg(protocol_version=99)))
    assert r.status_code == 400 and "protocol version 99" in r.json()["error"]["message"]
    r = api.post("/register", content=b'["register_node", {"node_id": 5}]', headers=auth)
    assert r.status_code == 400 and "malformed" in r.json()["error"]["message"]
    assert api.post("/register", content=b"garbage").status_code == 401  # no token: say nothing
    r = api.post(
        "/register", content=msg.encode_json(msg.Heartbeat(node_id="x", load={}, auth_token=TOKEN))
    )
    assert r.status_code == 400
    r = api.post(
        "/heartbeat",
        content=msg.encode_json(msg.Heartbeat(node_id="ghost", load={}, auth_token=TOKEN)),
    )
    assert r.status_code == 404
    assert api.get("/health").json()["status"] == "ok"


# ---- real nodes' client against a real server ------------------------------------------------


def test_node_reregisters_after_a_bootstrap_restart(
    gateway_factory: Callable[..., Gateway],
) -> None:
    port = free_port()
    first = gateway_factory(bootstrap_port=port, lease_s=0.6, auth_token=TOKEN)
    node = first.node("prefill")
    assert node.registry.lease_s == 0.6  # learnt from the answer: heartbeats every 0.2 s
    first.server.request_stop()
    first.thread.join(timeout=10)
    second = gateway_factory(bootstrap_port=port, lease_s=0.6, auth_token=TOKEN)
    # The first heartbeat to the new registry gets 404; the node registers again.
    assert wait_until(lambda: len(second.service.registry.views("prefill")) == 1, 10)
    node.stop()
    # Silent now: its lease runs out and it leaves the table.
    assert wait_until(lambda: len(second.service.registry) == 0, 5)


def test_a_second_instance_of_a_live_node_id_is_refused_until_its_lease_expires() -> None:
    clock = Clock()
    reg = NodeRegistry(TOKEN, lease_s=10.0, clock=clock)
    lost: list[str] = []
    reg.add_lost_listener(lambda node_id, _: lost.append(node_id))
    reg.register(register_msg(instance_id="real"))
    fake = register_msg(instance_id="fake", request_endpoint="tcp://10.9.9.9:1")
    with pytest.raises(RegistryError) as exc:
        reg.register(fake)  # valid token, live node id, another process: 409
    assert exc.value.status == 409 and exc.value.code == "node_id_in_use"
    assert reg.views()[0].request_endpoint == "tcp://127.0.0.1:5000"
    # The stranger can neither keep the entry alive nor remove it.
    with pytest.raises(RegistryError) as exc:
        reg.heartbeat(msg.Heartbeat(node_id="p0", load={}, auth_token=TOKEN, instance_id="fake"))
    assert exc.value.status == 409
    with pytest.raises(RegistryError) as exc:
        reg.deregister(msg.Deregister(node_id="p0", auth_token=TOKEN, instance_id="fake"))
    assert exc.value.status == 409
    clock.now += 5
    reg.heartbeat(msg.Heartbeat(node_id="p0", load={}, auth_token=TOKEN, instance_id="real"))
    clock.now += 9  # 14 s after registering, but the real one renewed 9 s ago
    with pytest.raises(RegistryError):
        reg.register(fake)
    clock.now += 1.5  # the real node fell silent past its lease: a restart takes over
    reg.register(register_msg(instance_id="restarted"))
    assert lost == ["p0"]  # what the old process held is gone
    assert reg.table()[0]["instance_id"] == "restarted"
