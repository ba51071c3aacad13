"""The model a request names: the served one or "default" is served, any other is a 404."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.gateway import Gateway, reply_ids, stream_tokens

gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer
SERVED = "test-model"  # the harness's served model name


def test_models_list_and_lookup_answer_like_openai(gateway_factory: Callable[..., Gateway]) -> None:
    gw = gateway_factory()
    c = openai.OpenAI(base_url=gw.api_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in c.models.list()] == [SERVED]
    card = c.models.retrieve(SERVED)
    assert (card.id, card.object, card.owned_by) == (SERVED, "model", "pdserve")
    assert c.models.retrieve("default").id == SERVED
    with pytest.raises(openai.NotFoundError) as info:
        c.models.retrieve("gpt-4o")
    error = info.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found" and error["param"] == "model"


def test_requests_for_another_model_are_a_404_and_reach_no_node(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory()
    gw.node("prefill")
    decode = gw.node("decode", stream_tokens(reply_ids(tokenizer)))
    url = gw.api_url
    messages = [{"role": "user", "content": "Hi"}]
    for route, body in (
        ("/v1/chat/completions", {"messages": messages}),
        ("/v1/completions", {"prompt": "Hi"}),
    ):
        r = httpx.post(url + route, json={**body, "model": "llama-70b", "max_tokens": 2})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "model_not_found"
        assert SERVED in r.json()["error"]["message"]
        for name in (SERVED, "default", None):
            named = {"model": name} if name is not None else {}
            r = httpx.post(url + route, json={**body, **named, "max_tokens": 2}, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == SERVED  # the served id is echoed, not the alias
    assert len(decode.wait_generates(6)) == 6  # the 404s never left the gateway


UNSERVED = [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("response_format", {"type": "xml"}),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "x"}),
]
NEUTRAL = {
    "tools": [],
    "tool_choice": "none",
    "function_call": "none",
    "response_format": {"type": "text"},
    "modalities": ["text"],
}


def test_fields_that_would_change_the_output_are_a_400_not_ignored(
    gateway_factory: Callable[..., Gateway], tokenizer: Tokenizer
) -> None:
    gw = gateway_factory()
    gw.node("prefill")
    decode = gw.node("decode", stream_tokens(reply_ids(tokenizer)))
    url = gw.api_url + "/v1/chat/completions"
    base = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for name, value in UNSERVED:
        r = httpx.post(url, json={**base, name: value}, timeout=10)
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == name and "not served" in r.json()["error"]["message"]
    r = httpx.post(url, json={**base, **NEUTRAL}, timeout=30)
    assert r.status_code == 200, r.text
    assert len(decode.wait_generates(1)) == 1  # only the neutral one reached a node
