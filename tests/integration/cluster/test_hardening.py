"""Who may talk to the cluster and what bad input does: tokens, OpenAI-style errors, hostile
bodies and frames."""

from __future__ import annotations

import http.client as http_client
import json
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from tests.integration.cluster.common import API_KEY, TOKEN, client, metric_or_0
from tests.support.cluster import http, metric

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")
pytest.importorskip("openai")


def test_a_node_without_the_token_cannot_register(cluster):
    status, _ = http("POST", cluster["registry"] + "/register", {"bogus": True})
    assert status in (400, 401)
    from common import messages as msg

    rogue = msg.RegisterNode(
        node_id="rogue",
        role="prefill",
        request_endpoint="tcp://127.0.0.1:9",
        control_endpoint="tcp://127.0.0.1:9",
        http_url="http://127.0.0.1:9",
        backend="nixl",
        backend_metadata=b"",
        kv_layout={},
        num_pages=1,
        max_running_requests=1,
        protocol_version=msg.PROTOCOL_VERSION,
        auth_token="wrong",
    )
    status, _ = http("POST", cluster["registry"] + "/register", msg.to_jsonable(rogue))
    assert status == 401
    _, body = http("GET", cluster["api"] + "/nodes", token=API_KEY)
    assert "rogue" not in {n["id"] for n in body["nodes"]}
    status, _ = http("GET", cluster["api"] + "/v1/models")
    assert status == 401


