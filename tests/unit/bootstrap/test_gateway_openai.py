"""The gateway served live, driven by the official openai client, with fake prefill/decode nodes."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from common import messages as msg
from common.node.registry_client import wait_until
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.gateway import REPLY_TEXT, Gateway, reply_ids, stream_tokens

# The harness's fixtures, used here by name.
gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
]


@pytest.fixture
def gw(gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer) -> Gateway:
    gw = gateway_factory()
    gw.node("prefill")
    gw.node("decode", stream_tokens(reply_ids(tokenizer)))
    return gw


def client(gw: Gateway, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.api_url + "/v1", api_key=api_key, max_retries=0, timeout=10)


def test_chat_non_streaming(gw: Gateway, tokenizer: Tokenizer) -> None:
    out = client(gw).chat.completions.create(
        model="test-model", messages=MESSAGES, max_tokens=100, temperature=0, seed=7
    )
    assert out.choices[0].message.content == REPLY_TEXT
    assert out.choices[0].finish_reason == "stop"
    prompt_ids = tokenizer.apply_chat_template([dict(m) for m in MESSAGES])
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(reply_ids(tokenizer))
    # Both nodes got the same GenerateReq: same rid and room, the chosen pair, our reply socket.
    prefill, decode = gw.nodes
    (p,), (d,) = prefill.wait_generates(1), decode.wait_generates(1)
    assert p == d
    assert p.input_ids == prompt_ids
    assert (p.prefill_node_id, p.decode_node_id) == (prefill.node_id, decode.node_id)
    assert p.reply_endpoint == gw.service.dispatcher.reply_endpoint
    sampling = SamplingParams.from_wire(p.sampling)
    assert (sampling.max_new_tokens, sampling.temperature, sampling.seed) == (100, 0.0, 7)
    assert 0 < p.room < 2**63


def test_chat_streaming_arrives_token_by_token(gw: Gateway, tokenizer: Tokenizer) -> None:
    stream = client(gw).chat.completions.create(
        model="test-model", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY_TEXT
    assert chunks[0].choices[0].delta.role == "assistant"
    # (test_gateway_offloop: tokens spaced in time arrive one event each; ones queued
    # together share an event)
    assert any(c.choices and c.choices[0].delta.content for c in chunks)
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["stop"]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(reply_ids(tokenizer))


def test_completions_non_streaming_and_max_tokens(gw: Gateway, tokenizer: Tokenizer) -> None:
    out = client(gw).completions.create(model="test-model", prompt="Once upon a time", max_tokens=4)
    expected = tokenizer.decode(reply_ids(tokenizer)[:4])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.prompt_tokens == len(
        tokenizer.encode("Once upon a time")
    )


def test_completions_streaming_with_token_prompt(gw: Gateway) -> None:
    stream = client(gw).completions.create(model="test-model", prompt=[1, 2, 3, 4], stream=True)
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert REPLY_TEXT.startswith(text) and len(text) > 0  # default max_tokens is 16
    assert gw.nodes[0].wait_generates(1)[0].input_ids == [1, 2, 3, 4]


def test_stop_string_is_cut_at_the_gateway(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory()
    prefill = gw.node("prefill")
    decode = gw.node("decode", stream_tokens(reply_ids(tokenizer), delay_s=0.02, finish=False))
    out = client(gw).chat.completions.create(
        model="test-model", messages=MESSAGES, stop=[" one token"]
    )
    assert out.choices[0].message.content == REPLY_TEXT.split(" one token")[0]
    assert out.choices[0].finish_reason == "stop"
    # The gateway matched the stop string first, so it tells both nodes to free the room.
    room = decode.generates()[0].room
    assert wait_until(lambda: len(decode.aborts()) == 1 and len(prefill.aborts()) == 1, 5)
    assert decode.aborts()[0].room == room


def test_chat_logprobs(gw: Gateway) -> None:
    out = client(gw).chat.completions.create(
        model="test-model", messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=2
    )
    assert gw.nodes[0].wait_generates(1)[0].return_logprob is True
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert content[0].logprob == -0.5 and len(content[0].top_logprobs) == 2


def test_logit_bias_reaches_both_nodes_as_id_bias_pairs(gw: Gateway) -> None:
    client(gw).chat.completions.create(
        model="test-model", messages=MESSAGES, max_tokens=2, logit_bias={"42": -100, "7": 2.5}
    )
    for node in gw.nodes:
        (g,) = node.generates()
        assert SamplingParams.from_wire(g.sampling).logit_bias == ((42, -100.0), (7, 2.5))


def test_routing_key_header_and_priority_reach_both_nodes(gw: Gateway) -> None:
    client(gw).chat.completions.create(
        model="test-model",
        messages=MESSAGES,
        max_tokens=2,
        extra_headers={"x-routing-key": "tenant-a"},
        extra_body={"priority": 5},
    )
    for node in gw.nodes:
        (g,) = node.wait_generates(1)
        assert (g.routing_key, g.priority) == ("tenant-a", 5)


def test_generate_native_shape(gw: Gateway, tokenizer: Tokenizer) -> None:
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    r = httpx.post(gw.api_url + "/generate", json=body, timeout=10)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == reply_ids(tokenizer)[:5]
    assert out["text"] == tokenizer.decode(reply_ids(tokenizer)[:5])
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["completion_tokens"] == 5
    with httpx.stream(
        "POST", gw.api_url + "/generate", json={**body, "stream": True}, timeout=10
    ) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"


def test_models_nodes_health_metrics_openapi(gw: Gateway) -> None:
    models = client(gw).models.list()
    assert [m.id for m in models.data] == ["test-model"]
    nodes = httpx.get(gw.api_url + "/nodes").json()["nodes"]
    assert sorted(n["role"] for n in nodes) == ["decode", "prefill"]
    assert all(n["healthy"] for n in nodes)
    assert httpx.get(gw.api_url + "/health").json()["num_decode_nodes"] == 1
    with client(gw).chat.completions.create(
        model="test-model", messages=MESSAGES, stream=True
    ) as s:
        list(s)
    text = httpx.get(gw.api_url + "/metrics").text
    for name in (
        "pdserve_time_to_first_token_seconds",
        "pdserve_e2e_request_latency_seconds",
        "pdserve_requests_total",
        "pdserve_router_decisions_total",
    ):
        assert name in text
    paths = httpx.get(gw.api_url + "/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/completions", "/generate", "/v1/models"} <= set(paths)


def test_prefix_affinity_sends_a_shared_system_prompt_to_one_prefill(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory()
    prefills = [gw.node("prefill", node_id=f"p{i}") for i in range(3)]
    gw.node("decode", stream_tokens(reply_ids(tokenizer)[:2]))
    system: ChatCompletionMessageParam = {
        "role": "system",
        "content": "You are a meticulous assistant. " * 8,
    }
    c = client(gw)
    for i in range(6):  # sequential: no load, so affinity alone decides
        c.chat.completions.create(
            model="test-model", messages=[system, {"role": "user", "content": f"question {i}"}]
        )
    assert wait_until(lambda: sum(len(p.generates()) for p in prefills) == 6, 5)
    used = [p for p in prefills if p.generates()]
    assert len(used) == 1 and len(used[0].generates()) == 6
    metrics_text = httpx.get(gw.api_url + "/metrics").text
    assert "pdserve_prefix_affinity_hits_total" in metrics_text
    assert all(isinstance(m, msg.GenerateReq) for m in used[0].generates())
