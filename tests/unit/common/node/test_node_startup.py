"""Every node process's start-up (common/node/process.py): registration, READY line, close."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from common import messages as msg
from common.config import NodeConfig
from common.node.gateway_watch import GatewayWatch
from common.node.process import NodeArgs, NodeProcess, ServedNode
from common.ready import parse_ready


@pytest.fixture(autouse=True)
def keep_signal_handlers() -> Iterator[None]:
    """NodeProcess.run takes SIGTERM and SIGINT; give them back to pytest afterwards."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _runner() -> Any:
    layout = SimpleNamespace(to_dict=lambda: {"num_layers": 2})
    return SimpleNamespace(layout=layout, pool=SimpleNamespace(num_pages=64))


def _node(**config: Any) -> NodeArgs:
    return NodeArgs.from_config("prefill", NodeConfig(**config), "127.0.0.1", 0)


def test_node_args_resolve_the_configs_defaults() -> None:
    node = _node(advertise_host="10.0.0.7", request_port=5, drain_timeout_s=2.0)
    assert node.node_id.startswith("prefill-") and node.instance_id
    assert (node.advertise_host, node.request_port, node.drain_timeout_s) == ("10.0.0.7", 5, 2.0)
    assert _node().advertise_host == "127.0.0.1"  # --host
    assert _node(node_id="p0").node_id == "p0"


def test_registration_advertises_the_endpoints_peers_dial() -> None:
    process = NodeProcess(_node(node_id="p0", advertise_host="10.0.0.7"), lambda: False, dict)
    try:
        served = ServedNode(
            "p0.prefill",
            "prefill",
            "tcp://10.0.0.7:5",
            "tcp://127.0.0.1:6",
            4,
            dict,
            GatewayWatch(),
            kv_events_endpoint="tcp://127.0.0.1:7",
            colocated_with="p0.decode",
        )
        reg = process.registration(served, _runner(), "loopback", "t")
    finally:
        process.http.shutdown()
    assert isinstance(reg, msg.RegisterNode)
    assert (reg.control_endpoint, reg.kv_events_endpoint) == (
        "tcp://10.0.0.7:6",
        "tcp://10.0.0.7:7",
    )
    assert (reg.node_id, reg.role, reg.colocated_with, reg.max_running_requests) == (
        "p0.prefill",
        "prefill",
        "p0.decode",
        4,
    )
    assert (reg.backend, reg.auth_token, reg.num_pages, reg.kv_layout) == (
        "loopback",
        "t",
        64,
        {"num_layers": 2},
    )
    assert reg.instance_id == process.node.instance_id
    assert reg.http_url == process.http_url and reg.protocol_version == msg.PROTOCOL_VERSION
    plain = process.registration(
        ServedNode("p0", "prefill", "e", "tcp://h:1", 0, dict, GatewayWatch()),
        _runner(),
        "nixl",
        None,
    )
    assert plain.kv_events_endpoint == "" and plain.colocated_with == ""


def test_serve_announces_runs_until_stopped_and_closes(capsys: pytest.CaptureFixture[str]) -> None:
    steps: list[int] = []
    closed: list[str] = []
    holder: dict[str, NodeProcess] = {}

    def step() -> bool:
        steps.append(1)
        holder["process"].stopping.set()  # as SIGTERM would
        return False

    process = NodeProcess(_node(node_id="p0", drain_timeout_s=0.0), step, lambda: {"x": 1})
    holder["process"] = process
    watches = [GatewayWatch(), GatewayWatch()]
    halves = [
        ServedNode(
            "p0.prefill", "prefill", "tcp://127.0.0.1:5", "tcp://127.0.0.1:6", 0, dict, watches[0]
        ),
        ServedNode(
            "p0.decode", "decode", "tcp://127.0.0.1:8", "tcp://127.0.0.1:6", 0, dict, watches[1]
        ),
    ]
    process.serve(
        _runner(),
        halves,
        backend="loopback",
        auth_token=None,
        drain=lambda: True,
        on_drain_timeout=lambda: None,
        close=[lambda: closed.append("kv"), lambda: closed.append("events")],
        decode_node_id="p0.decode",
    )
    ready = parse_ready(capsys.readouterr().out)
    assert ready == {
        "role": "prefill",
        "node_id": "p0",
        "http_url": process.http_url,
        "request_endpoint": "tcp://127.0.0.1:5",
        "control_endpoint": "tcp://127.0.0.1:6",
        "decode_node_id": "p0.decode",
    }
    assert steps and closed == ["kv", "events"]
    assert process.registries == []  # standalone: no --bootstrap-url
    for watch in watches:
        assert watch.is_alive == process.is_gateway_alive
    assert process.health()["registered"] is True


def test_serve_closes_even_when_the_loop_fails() -> None:
    closed: list[str] = []

    def step() -> bool:
        raise RuntimeError("boom")

    process = NodeProcess(_node(), step, dict)
    served = ServedNode(
        "n", "decode", "tcp://127.0.0.1:5", "tcp://127.0.0.1:6", 0, dict, GatewayWatch()
    )
    with pytest.raises(RuntimeError, match="boom"):
        process.serve(
            _runner(),
            [served],
            backend="fake",
            auth_token=None,
            drain=lambda: True,
            on_drain_timeout=lambda: None,
            close=[lambda: closed.append("kv")],
        )
    process.http.shutdown()
    assert closed == ["kv"]
