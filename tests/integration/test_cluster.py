"""The whole system on loopback: bootstrap, 2 prefill and 2 decode processes, NIXL between them."""

from __future__ import annotations

import http.client as http_client
import json
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from common import stages
from tests.support.cluster import Proc, http, metric, start, wait_ready
from tests.support.ports import free_port
from tests.support.waits import wait_for

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")
openai = pytest.importorskip("openai")

TOKEN = "test-cluster-token"  # the cluster's secret: registry and every zmq socket
API_KEY = "test-client-key"  # what clients send; never the cluster token
SYSTEM = "You are a terse assistant for a lighthouse keeper. Answer in one short sentence. " * 6


@pytest.fixture(scope="module")
def cluster():
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


def client(c) -> "openai.OpenAI":
    return openai.OpenAI(base_url=c["api"] + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_chat_and_completions_streaming_and_not_with_the_official_client(cluster):
    cl = client(cluster)
    chat = cl.chat.completions.create(
        model="default",
        max_tokens=12,
        temperature=0,
        messages=[{"role": "user", "content": "Say hello."}],
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens > 0
    pieces = [
        ch.choices[0].delta.content or ""
        for ch in cl.chat.completions.create(
            model="default",
            max_tokens=12,
            temperature=0,
            stream=True,
            messages=[{"role": "user", "content": "Say hello."}],
        )
        if ch.choices
    ]
    assert "".join(pieces) == chat.choices[0].message.content
    comp = cl.completions.create(
        model="default", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    streamed = "".join(
        ch.choices[0].text
        for ch in cl.completions.create(
            model="default",
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        if ch.choices
    )
    assert comp.choices[0].text and streamed == comp.choices[0].text


def test_greedy_output_equals_the_single_process_runner(cluster):
    from common.launch.offline import OfflineResult, generate_stream
    from common.model.default_model import default_model_dir
    from common.model.runner import ModelRunner
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=1024)
    messages = [{"role": "user", "content": "List three kinds of boats."}]
    ids = tok.apply_chat_template(messages)
    offline = [
        x
        for x in generate_stream(runner, tok, ids, SamplingParams(max_new_tokens=24, temperature=0))
    ][-1]
    assert isinstance(offline, OfflineResult)
    chat = client(cluster).chat.completions.create(
        model="default", max_tokens=24, temperature=0, messages=messages
    )
    assert chat.choices[0].message.content == offline.text


def _seen(url: str, name: str, **labels: str) -> float:
    """A metric's value, 0 while nothing has been observed (a labelled histogram is absent)."""
    try:
        return metric(url, name, **labels)
    except KeyError:
        return 0.0


def _stage_totals(url: str, stage_names: list[str]) -> dict[str, tuple[float, float]]:
    """(count, sum) of pdserve_request_stage_seconds per stage on one process."""
    return {
        name: (
            _seen(url, "pdserve_request_stage_seconds_count", stage=name),
            _seen(url, "pdserve_request_stage_seconds_sum", stage=name),
        )
        for name in stage_names
    }


def test_ttft_stages_are_recorded_and_add_up_to_the_ttft_the_client_saw(cluster):
    chain = [name for name, _, _ in stages.CHAIN]
    every = list(stages.STAGES)
    nodes = cluster["nodes"].values()
    before = _stage_totals(cluster["api"], every)
    ttft_before = _seen(cluster["api"], "pdserve_time_to_first_token_seconds_sum")
    node_before = [_stage_totals(p.ready["http_url"], every) for p in nodes]
    cl = client(cluster)
    start = time.perf_counter()
    stream = cl.completions.create(
        model="default",
        prompt="Tell me about tides. " * 40,
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    first = next(iter(stream))
    client_ttft = time.perf_counter() - start
    assert first.choices
    for _ in stream:
        pass
    after = _stage_totals(cluster["api"], every)
    seconds = {n: after[n][1] - before[n][1] for n in every}
    # The gateway saw the whole path once: every stage, none negative.
    assert {n: after[n][0] - before[n][0] for n in every} == dict.fromkeys(every, 1.0)
    assert all(v >= 0 for v in seconds.values()), seconds
    assert seconds["prefill_compute"] > 0 and seconds["kv_transfer"] > 0
    # The chain runs inside the client's own span and leaves little of it out: the
    # client's connection, request writing and response parsing (a few ms on loopback).
    total = sum(seconds[n] for n in chain)
    assert total <= client_ttft + 0.002, (total, client_ttft, seconds)
    assert total >= client_ttft - max(0.05, 0.15 * client_ttft), (total, client_ttft, seconds)
    # The gateway's TTFT is the same span the stages cut up.
    ttft = metric(cluster["api"], "pdserve_time_to_first_token_seconds_sum") - ttft_before
    assert abs(ttft - total) <= 1e-3, (ttft, total)
    # Each node recorded its own view of its stages, on the same metric.
    grown = {
        n: sum(
            _stage_totals(p.ready["http_url"], every)[n][0] - b[n][0]
            for p, b in zip(nodes, node_before)
        )
        for n in every
    }
    for name, _, _ in stages.PREFILL_STAGES + stages.DECODE_STAGES:
        assert grown[name] == 1.0, (name, grown)


def test_usage_reports_the_prompt_tokens_served_from_the_prefill_cache(cluster):
    cl = client(cluster)
    messages = [
        {"role": "system", "content": SYSTEM + " Cache check " + str(time.time())},
        {"role": "user", "content": "Name one bird."},
    ]
    usages = [
        cl.chat.completions.create(
            model="default",
            max_tokens=2,
            temperature=0,
            messages=messages,
            extra_headers={"x-routing-key": "cache-usage"},
        ).usage
        for _ in range(2)
    ]
    first, second = usages
    assert first.prompt_tokens == second.prompt_tokens
    assert first.prompt_tokens_details.cached_tokens == 0
    # The second found the whole pages of the first's prompt (less its last token) cached.
    page = 16
    assert second.prompt_tokens_details.cached_tokens == (first.prompt_tokens - 1) // page * page


def test_precise_routing_sends_a_tenant_back_to_the_node_that_caches_its_context(cluster):
    """Tenants share their first 32 tokens (one affinity key) but not their contexts: the
    KV events tell the gateway which prefill node holds each context. Round one arrives at
    once, so the queued work spreads it over both nodes; in round two affinity would send
    every tenant to the key's one home node, precise routing sends each where it is cached."""
    rng = random.Random(16)
    header = [rng.randrange(100, 49000) for _ in range(32)]
    contexts = [header + [rng.randrange(100, 49000) for _ in range(320)] for _ in range(6)]
    nodes = [cluster["nodes"][f"prefill-{i}"].ready["http_url"] for i in range(2)]
    before = [metric(u, "pdserve_prompt_tokens_total") for u in nodes]
    index_before = metric(cluster["api"], "pdserve_kv_index_pages")
    url = cluster["api"] + "/v1/completions"
    results: list[tuple[int, dict]] = []
    threads = [
        threading.Thread(target=lambda ids=ids: results.append(_completion(url, ids + [7, 8, 9])))
        for ids in contexts
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [status for status, _ in results] == [200] * 6, results
    grown = [metric(u, "pdserve_prompt_tokens_total") - b for u, b in zip(nodes, before)]
    assert all(g >= 355 for g in grown), grown  # both nodes took tenants
    deadline = time.monotonic() + 15  # the events reach the gateway's index
    while metric(cluster["api"], "pdserve_kv_index_pages") < index_before + 6 * 20:
        assert time.monotonic() < deadline, "the KV index never learned the contexts"
        time.sleep(0.2)
    hits_before = metric(cluster["api"], "pdserve_router_decisions_total", decision="cache")
    for ids in contexts:  # one at a time: nothing queued, only the cache decides
        status, body = _completion(url, ids + [11, 12, 13])
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 352, body["usage"]
    hits = metric(cluster["api"], "pdserve_router_decisions_total", decision="cache")
    assert hits - hits_before == len(contexts)


def _completion(url: str, ids: list[int]) -> tuple[int, dict]:
    req = urllib.request.Request(
        url,
        method="POST",
        data=json.dumps(
            {"model": "default", "prompt": ids, "max_tokens": 1, "temperature": 0}
        ).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def test_64_concurrent_streams_all_complete(cluster):
    cl = client(cluster)
    results: list[str | Exception] = []

    def one(i: int) -> None:
        try:
            text = "".join(
                ch.choices[0].text
                for ch in cl.completions.create(
                    model="default",
                    prompt=f"Number {i} is",
                    max_tokens=6,
                    temperature=0,
                    stream=True,
                )
                if ch.choices
            )
            results.append(text)
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            results.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    errors = [r for r in results if isinstance(r, Exception)]
    assert len(results) == 64 and not errors, errors[:3]


def test_requests_sharing_a_system_prompt_land_on_the_same_prefill_node(cluster):
    nodes = cluster["nodes"]
    before = {
        n: metric(nodes[n].ready["http_url"], "pdserve_prompt_tokens_total")
        for n in ("prefill-0", "prefill-1")
    }
    cl = client(cluster)
    for q in (
        "Is the lamp lit?",
        "How high is the tower?",
        "When is the next storm?",
        "Any ships?",
    ):
        cl.chat.completions.create(
            model="default",
            max_tokens=2,
            temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        )
    grew = [
        n
        for n in before
        if metric(nodes[n].ready["http_url"], "pdserve_prompt_tokens_total") > before[n]
    ]
    assert len(grew) == 1, grew


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
            _metric_or_0(url, "pdserve_malformed_messages_total", socket=socket_name),
            _metric_or_0(url, "pdserve_unauthenticated_connections_total", socket=socket_name),
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


def _metric_or_0(http_url: str, name: str, **labels: str) -> float:
    try:
        return metric(http_url, name, **labels)
    except KeyError:  # a counter with labels is exported from its first increment on
        return 0.0


def msg_abort() -> bytes:
    from common import messages as msg

    return msg.encode(msg.AbortReq(node_id="stranger", room=1, rid="stranger", reason="fuzz"))


def _host_port(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def test_killing_a_decode_node_mid_stream_migrates_its_streams(cluster):
    """Six streams over two decode nodes; one node is killed (SIGKILL) mid-stream. Its
    streams move to the other pair with their output so far: every client gets its whole
    answer without an error event, and the gateway counts each move."""
    cl = client(cluster)
    outcomes: dict[int, str] = {}
    texts = [""] * 6
    chunks = [0] * 6

    def one(i: int) -> None:
        try:
            for ch in cl.completions.create(
                model="default", prompt=f"Story {i}:", max_tokens=200, temperature=0, stream=True
            ):
                chunks[i] += 1
                texts[i] += ch.choices[0].text if ch.choices else ""
                if ch.choices and ch.choices[0].finish_reason:
                    outcomes[i] = f"ok {ch.choices[0].finish_reason}"
        except Exception as exc:  # noqa: BLE001
            outcomes[i] = f"error {type(exc).__name__}: {exc}"

    migrated_before = _metric_or_0(cluster["api"], "pdserve_migrations_total")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    # Every stream is decoding (a token each) before the victim dies.
    wait_for(lambda: all(chunks), 120, "a first token on every stream")
    victim: Proc = cluster["nodes"]["decode-1"]
    victim.kill()
    for t in threads:
        t.join(300)
    assert sorted(outcomes) == list(range(6)), outcomes
    assert all(v.startswith("ok") for v in outcomes.values()), outcomes
    # Least-load decode choice spreads six concurrent requests over both decode nodes,
    # so the victim held at least one of them.
    assert _metric_or_0(cluster["api"], "pdserve_migrations_total") > migrated_before
    for i, text in enumerate(texts):
        whole = cl.completions.create(
            model="default", prompt=f"Story {i}:", max_tokens=200, temperature=0
        )
        # No token twice, none missing: the unfaulted answer (float32 greedy).
        assert text == whole.choices[0].text, (i, text)


def test_no_node_holds_a_page_when_idle(cluster):
    deadline = time.monotonic() + 30
    for name, p in cluster["nodes"].items():
        if p.popen.poll() is not None:
            continue
        while metric(p.ready["http_url"], "pdserve_kv_pages_held") != 0:
            assert time.monotonic() < deadline, f"{name} still holds pages"
            time.sleep(0.2)
