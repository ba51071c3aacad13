"""Schema-driven fuzzing of the public API: bodies generated from the app's own OpenAPI schema.

The gateway is real (HTTP, router, zmq); the nodes are fakes that stream a reply, so the
examples are cheap and the test measures what the schema is for: bodies drawn from it
must reach generation (a GenerateReq at the decode node), never a 5xx, and every error
must be a documented status with an OpenAI-shaped body. The real cluster is fuzzed with
hostile bodies in tests/integration/cluster/test_hardening.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis_jsonschema import from_schema

from common import messages as msg
from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.gateway import Gateway, reply_ids, stream_tokens

tokenizer = harness.tokenizer

ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
EXAMPLES_PER_ROUTE = 20
# Generated bodies that must reach a node: the schema's ranges and enums are what is served;
# what it cannot say (prompt + max_tokens within the context; a chat template's own rules)
# turns some away.
MIN_REACHED_FRACTION = 0.5


@pytest.fixture(scope="module")
def gw(tokenizer: Tokenizer) -> Iterator[Gateway]:
    gw = harness.start_gateway(tokenizer)
    gw.node("prefill")
    gw.node("decode", stream_tokens(reply_ids(tokenizer)))
    yield gw
    gw.stop()


def _body_schema(openapi: dict[str, Any], route: str) -> dict[str, Any]:
    body = openapi["paths"][route]["post"]["requestBody"]["content"]["application/json"]
    return {**body["schema"], "components": openapi["components"]}


def _documented(openapi: dict[str, Any], route: str) -> set[int]:
    return {200} | {int(s) for s in openapi["paths"][route]["post"]["responses"] if s.isdigit()}


def _num_generates(gw: Gateway) -> int:
    return sum(1 for m in gw.nodes[1].received if isinstance(m, msg.GenerateReq))


def test_the_schema_roles_are_the_served_roles() -> None:
    from bootstrap.openai_schema import CHAT_ROLES
    from common.tokenizer import CHAT_ROLES as TEMPLATE_ROLES

    assert set(CHAT_ROLES) == TEMPLATE_ROLES | {"developer"}


def test_the_schema_documents_every_error_status_and_no_422(gw: Gateway) -> None:
    openapi = httpx.get(gw.api_url + "/openapi.json").json()
    for route in ROUTES:
        responses = openapi["paths"][route]["post"]["responses"]
        assert {"400", "401", "404", "413", "429", "503"} <= set(responses), route
        assert "422" not in responses  # invalid bodies are 400s
        error = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error.endswith("/ErrorResponse")
    chat = openapi["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    shapes = chat["messages"]["items"]["anyOf"]
    assert [role for shape in shapes for role in shape["properties"]["role"]["enum"]] == [
        "system",
        "developer",
        "user",
        "assistant",
        "tool",
    ]
    assert shapes[1]["required"] == ["role", "content", "tool_call_id"]
    assert (chat["top_p"]["exclusiveMinimum"], chat["top_p"]["maximum"]) == (0, 1)
    assert chat["max_tokens"]["maximum"] == harness.CONTEXT_LENGTH
    prompt = openapi["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]
    ids = [a for a in prompt["anyOf"] if a.get("items", {}).get("type") == "integer"]
    assert ids[0]["items"]["maximum"] == gw.service.tokenizer.vocab_size - 1


@pytest.mark.parametrize("route", ROUTES)
def test_bodies_from_the_schema_reach_generation_and_never_5xx(gw: Gateway, route: str) -> None:
    openapi = httpx.get(gw.api_url + "/openapi.json").json()
    documented = _documented(openapi, route)
    url = gw.api_url + route
    seen: list[int] = []
    client = httpx.Client(timeout=30)

    @settings(
        max_examples=EXAMPLES_PER_ROUTE,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(from_schema(_body_schema(openapi, route)))
    def one(body: dict[str, Any]) -> None:
        before = _num_generates(gw)
        resp = client.post(
            url, content=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        assert resp.status_code < 500, (body, resp.text)
        assert resp.status_code in documented, (body, resp.status_code, resp.text)
        if resp.status_code != 200:
            error = resp.json()["error"]
            assert isinstance(error["message"], str) and error["type"], resp.text
        elif _num_generates(gw) == before:
            harness.wait_until(lambda: _num_generates(gw) > before, 5)
        seen.append(resp.status_code)

    try:
        one()
    finally:
        client.close()
    reached = sum(1 for s in seen if s == 200)
    print(f"{route}: {reached} of {len(seen)} schema-drawn bodies reached a node")
    assert reached >= MIN_REACHED_FRACTION * len(seen), f"{reached} of {len(seen)} reached a node"
    assert httpx.get(gw.api_url + "/health").json()["status"] == "ok"
