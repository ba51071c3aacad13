"""Structured output and tools through a real prefill node and decode node (NIXL), with chunked
prefill, prefix-cache hits and a decode pool small enough to force retractions: every output
parses and matches its schema, and greedy output equals the single-process reference under
the same grammar (the decode node's matcher continues exactly where the prefill node's
first token left it)."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import pytest

from tests.support.cluster import http, metric, pd_pair

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "job": {"enum": ["pilot", "baker", "nurse", "teacher"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "job", "hobbies"],
    "additionalProperties": False,
}
# A long shared system prompt: chunked prefill (64-token chunks) and prefix-cache hits.
SYSTEM = (
    "You are a helpful assistant that writes short, plausible character sheets for a novel. "
    "Every answer describes exactly one person with a name, an age, a job and a few hobbies. "
    "Keep names short and hobbies simple, and never add commentary outside the answer."
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def pd():
    # 12 requests x (~110 prompt + ~50 output tokens) need ~1900 tokens: 640 retract.
    with pd_pair(
        ["--max-total-tokens", "4096", "--chunked-prefill-size", "64"],
        ["--max-total-tokens", "640", "--num-reserved-decode-tokens", "0"],
    ) as cluster:
        yield cluster


def client(pd):
    return openai.OpenAI(base_url=pd["api"] + "/v1", api_key="none", max_retries=0, timeout=600)


def person_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}


def ask(i: int) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Character number {i}, please, as JSON."},
    ]


def test_every_output_matches_its_schema_under_retraction_chunking_and_cache_hits(pd):
    cl = client(pd)
    outputs: dict[int, object] = {}

    def one(i: int) -> None:
        try:
            resp = cl.chat.completions.create(
                model="default",
                messages=ask(i),
                response_format=person_format(),
                max_tokens=96,
                temperature=0.9 if i % 2 else 0,
                seed=i,
            )
            outputs[i] = resp.choices[0]
        except Exception as exc:  # noqa: BLE001 - reported below
            outputs[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    errors = {i: o for i, o in outputs.items() if isinstance(o, Exception)}
    assert len(outputs) == 12 and not errors, errors
    for choice in outputs.values():
        assert choice.finish_reason == "stop", choice  # type: ignore[union-attr]
        jsonschema.validate(json.loads(choice.message.content), PERSON)  # type: ignore[union-attr]
    decode_url, prefill_url = pd["decode"].ready["http_url"], pd["prefill"].ready["http_url"]
    assert metric(decode_url, "pdserve_retractions_total") > 0, "the pool never ran short"
    assert metric(prefill_url, "pdserve_prefix_cache_hit_tokens_total") > 0
    deadline = time.monotonic() + 30
    for node in (pd["prefill"], pd["decode"]):
        while metric(node.ready["http_url"], "pdserve_kv_pages_held") != 0:
            assert time.monotonic() < deadline, f"{node.name} still holds pages"
            time.sleep(0.2)


def reference_text(
    prompt_ids: list[int],
    kind: str,
    text: str,
    max_tokens: int,
    temperature: float = 0,
    seed: int | None = None,
) -> str:
    from common.grammar.backend import GrammarBackend, GrammarState
    from common.launch.offline import generate_stream
    from common.model.default_model import default_model_dir
    from common.model.runner import ModelRunner
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=1024)
    backend = GrammarBackend.for_tokenizer(tok, runner.spec.vocab_size)
    ticket = backend.submit(kind, text)
    while (compiled := backend.poll(ticket)) is None:
        time.sleep(0.001)
    params = SamplingParams(
        max_new_tokens=max_tokens, temperature=temperature, seed=seed, **{kind: text}
    )
    stream = generate_stream(runner, tok, prompt_ids, params, GrammarState(compiled))
    return list(stream)[-1].text  # type: ignore[union-attr]


def test_greedy_output_under_a_grammar_equals_the_single_process_reference(pd):
    prompt = "A short sheet for a baker named Tom:"
    schema = json.dumps(PERSON)
    status, body = http(
        "POST",
        pd["api"] + "/generate",
        {"text": prompt, "sampling_params": {"json_schema": schema, "max_new_tokens": 80}},
    )
    status, body = http(
        "POST",
        pd["api"] + "/generate",
        {
            "text": prompt,
            "sampling_params": {"json_schema": schema, "max_new_tokens": 80, "temperature": 0},
        },
    )
    assert status == 200, body
    from common.model.default_model import default_model_dir
    from common.tokenizer import Tokenizer

    ids = Tokenizer.from_pretrained(default_model_dir()).encode(prompt)
    assert body["text"] == reference_text(ids, "json_schema", schema, 80)
    jsonschema.validate(json.loads(body["text"]), PERSON)


def test_n_seeded_samples_under_a_grammar_equal_the_single_process_reference(pd):
    """n = 3 under a JSON schema: the later samples' first tokens come from the first
    sample's logits on the prefill node (their own seeds, each its own grammar matcher),
    their prompt KV is copied on the decode node, and each choice equals the single-process
    run seeded sample_seed(seed, i) under the same grammar."""
    from common.model.default_model import default_model_dir
    from common.sampler import sample_seed
    from common.tokenizer import Tokenizer

    resp = client(pd).chat.completions.create(
        model="default",
        messages=ask(5),
        response_format=person_format(),
        max_tokens=96,
        temperature=0.8,
        seed=77,
        n=3,
    )
    ids = Tokenizer.from_pretrained(default_model_dir()).apply_chat_template(ask(5))
    schema = json.dumps(PERSON)
    texts = [c.message.content for c in resp.choices]
    for i, text in enumerate(texts):
        expected = reference_text(ids, "json_schema", schema, 96, 0.8, sample_seed(77, i))
        assert text == expected, i
        jsonschema.validate(json.loads(text or ""), PERSON)
    assert len(set(texts)) > 1, "three seeds gave one output: the samples were not their own"


def test_generate_takes_regex_and_ebnf(pd):
    cases = [
        ({"regex": r"(yes|no), because [a-z ]{5,30}\."}, r"(yes|no), because [a-z ]{5,30}\."),
        ({"ebnf": 'root ::= "The answer is " [0-9]+ "."'}, r"The answer is [0-9]+\."),
    ]
    import re

    for grammar, pattern in cases:
        status, body = http(
            "POST",
            pd["api"] + "/generate",
            {
                "text": "Is the sea salty? Answer:",
                "sampling_params": {"max_new_tokens": 48, "temperature": 0.7, **grammar},
            },
        )
        assert status == 200, body
        assert re.fullmatch(pattern, body["text"]), body["text"]


def test_a_json_cut_by_max_tokens_finishes_with_length(pd):
    resp = client(pd).chat.completions.create(
        model="default", messages=ask(0), response_format=person_format(), max_tokens=5
    )
    assert resp.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(resp.choices[0].message.content or "")


def test_the_openai_clients_parse_returns_the_model(pd):
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        age: int = pydantic.Field(ge=0, le=120)
        hobbies: list[str] = pydantic.Field(max_length=3)

    resp = client(pd).chat.completions.parse(
        model="default", messages=ask(7), response_format=Person, max_tokens=96, temperature=0
    )
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Person) and 0 <= parsed.age <= 120


def test_unsupported_schema_features_and_bad_grammars_are_400s(pd):
    bad = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    status, body = http(
        "POST",
        pd["api"] + "/v1/chat/completions",
        {
            "messages": ask(0),
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
        },
    )
    assert status == 400 and '"not"' in body["error"]["message"], body
    assert body["error"]["param"] == "response_format"
    status, body = http(
        "POST",
        pd["api"] + "/generate",
        {"text": "x", "sampling_params": {"regex": "[a-"}},
    )
    assert status == 400 and "regex" in body["error"]["message"], body


def _tool_conversation(tool_choice: object, stream: bool, pd) -> tuple[list, str | None, str]:
    """A tool call, then the tool's result and the final answer."""
    cl = client(pd)
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = {"model": "default", "tools": [WEATHER_TOOL], "max_tokens": 64, "temperature": 0}
    if stream:
        calls: dict[int, dict] = {}
        reason = None
        for chunk in cl.chat.completions.create(
            messages=messages, tool_choice=tool_choice, stream=True, **kwargs
        ):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            reason = choice.finish_reason or reason
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
        tool_calls = [calls[k] for k in sorted(calls)]
    else:
        resp = cl.chat.completions.create(messages=messages, tool_choice=tool_choice, **kwargs)
        reason = resp.choices[0].finish_reason
        tool_calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in resp.choices[0].message.tool_calls or []
        ]
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in tool_calls
            ],
        }
    )
    for c in tool_calls:
        messages.append({"role": "tool", "tool_call_id": c["id"], "content": '{"temp": 18}'})
    answer = cl.chat.completions.create(messages=messages, tool_choice="none", **kwargs)
    return tool_calls, reason, answer.choices[0].message.content or ""


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_tool_round_trip(pd, stream: bool, tool_choice: object):
    calls, reason, answer = _tool_conversation(tool_choice, stream, pd)
    assert reason == "tool_calls" and calls, calls
    for c in calls:
        assert c["name"] == "get_weather" and c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["arguments"]), WEATHER_TOOL["function"]["parameters"])
    assert answer
