"""Gateway failures: bad input (400), token (401), full (429), no nodes (503), timeout (504),
client disconnect (AbortReq to both nodes), ReqFailed mid-stream, a node's lease running out."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from bootstrap import api_keys
from common import messages as msg
from common.node.registry_client import wait_until
from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.gateway import Gateway, fail_after, reply_ids, silent, stream_tokens

# The harness's fixtures, used here by name.
gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OK_MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def gw(tokenizer: Tokenizer) -> Iterator[Gateway]:
    """One gateway for the bad-input tests: none of their requests reaches a node."""
    gw = harness.start_gateway(tokenizer)
    gw.node("prefill")
    gw.node("decode", stream_tokens(reply_ids(tokenizer)))
    yield gw
    gw.stop()


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": OK_MESSAGES, "max_tokens": -1}, "max_tokens"),
    ({"messages": OK_MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"messages": OK_MESSAGES, "max_tokens": "ten"}, "max_tokens"),
    ({"messages": OK_MESSAGES, "max_tokens": 1.5}, "max_tokens"),
    ({"messages": OK_MESSAGES, "max_tokens": 10**6}, "messages"),
    ({"messages": OK_MESSAGES, "temperature": "hot"}, "temperature"),
    ({"messages": OK_MESSAGES, "temperature": -1}, "temperature"),
    ({"messages": OK_MESSAGES, "top_p": 0}, "top_p"),
    ({"messages": OK_MESSAGES, "top_k": -5}, "top_k"),
    ({"messages": OK_MESSAGES, "seed": -1}, "seed"),
    ({"messages": OK_MESSAGES, "stream": "yes"}, "stream"),
    ({"messages": OK_MESSAGES, "stop": 3}, "stop"),
    ({"messages": OK_MESSAGES, "n": 17}, "n"),
    ({"messages": OK_MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": OK_MESSAGES, "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"messages": OK_MESSAGES, "presence_penalty": -3}, "presence_penalty"),
    ({"messages": OK_MESSAGES, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": OK_MESSAGES, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ({"messages": OK_MESSAGES, "priority": "high"}, "priority"),
    ({"messages": OK_MESSAGES, "logit_bias": {"ten": 1}}, "logit_bias"),
    ({"messages": OK_MESSAGES, "logit_bias": {"10": 101}}, "logit_bias"),
    ({"messages": OK_MESSAGES, "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"messages": OK_MESSAGES, "logit_bias": {str(10**9): 1}}, "logit_bias"),
    ({"messages": OK_MESSAGES, "logit_bias": {"10": "x"}}, "logit_bias"),
    # Past what the nodes hold (int64): a 400 here, not a crashed node or a plain 500.
    ({"messages": OK_MESSAGES, "priority": 10**30}, "priority"),
    ({"messages": OK_MESSAGES, "top_k": 2**63}, "top_k"),
    ({"messages": OK_MESSAGES, "top_k": 2**64}, "top_k"),
    ({"messages": OK_MESSAGES, "max_tokens": 2**64}, "max_tokens"),
    ({"messages": OK_MESSAGES, "seed": 2**64}, "seed"),
    # A lone surrogate is no text: a 400, not a plain-text 500 that drops the connection.
    ({"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, "messages"),
    ({"messages": OK_MESSAGES, "stop": ["ok", "\ud800"]}, "stop"),
    ({"messages": OK_MESSAGES, "routing_key": "\ud83d"}, "routing_key"),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHAT)
def test_bad_chat_input_is_400_in_openai_shape(gw: Gateway, body: dict, param: str) -> None:
    assert_error(
        httpx.post(gw.api_url + CHAT, content=_escaped_json(body), headers=JSON), 400, param
    )


JSON = {"content-type": "application/json"}


def _escaped_json(body: Any) -> bytes:
    """JSON with every non-ASCII character escaped: lone surrogates travel as \\udXXX."""
    return json.dumps(body, ensure_ascii=True).encode()


def test_lone_surrogates_are_400_and_the_connection_serves_on(gw: Gateway) -> None:
    with httpx.Client(base_url=gw.api_url) as keep_alive:
        for path, body, param in (
            (COMPLETIONS, {"prompt": "a \ud800 b"}, "prompt"),
            (COMPLETIONS, {"prompt": "ok", "stop": "\udc00"}, "stop"),
            ("/generate", {"text": "\ud800"}, "text"),
            (
                "/generate",
                {"text": "ok", "sampling_params": {"stop": ["\ud800"]}},
                "sampling_params",
            ),
        ):
            assert_error(
                keep_alive.post(path, content=_escaped_json(body), headers=JSON), 400, param
            )
        # The same keep-alive connection still answers (it was reset after a plain 500).
        assert keep_alive.get("/health").status_code in (200, 503)


def test_more_bad_input(gw: Gateway, tokenizer: Tokenizer) -> None:
    url = gw.api_url
    assert_error(
        httpx.post(url + CHAT, content=b"{not json", headers={"content-type": "application/json"}),
        400,
    )
    long_prompt = "word " * 3000  # over the 2048-token context
    error = assert_error(httpx.post(url + COMPLETIONS, json={"prompt": long_prompt}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    assert_error(httpx.post(url + COMPLETIONS, json={"prompt": [1, -2]}), 400, "prompt")
    assert_error(httpx.post(url + COMPLETIONS, json={"prompt": [10**9]}), 400, "prompt")
    assert_error(httpx.post(url + COMPLETIONS, json={"prompt": ""}), 400, "prompt")
    assert_error(httpx.post(url + COMPLETIONS, json={"prompt": ["a"] * 65}), 400, "prompt")
    assert_error(httpx.post(url + "/generate", json={"sampling_params": {}}), 400, "text")
    assert_error(
        httpx.post(
            url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": "9"}}
        ),
        400,
        "max_new_tokens",
    )
    assert_error(httpx.post(url + "/generate", json={"text": "x", "input_ids": [1]}), 400)
    for field, value in (("top_k", 2**63), ("max_new_tokens", 2**64)):
        body = {"text": "x", "sampling_params": {field: value}}
        assert_error(httpx.post(url + "/generate", json=body), 400, field)
    assert_error(
        httpx.post(url + "/generate", json={"text": "x", "priority": 10**30}), 400, "priority"
    )
    # Nothing reached a node, and every rejection was counted.
    assert not gw.nodes[0].generates() and not gw.nodes[1].generates()
    # Unknown fields are tolerated.
    ok = httpx.post(url + CHAT, json={"messages": OK_MESSAGES, "max_tokens": 2, "foo": {"bar": 1}})
    assert ok.status_code == 200, ok.text


def test_api_keys_guard_the_api_and_the_cluster_token_guards_the_registry(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory(auth_token="s3cret", api_keys=("key-a", "key-b"))
    gw.node("prefill")
    gw.node("decode", stream_tokens(reply_ids(tokenizer)))
    for wrong in ("wrong", "s3cret"):  # the cluster token is not an API key
        c = openai.OpenAI(base_url=gw.api_url + "/v1", api_key=wrong, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model="test-model", messages=OK_MESSAGES)
    error = assert_error(httpx.post(gw.api_url + CHAT, json={"messages": OK_MESSAGES}), 401)
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
    assert_error(httpx.get(gw.api_url + "/v1/models"), 401)
    assert_error(httpx.get(gw.api_url + "/nodes"), 401)
    assert httpx.get(gw.api_url + "/health").status_code == 200
    for key in ("key-a", "key-b"):
        good = openai.OpenAI(base_url=gw.api_url + "/v1", api_key=key, max_retries=0)
        out = good.chat.completions.create(model="test-model", messages=OK_MESSAGES, max_tokens=3)
        assert out.choices[0].finish_reason == "length"
    # The registry wants the cluster token, never an API key.
    assert_error(httpx.get(gw.registry_url + "/nodes"), 401)
    bearer = {"Authorization": "Bearer key-a"}
    assert_error(httpx.get(gw.registry_url + "/nodes", headers=bearer), 401)
    ok = httpx.get(gw.registry_url + "/nodes", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and len(ok.json()["nodes"]) == 2


def test_api_key_file_rotates_without_a_restart(
    gateway_factory: Callable[..., Gateway],
    tokenizer: Tokenizer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(api_keys, "RELOAD_INTERVAL_S", 0.0)
    key_file = tmp_path / "keys"
    key_file.write_text("# clients\nold-key\n\n")
    gw = gateway_factory(api_key_file=str(key_file))
    models = gw.api_url + "/v1/models"

    def status(key: str) -> int:
        return httpx.get(models, headers={"Authorization": f"Bearer {key}"}).status_code

    assert (status("old-key"), status("new-key")) == (200, 401)
    key_file.write_text("old-key\nnew-key\n")
    os.utime(key_file, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime for sure
    assert (status("old-key"), status("new-key")) == (200, 200)
    key_file.write_text("new-key\n")
    os.utime(key_file, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert (status("old-key"), status("new-key")) == (401, 200)
    key_file.write_text("")  # a broken rotation keeps the last good keys
    os.utime(key_file, ns=(time.time_ns(), time.time_ns() + 3 * 10**9))
    assert (status("old-key"), status("new-key")) == (401, 200)


def test_no_nodes_is_503(gateway_factory: Callable[..., Gateway]) -> None:
    gw = gateway_factory()
    error = assert_error(httpx.post(gw.api_url + CHAT, json={"messages": OK_MESSAGES}), 503)
    assert error["code"] == "no_prefill_node"
    gw.node("prefill")
    error = assert_error(httpx.post(gw.api_url + CHAT, json={"messages": OK_MESSAGES}), 503)
    assert error["code"] == "no_decode_node"


def test_full_gateway_is_429(gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer) -> None:
    gw = gateway_factory(max_queued_requests=1)
    gw.node("prefill")
    gw.node("decode", stream_tokens(reply_ids(tokenizer)[:1], finish=False))  # never finishes
    with httpx.stream(
        "POST", gw.api_url + CHAT, json={"messages": OK_MESSAGES, "stream": True}
    ) as held:
        assert held.status_code == 200
        error = assert_error(httpx.post(gw.api_url + CHAT, json={"messages": OK_MESSAGES}), 429)
        assert error["type"] == "rate_limit_error"
    # The held request's client left: the slot frees.
    assert wait_until(lambda: gw.service.num_active == 0, 5)


def test_timeout_is_504_and_aborts_both_nodes(gateway_factory: Callable[..., Gateway]) -> None:
    gw = gateway_factory(request_timeout_s=0.5)
    prefill, decode = gw.node("prefill"), gw.node("decode", silent)
    t0 = time.monotonic()
    error = assert_error(httpx.post(gw.api_url + CHAT, json={"messages": OK_MESSAGES}), 504)
    assert error["type"] == "timeout_error" and time.monotonic() - t0 < 3
    room = decode.generates()[0].room
    assert wait_until(lambda: bool(prefill.aborts() and decode.aborts()), 5)
    assert prefill.aborts()[0].room == decode.aborts()[0].room == room


def test_client_disconnect_mid_stream_aborts_both_nodes(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory()
    prefill = gw.node("prefill")
    decode = gw.node("decode", stream_tokens(reply_ids(tokenizer)[:2], finish=False))
    c = openai.OpenAI(base_url=gw.api_url + "/v1", api_key="x", max_retries=0)
    stream = c.chat.completions.create(model="test-model", messages=OK_MESSAGES, stream=True)
    next(iter(stream))
    stream.close()
    assert wait_until(lambda: bool(prefill.aborts() and decode.aborts()), 5)
    (gen,) = decode.generates()
    for node in (prefill, decode):
        (abort,) = node.aborts()
        assert (abort.rid, abort.room) == (gen.rid, gen.room)
    assert wait_until(lambda: gw.service.num_active == 0, 5)
    assert 'outcome="aborted"' in httpx.get(gw.api_url + "/metrics").text


def test_client_gone_before_any_token_aborts_both_nodes(
    gateway_factory: Callable[..., Gateway],
) -> None:
    gw = gateway_factory()
    prefill, decode = gw.node("prefill"), gw.node("decode", silent)
    for stream in (False, True):
        with pytest.raises(httpx.ReadTimeout):
            body = {"messages": OK_MESSAGES, "stream": stream}
            httpx.post(gw.api_url + CHAT, json=body, timeout=0.5)
    assert wait_until(lambda: len(prefill.aborts()) == len(decode.aborts()) == 2, 5)
    assert [a.rid for a in decode.aborts()] == [g.rid for g in decode.generates()]
    assert wait_until(lambda: gw.service.num_active == 0, 5)


def test_req_failed_mid_stream_ends_with_an_error_event(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory()
    prefill = gw.node("prefill")
    gw.node("decode", fail_after(reply_ids(tokenizer)[:3]))
    with httpx.stream(
        "POST", gw.api_url + CHAT, json={"messages": OK_MESSAGES, "stream": True}
    ) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2] and "decode blew up" in lines[-2]
    # The official client raises on the error event.
    c = openai.OpenAI(base_url=gw.api_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="decode blew up"):
        list(c.chat.completions.create(model="test-model", messages=OK_MESSAGES, stream=True))
    assert wait_until(lambda: len(prefill.aborts()) == 2, 5)  # the other node frees the room


def test_req_failed_before_any_token_keeps_its_status(
    gateway_factory: Callable[..., Gateway],
) -> None:
    gw = gateway_factory()
    gw.node("prefill")
    gw.node("decode", fail_after([], status=400, error="prompt does not fit the KV pool"))
    for stream in (False, True):
        body = {"messages": OK_MESSAGES, "stream": stream}
        error = assert_error(httpx.post(gw.api_url + CHAT, json=body), 400)
        assert "KV pool" in error["message"]


def test_lost_node_fails_its_requests_fast(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory(lease_s=0.6, migration_limit=0)  # no migration: the error itself
    gw.node("prefill")
    decode = gw.node("decode", stream_tokens(reply_ids(tokenizer)[:1], finish=False))
    with httpx.stream(
        "POST", gw.api_url + CHAT, json={"messages": OK_MESSAGES, "stream": True}, timeout=10
    ) as r:
        decode.registry.stop(deregister=False)  # the node goes silent: its lease runs out
        t0 = time.monotonic()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - t0 < 3
    assert "lease expired" in lines[-2] and lines[-1] == "data: [DONE]"
    assert [n["role"] for n in httpx.get(gw.api_url + "/nodes").json()["nodes"]] == ["prefill"]


def test_losing_a_prefill_node_fails_only_requests_without_their_kv(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    """A streaming request has its KV on the decode node: its prefill node's loss spares it.
    One still waiting for its KV tries to migrate, and with no other prefill node gets a
    503 once --migration-timeout has passed."""
    import threading

    gw = gateway_factory(lease_s=0.6, migration_timeout_s=1.0)
    prefill = gw.node("prefill")
    ids = reply_ids(tokenizer)
    resume = threading.Event()

    def behave(gen: msg.GenerateReq, send: Any) -> None:
        if gen.sampling.get("max_new_tokens") != 5:
            return  # still waiting for its KV: no token yet
        send(msg.TokenChunk(rid=gen.rid, token_ids=[ids[0]], logprobs=None, top_logprobs=None))

        def rest() -> None:
            resume.wait(10)
            stream_tokens(ids[1:5])(gen, send)

        threading.Thread(target=rest, daemon=True).start()

    decode = gw.node("decode", behave)
    waiting: dict[str, Any] = {}

    def no_kv_yet() -> None:
        body = {"messages": OK_MESSAGES, "max_tokens": 7}
        waiting["r"] = httpx.post(gw.api_url + CHAT, json=body, timeout=10)

    with httpx.stream(
        "POST",
        gw.api_url + CHAT,
        timeout=10,
        json={"messages": OK_MESSAGES, "stream": True, "max_tokens": 5},
    ) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        other = threading.Thread(target=no_kv_yet)
        other.start()
        decode.wait_generates(2)
        prefill.registry.stop(deregister=False)  # the prefill node goes silent
        assert wait_until(
            lambda: (
                not any(
                    n["role"] == "prefill" for n in httpx.get(gw.api_url + "/nodes").json()["nodes"]
                )
            ),
            5,
        )
        resume.set()
        rest = [line for line in lines if line.startswith("data: ")]
    other.join(10)
    assert '"content"' in first and rest[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in rest), rest
    text = "".join(
        json.loads(x[6:])["choices"][0]["delta"].get("content") or ""
        for x in [first, *rest[:-1]]
        if json.loads(x[6:])["choices"]
    )
    assert text == tokenizer.decode(ids[:5])
    assert_error(waiting["r"], 503)


def test_a_body_over_the_limit_is_a_413_in_json(gateway_factory: Callable[..., Gateway]) -> None:
    limit = 1 << 20
    gw = gateway_factory(max_request_bytes=limit)
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * limit + b'"}]}'
    with httpx.Client(timeout=30) as c:
        error = assert_error(c.post(gw.api_url + CHAT, content=big), 413)
        assert "over" in error["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams
            for i in range(0, len(big), 1 << 20):
                yield big[i : i + (1 << 20)]

        error = assert_error(c.post(gw.api_url + CHAT, content=chunks()), 413)
        assert "over" in error["message"]
        assert c.get(gw.api_url + "/health").status_code == 200


def test_an_unexpected_error_is_a_json_500_and_the_connection_serves_on(
    gateway_factory: Callable[..., Gateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = gateway_factory()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gw.service, "admit", broken)
    with httpx.Client(timeout=10) as c:
        resp = c.post(gw.api_url + CHAT, json={"messages": OK_MESSAGES, "max_tokens": 2})
        error = assert_error(resp, 500)
        assert error["code"] == "internal" and "a bug" not in error["message"]
        assert c.get(gw.api_url + "/health").status_code == 200  # same keep-alive connection


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": OK_MESSAGES, "model": "m" * 257}, "model"),  # echoed in every chunk
        ({"messages": OK_MESSAGES, "routing_key": "k" * 1025}, "routing_key"),
        ({"messages": OK_MESSAGES, "stop": ["x"] * 65}, "stop"),
        ({"messages": OK_MESSAGES, "stop": ["x" * 1025]}, "stop"),
        ({"messages": OK_MESSAGES, "stop_token_ids": [1] * 1025}, "stop_token_ids"),
    ],
)
def test_what_would_cost_every_token_is_bounded(
    gw: Gateway, body: dict[str, Any], param: str
) -> None:
    error = assert_error(httpx.post(gw.api_url + CHAT, json=body), 400)
    assert error["param"] == param, error


def test_a_long_routing_key_header_is_a_400(gw: Gateway) -> None:
    resp = httpx.post(
        gw.api_url + CHAT, json={"messages": OK_MESSAGES}, headers={"x-routing-key": "k" * 1025}
    )
    assert assert_error(resp, 400)["param"] == "x-routing-key"


def test_cache_salt_reaches_the_nodes_and_is_bounded(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory()
    prefill = gw.node("prefill")
    gw.node("decode", stream_tokens(reply_ids(tokenizer)))
    for route, body in (
        (CHAT, {"messages": OK_MESSAGES, "max_tokens": 2, "cache_salt": "tenant-1"}),
        (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "cache_salt": "tenant-2"}),
        (
            "/generate",
            {"text": "Hi", "sampling_params": {"max_new_tokens": 2}, "cache_salt": "tenant-3"},
        ),
    ):
        assert httpx.post(gw.api_url + route, json=body, timeout=10).status_code == 200
    prefill.wait_generates(3)
    assert [g.cache_salt for g in prefill.generates()] == ["tenant-1", "tenant-2", "tenant-3"]
    body = {"messages": OK_MESSAGES, "cache_salt": "s" * 1025}
    assert assert_error(httpx.post(gw.api_url + CHAT, json=body), 400)["param"] == "cache_salt"
