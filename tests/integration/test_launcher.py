"""`pdserve launch` supervises its cluster: a killed node or gateway is started again while the
rest serve, and a cluster launched without --auth-token is closed all the same."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq

from common import messages as msg
from tests.support.launched import Launch, get_json, stop

pytestmark = pytest.mark.slow

RESTART_TIMEOUT_S = 120.0  # the registry lease (10 s) + a model load on a busy 2-core machine


@pytest.fixture(scope="module")
def launch() -> Iterator[Launch]:
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-launch-"))
    launch = Launch(workdir, "--num-decode", "2", "--max-total-tokens", "4096")
    try:
        launch.wait_up()
        yield launch
    finally:
        stop(launch.proc)
        shutil.rmtree(workdir, ignore_errors=True)


def _chat(api_port: int, text: str) -> int:
    """The status of one short chat request."""
    body = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": 6}
    req = urllib.request.Request(
        f"http://127.0.0.1:{api_port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _healthy(launch: Launch) -> set[str]:
    try:
        nodes = get_json(f"http://127.0.0.1:{launch.api_port}/nodes")["nodes"]
    except OSError:
        return set()
    return {n["id"] for n in nodes if n["healthy"]}


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def _metric(url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


ALL = {"prefill-0", "decode-0", "decode-1"}


def test_a_launched_cluster_is_closed_without_an_auth_token(launch: Launch) -> None:
    # The registry wants the token launch made up; the API (no --api-key) is open.
    with pytest.raises(urllib.error.HTTPError) as info:
        get_json(f"http://127.0.0.1:{launch.registry_port}/nodes")
    assert info.value.code == 401
    assert _chat(launch.api_port, "Hi") == 200
    # A stranger's GenerateReq on a node's request socket is refused at the handshake.
    node = next(
        n
        for n in get_json(f"http://127.0.0.1:{launch.api_port}/nodes")["nodes"]
        if n["id"] == "decode-0"
    )
    before = _metric(
        node["metrics_url"], "pdserve_unauthenticated_connections_total", socket="decode_requests"
    )
    ctx = zmq.Context()
    try:
        reply = ctx.socket(zmq.PULL)
        port = reply.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDTIMEO, 2000)
        push.connect(node["request_endpoint"])
        req = msg.GenerateReq(
            rid="stranger",
            room=1,
            input_ids=[1, 2, 3],
            sampling={"max_new_tokens": 4},
            priority=None,
            routing_key=None,
            prefill_node_id="prefill-0",
            decode_node_id="decode-0",
            reply_endpoint=f"tcp://127.0.0.1:{port}",
            arrival_time=time.time(),
            return_logprob=False,
        )
        try:
            push.send(msg.encode(req))
        except zmq.Again:
            pass  # the refused handshake left nowhere to queue it: refused all the same
        _wait(
            lambda: (
                _metric(
                    node["metrics_url"],
                    "pdserve_unauthenticated_connections_total",
                    socket="decode_requests",
                )
                > before
            ),
            20,
            "the refusal counted",
        )
        assert reply.poll(1000) == 0  # nothing came back
    finally:
        ctx.destroy(linger=0)


def test_a_killed_node_is_restarted_while_the_others_serve(launch: Launch) -> None:
    _wait(lambda: _healthy(launch) == ALL, 60, "every node healthy")
    old_pid = launch.children()["decode-1"]
    os.kill(old_pid, signal.SIGKILL)
    _wait(lambda: "decode-1" not in _healthy(launch), 30, "the gateway to drop decode-1")
    assert launch.proc.poll() is None, "launch stopped with its node"
    # decode-1 is down (or still loading): the other decode node serves every request.
    statuses = [_chat(launch.api_port, f"Count to {i}.") for i in range(3)]
    assert statuses == [200, 200, 200]
    _wait(lambda: _healthy(launch) == ALL, RESTART_TIMEOUT_S, "decode-1 back and healthy")
    assert launch.children()["decode-1"] != old_pid
    log = "\n".join(launch.log)
    assert "decode-1 exited (killed by SIGKILL)" in log and "restarting decode-1 (restart 1)" in log
    assert _chat(launch.api_port, "Hello again.") == 200


def test_a_killed_gateway_is_restarted_and_the_nodes_join_it(launch: Launch) -> None:
    _wait(lambda: _healthy(launch) == ALL, 60, "every node healthy")
    os.kill(launch.children()["bootstrap"], signal.SIGKILL)
    _wait(lambda: _healthy(launch) == ALL, RESTART_TIMEOUT_S, "the nodes registered again")
    assert _chat(launch.api_port, "Are you back?") == 200
    assert "bootstrap exited (killed by SIGKILL)" in "\n".join(launch.log)


def test_gpus_fewer_than_nodes_stop_launch_with_exit_2_before_any_process() -> None:
    # Two nodes, one GPU: refused at once, nothing started (no model load, no ports bound).
    done = subprocess.run(
        [sys.executable, "-m", "common.launch.cli", "launch", "--gpus", "0", "--num-decode", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "--gpus names 1 GPU for 2 nodes" in done.stderr
    assert "pdserve is up" not in done.stdout and "[bootstrap]" not in done.stdout
