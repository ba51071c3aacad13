"""A real prefill node process (SmolLM2, NIXL) feeding a KV receiver in another process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import zmq

from common import messages as msg
from common.ipc import bind_pull, recv_messages
from common.kv_pool import pages_needed
from common.ready import parse_ready
from tests.support.kv_node import NodeProcess, NodeSpec
from tests.support.tolerance import assert_close_scaled

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")

PAGE_FLOATS = 30 * 2 * 16 * 3 * 64


def start_node(module: str, *args: str, timeout: float = 120.0) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0", "--dtype", "float32", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    ready: dict = {}

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            info = parse_ready(line)
            if info is not None:
                ready.update(info)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready:
        assert proc.poll() is None, f"{module} exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{module} did not start"
        time.sleep(0.1)
    return proc, ready


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def cluster():
    proc, info = start_node("prefill_node", "--max-total-tokens", "4096", "--lease-timeout", "3")
    decode = NodeProcess(NodeSpec("decode", num_pages=128, lease_s=3.0))
    ctx = zmq.Context.instance()
    reply, reply_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    push = ctx.socket(zmq.PUSH)
    push.connect(info["request_endpoint"])
    yield proc, info, decode, push, reply, reply_endpoint
    push.close(0)
    decode.stop()
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def reference():
    from common.model.default_model import default_model_dir
    from common.model.runner import ExtendRequest, ModelRunner
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=2048)

    def run(ids: list[int]) -> tuple[np.ndarray, int]:
        pages = runner.pool.allocator.allocate(pages_needed(len(ids), 16))
        out = runner.extend([ExtendRequest(ids, 0, pages)])
        kv = runner.pool.buffer[pages].numpy().copy()
        runner.pool.allocator.free(pages)
        return kv, int(out.logits[0].argmax())

    return tok, run


def _submit(push, reply_endpoint, rid, room, ids):
    push.send(
        msg.encode(
            msg.GenerateReq(
                rid=rid,
                room=room,
                input_ids=ids,
                sampling={"max_new_tokens": 4, "temperature": 0.0},
                priority=None,
                routing_key=None,
                prefill_node_id="p",
                decode_node_id="d",
                reply_endpoint=reply_endpoint,
                arrival_time=time.time(),
                return_logprob=False,
            )
        )
    )


def _token_slots(page_bytes: bytes, n: int) -> np.ndarray:
    pages = np.frombuffer(page_bytes, dtype=np.float32).reshape(-1, 30, 2, 16, 3 * 64)
    return pages.transpose(1, 2, 0, 3, 4).reshape(30, 2, -1, 3 * 64)[:, :, :n]


def _transfer(cluster, rid, room, ids, dst):
    proc, info, decode, push, reply, reply_endpoint = cluster
    _submit(push, reply_endpoint, rid, room, ids)
    decode.call("create_receiver", room, info["control_endpoint"])
    decode.wait_state(room, ("WaitingForInput",), timeout=30)
    decode.call("send_metadata", room, dst)
    return decode.wait_state(room, ("Success", "Failed"), timeout=60)


def test_prompt_kv_and_first_token_land_exactly(cluster, reference):
    tok, run = reference
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the sea."}])
    dst = list(range(10, 10 + pages_needed(len(ids), 16)))
    state = _transfer(cluster, "r1", 101, ids, dst)
    assert state[0] == "Success", state
    kv, first = run(ids)
    decode = cluster[2]
    got = _token_slots(decode.call("pages", dst), len(ids))
    exp = _token_slots(kv.tobytes(), len(ids))
    assert_close_scaled(got, exp)
    assert decode.call("aux", 101)[0] == first


def test_shared_prefix_is_a_cache_hit_and_still_exact(cluster, reference):
    tok, run = reference
    system = "You are a meticulous assistant. " * 24
    ids = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Why is the sky blue?"}]
    )
    ids2 = tok.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": "Why is grass green?"}]
    )
    n = pages_needed(len(ids), 16)
    assert _transfer(cluster, "r2", 102, ids, list(range(40, 40 + n)))[0] == "Success"
    http = cluster[1]["http_url"]
    hits_before = _metric(http, "pdserve_prefix_cache_hit_tokens_total")
    dst = list(range(70, 70 + pages_needed(len(ids2), 16)))
    assert _transfer(cluster, "r3", 103, ids2, dst)[0] == "Success"
    assert _metric(http, "pdserve_prefix_cache_hit_tokens_total") - hits_before >= 144
    kv, first = run(ids2)
    got = _token_slots(cluster[2].call("pages", dst), len(ids2))
    assert_close_scaled(got, _token_slots(kv.tobytes(), len(ids2)))


def test_bad_prompt_gets_a_400_and_the_node_stays_healthy(cluster):
    proc, info, decode, push, reply, reply_endpoint = cluster
    _submit(push, reply_endpoint, "bad", 104, [])
    deadline = time.monotonic() + 10
    got: list = []
    while not got and time.monotonic() < deadline:
        got = [m for m in recv_messages(reply) if isinstance(m, msg.ReqFailed)]
        time.sleep(0.02)
    assert got and got[0].rid == "bad" and got[0].status == 400
    status, body = http_get(info["http_url"] + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_idle_node_holds_no_pages_and_stops_on_sigterm(cluster):
    proc, info = cluster[0], cluster[1]
    deadline = time.monotonic() + 10
    while _metric(info["http_url"], "pdserve_kv_pages_held") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0


def _metric(http_url: str, name: str) -> float:
    status, body = http_get(http_url + "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(name + "{") and 'role="prefill"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")
