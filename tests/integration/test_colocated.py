"""Colocated mode: one process prefills and decodes on one KV pool, behind the same gateway."""

from __future__ import annotations

import threading

import pytest

from tests.support.cluster import colocated as colocated_cluster
from tests.support.cluster import http, metric

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

TOKEN = "colocated-token"


@pytest.fixture(scope="module")
def colocated():
    args = ("--auth-token", TOKEN, "--dtype", "float32", "--max-total-tokens", "4096")
    with colocated_cluster((*args, "--chunked-prefill-size", "256"), ("--auth-token", TOKEN)) as c:
        yield c


def _client(c):
    return openai.OpenAI(base_url=c["api"] + "/v1", api_key="none", max_retries=0, timeout=120)


def test_it_registers_a_prefill_and_a_decode_half_that_name_each_other(colocated):
    status, body = http("GET", colocated["api"] + "/nodes")
    assert status == 200, body
    by_id = {n["id"]: n for n in body["nodes"]}
    assert by_id["colo.prefill"]["role"] == "prefill"
    assert by_id["colo.prefill"]["colocated_with"] == "colo.decode"
    assert by_id["colo.decode"]["colocated_with"] == "colo.prefill"


def test_greedy_output_equals_the_single_process_runner(colocated):
    from common.launch.offline import OfflineResult, generate_stream
    from common.model.default_model import default_model_dir
    from common.model.runner import ModelRunner
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=1024, dtype="float32")
    messages = [{"role": "user", "content": "Name two rivers of Europe."}]
    ids = tok.apply_chat_template(messages)
    offline = [
        x
        for x in generate_stream(runner, tok, ids, SamplingParams(max_new_tokens=20, temperature=0))
    ][-1]
    assert isinstance(offline, OfflineResult)
    for _ in range(2):  # the second one prefills from the cache
        chat = _client(colocated).chat.completions.create(
            model="default", max_tokens=20, temperature=0, messages=messages
        )
        assert chat.choices[0].message.content == offline.text


def test_echo_logprobs_equal_the_single_process_runner(colocated):
    """The prompt's logprobs travel from the prefill half to the decode half as in P/D."""
    from common.kv_pool import pages_needed
    from common.model.default_model import default_model_dir
    from common.model.runner import ExtendRequest, ModelRunner
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=1024, dtype="float32")
    prompt = "Lighthouses guide ships along rocky coasts at night."
    ids = tok.encode(prompt)
    pages = runner.pool.allocator.allocate(pages_needed(len(ids), runner.page_size))
    ref = runner.extend([ExtendRequest(ids, 0, pages, logprob_targets=ids[1:])])
    out = _client(colocated).completions.create(
        model="default", prompt=prompt, max_tokens=0, echo=True, logprobs=0
    )
    assert out.choices[0].text == prompt
    got = out.choices[0].logprobs.token_logprobs
    assert got[0] is None and got[1:] == pytest.approx(ref.target_logprobs[0].tolist(), abs=2e-3)


def test_long_prompts_and_streams_mix_and_every_page_comes_back(colocated):
    cl = _client(colocated)
    results: list[object] = []

    def stream(i: int) -> None:
        try:
            text = "".join(
                ch.choices[0].text
                for ch in cl.completions.create(
                    model="default",
                    prompt=f"Story {i}: the lighthouse",
                    max_tokens=24,
                    temperature=0,
                    stream=True,
                )
                if ch.choices
            )
            results.append(text)
        except Exception as exc:  # noqa: BLE001 - the assertion reports it
            results.append(exc)

    def long(i: int) -> None:  # several chunks of prefill while the streams decode
        try:
            r = cl.completions.create(
                model="default", prompt=f"{i} " + "wave " * 900, max_tokens=2, temperature=0
            )
            results.append(r.choices[0].text)
        except Exception as exc:  # noqa: BLE001
            results.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=long, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 6 and all(isinstance(r, str) and r for r in results), results
    url = colocated["node"].ready["http_url"]
    for _ in range(100):
        if metric(url, "pdserve_kv_pages_held") == 0:
            break
        threading.Event().wait(0.1)
    assert metric(url, "pdserve_kv_pages_held") == 0


def test_json_output_under_a_schema_parses_and_equals_the_reference(colocated):
    """One grammar backend serves both halves: the first token sampled under the grammar on
    the prefill half, the rest on the decode half from a matcher rebuilt after it."""
    import json

    from common.grammar.backend import GrammarBackend, GrammarState
    from common.launch.offline import OfflineResult, generate_stream
    from common.model.default_model import default_model_dir
    from common.model.runner import ModelRunner
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    schema = {
        "type": "object",
        "properties": {"river": {"type": "string"}, "km": {"type": "integer"}},
        "required": ["river", "km"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "The longest river of Europe, as JSON."}]
    chat = _client(colocated).chat.completions.create(
        model="default",
        max_tokens=48,
        temperature=0,
        messages=messages,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    )
    text = chat.choices[0].message.content or ""
    assert chat.choices[0].finish_reason == "stop" and set(json.loads(text)) == {"river", "km"}
    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=1024, dtype="float32")
    backend = GrammarBackend.for_tokenizer(tok, runner.spec.vocab_size)
    ticket = backend.submit("json_schema", json.dumps(schema))
    while (compiled := backend.poll(ticket)) is None:
        threading.Event().wait(0.001)
    params = SamplingParams(max_new_tokens=48, temperature=0, json_schema=json.dumps(schema))
    ids = tok.apply_chat_template(messages)
    offline = list(generate_stream(runner, tok, ids, params, GrammarState(compiled)))[-1]
    assert isinstance(offline, OfflineResult) and offline.text == text