def test_bad_inputs_get_openai_style_errors(cluster):
    api = cluster["api"] + "/v1/chat/completions"
    cases = [
        ({"model": "default", "messages": []}, 400),
        (
            {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
            400,
        ),
        ({"model": "default", "messages": "hi"}, 400),
        ({"model": "default", "messages": [{"role": "user", "content": "hi " * 9000}]}, 400),
    ]
    for body, expect in cases:
        status, resp = http("POST", api, body, token=API_KEY)
        assert status == expect, (body, status, resp)
        assert isinstance(resp, dict) and "message" in resp["error"]


# ---- fuzzing (before the kill test: every node must still be there) -----------------------

FUZZ_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
FUZZ_EXAMPLES_PER_ROUTE = 10


def _greedy(cluster) -> list[str]:
    cl = client(cluster)
    return [
        cl.completions.create(model="default", prompt=p, max_tokens=8, temperature=0)
        .choices[0]
        .text
        for p in ("The capital of France is", "1, 2, 3,")
    ]


def _all_idle_and_healthy(cluster) -> None:
    deadline = time.monotonic() + 30
    for name, p in cluster["nodes"].items():
        assert p.popen.poll() is None, f"{name} died"
        status, body = http("GET", p.ready["http_url"] + "/health")
        assert status == 200 and body["status"] == "ok", (name, body)
        while metric(p.ready["http_url"], "pdserve_kv_pages_held") != 0:
            assert time.monotonic() < deadline, f"{name} still holds pages"
            time.sleep(0.2)
    status, body = http("GET", cluster["api"] + "/health")
    assert status == 200 and body["num_requests"] == 0, body


def test_hostile_api_bodies_never_5xx_and_leave_nothing_held(cluster):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.support import hostile

    before = _greedy(cluster)
    seen: dict[int, int] = {}
    conn_box: list[http_client.HTTPConnection] = []

    def post(route: str, data: bytes, stream: bool) -> int:
        # One keep-alive connection for every example: an error must not cost it.
        if not conn_box:
            conn_box.append(http_client.HTTPConnection(*_host_port(cluster["api"]), timeout=120))
        conn = conn_box[0]
        conn.request(
            "POST",
            route,
            data,
            {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
        )
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            error = json.loads(raw)["error"]  # JSON in OpenAI's shape, whatever went wrong
            assert isinstance(error["message"], str) and error["type"], raw
        elif stream:
            assert raw.rstrip().endswith(b"data: [DONE]") or b'"finish_reason"' in raw, raw[-200:]
        return resp.status

    @settings(
        max_examples=FUZZ_EXAMPLES_PER_ROUTE * len(FUZZ_ROUTES),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.sampled_from(FUZZ_ROUTES).flatmap(
            lambda r: st.tuples(st.just(r), hostile.hostile_body(r))
        )
    )
    def one(case) -> None:
        route, body = case
        status = post(route, hostile.body_bytes(body), body.get("stream") is True)
        assert status < 500, (route, body, status)
        seen[status] = seen.get(status, 0) + 1

    one()
    for raw in (b"\xff\xfe{", b'{"messages": [' * 5000, b"", b"null", b'"text"', b"[]"):
        status = post("/v1/chat/completions", raw, False)
        assert status == 400, (raw[:40], status)
    conn_box[0].close()
    print(f"hostile API bodies by status: {seen}")
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen  # both served and refused
    _all_idle_and_healthy(cluster)
    assert _greedy(cluster) == before  # nothing it did changed what the model says


def test_internal_sockets_survive_bad_and_unauthenticated_frames(cluster):
    import zmq

    from common.socket_auth import ClusterKeys, SocketSecurity
    from tests.support import hostile

    _, body = http("GET", cluster["api"] + "/nodes", token=API_KEY)
    targets = {f"{n['id']}/requests": n["request_endpoint"] for n in body["nodes"]}
    targets |= {f"{n['id']}/control": n["control_endpoint"] for n in body["nodes"]}
    targets["bootstrap/replies"] = cluster["reply_endpoint"]
    before = _greedy(cluster)
    frames = hostile.bad_frames()
    member = SocketSecurity(ClusterKeys.from_token(TOKEN))
    ctx = zmq.Context()
    try:
        for endpoint in targets.values():
            stranger = ctx.socket(zmq.PUSH)  # no CURVE: refused at the handshake
            stranger.setsockopt(zmq.SNDTIMEO, 2000)
            stranger.connect(endpoint)
            try:
                stranger.send(msg_abort())
            except zmq.Again:
                pass  # the refused handshake left nowhere to queue it
            inside = ctx.socket(zmq.PUSH)  # holds the cluster keys: its frames are decoded
            inside.setsockopt(zmq.SNDTIMEO, 10_000)
            member.secure_client(inside)
            inside.connect(endpoint)
            for batch in frames.values():
                for frame in batch:
                    inside.send(frame)
            inside.send_multipart([b"two", b"frames"])
            inside.send(b"\x00" * ((64 << 20) + 1))  # past the frame limit: the link is dropped
            time.sleep(0.2)
            for s in (stranger, inside):
                s.close(linger=500)
    finally:
        ctx.destroy(linger=0)

    def counted(target: str) -> tuple[float, float]:
        name, kind = target.split("/")
        role = name.split("-")[0]
        url = cluster["api"] if role == "bootstrap" else cluster["nodes"][name].ready["http_url"]
        socket_name = {
            "requests": f"{role}_requests",
            "control": f"{role}_kv_control",
            "replies": "gateway_replies",
        }[kind]
        return (
            metric_or_0(url, "pdserve_malformed_messages_total", socket=socket_name),
            metric_or_0(url, "pdserve_unauthenticated_connections_total", socket=socket_name),
        )

    num_bad = sum(len(batch) for batch in frames.values()) + 1  # + the two-frame message
    deadline = time.monotonic() + 30
    for target in targets:
        while True:
            malformed, refused = counted(target)
            if malformed >= num_bad and refused >= 1:
                break
            assert time.monotonic() < deadline, (target, malformed, num_bad, refused)
            time.sleep(0.2)
    _all_idle_and_healthy(cluster)
    assert _greedy(cluster) == before


def msg_abort() -> bytes:
    from common import messages as msg

    return msg.encode(msg.AbortReq(node_id="stranger", room=1, rid="stranger", reason="fuzz"))


def _host_port(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80
