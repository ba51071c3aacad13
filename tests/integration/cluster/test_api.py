"""The gateway's API end to end: the official client, greedy parity, TTFT stages, usage, load."""

from __future__ import annotations

import threading
import time

import pytest

from common import stages
from tests.integration.cluster.common import SYSTEM, client, metric_or_0
from tests.support.cluster import metric

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")
pytest.importorskip("openai")


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


def test_n_seeded_samples_with_penalties_equal_the_single_process_runner(cluster):
    """n = 3 through the official client, sampled with a seed and every penalty: choice i
    equals the single-process run seeded sample_seed(seed, i); the prompt counts once."""
    from common.launch.offline import OfflineResult, generate_stream
    from common.model.default_model import default_model_dir
    from common.model.runner import ModelRunner
    from common.sampler import sample_seed
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=1024)
    messages = [{"role": "user", "content": "Name some birds, some birds, some birds."}]
    ids = tok.apply_chat_template(messages)
    penalties = {"frequency_penalty": 0.6, "presence_penalty": 0.3}
    extra = {"repetition_penalty": 1.2, "min_tokens": 6}

    def totals(name: str) -> dict[str, float]:
        return {
            role: sum(
                metric_or_0(p.ready["http_url"], name, role=role)
                for node, p in cluster["nodes"].items()
                if node.startswith(role)
            )
            for role in ("prefill", "decode")
        }

    group_before = totals("pdserve_group_sample_tokens_total")
    computed_before = totals("pdserve_prefill_tokens_total")["prefill"]
    chat = client(cluster).chat.completions.create(
        model="default",
        max_tokens=16,
        temperature=0.7,
        seed=21,
        n=3,
        messages=messages,
        extra_body=extra,
        **penalties,
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    for i, choice in enumerate(chat.choices):
        params = SamplingParams(
            max_new_tokens=16, temperature=0.7, seed=sample_seed(21, i), **penalties, **extra
        )
        offline = list(generate_stream(runner, tok, ids, params))[-1]
        assert isinstance(offline, OfflineResult)
        assert choice.message.content == offline.text, i
    assert chat.usage.prompt_tokens == len(ids)
    # The prompt was computed and moved once: samples 1 and 2 sampled from sample 0's
    # logits on the prefill node and copied its last page on the decode node.
    group = totals("pdserve_group_sample_tokens_total")
    assert group["prefill"] - group_before["prefill"] == 2 * len(ids)
    page = runner.page_size
    assert group["decode"] - group_before["decode"] == 2 * (
        len(ids) - (len(ids) - 1) // page * page
    )
    assert totals("pdserve_prefill_tokens_total")["prefill"] - computed_before <= len(ids)


def test_echo_logprobs_equal_the_single_process_runner_with_the_prompt_cached(cluster):
    """echo + logprobs through the official client: each prompt token's logprob and top 2
    equal the single-process runner's over the whole prompt, though the prefill node has
    the prompt cached (it computes it again), streamed and not; max_tokens 0 scores."""
    from common.kv_pool import pages_needed
    from common.model.default_model import default_model_dir
    from common.model.runner import ExtendRequest, ModelRunner
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=1024)
    prompt = SYSTEM + " The quick brown fox jumps over the lazy dog, and then it rests."
    ids = tok.encode(prompt)
    pages = runner.pool.allocator.allocate(pages_needed(len(ids), runner.page_size))
    ref = runner.extend([ExtendRequest(ids, 0, pages, logprob_targets=ids[1:], top_logprobs=2)])
    want = ref.target_logprobs[0].tolist()
    want_top = ref.top_logprobs[0][1][: len(ids) - 1].tolist()
    cl = client(cluster)
    cl.completions.create(model="default", prompt=prompt, max_tokens=1, temperature=0)
    cached_before = cl.completions.create(
        model="default", prompt=prompt, max_tokens=1, temperature=0
    ).usage.prompt_tokens_details.cached_tokens
    assert cached_before > 0  # the prompt is cached on its prefill node

    def check(logprobs, n_out):
        assert logprobs.tokens[: len(ids)] == [
            tok.decode([t], skip_special_tokens=False) for t in ids
        ]
        got = logprobs.token_logprobs[: len(ids)]
        assert got[0] is None and len(logprobs.token_logprobs) == len(ids) + n_out
        assert got[1:] == pytest.approx(want, abs=2e-3)
        for i, top in enumerate(logprobs.top_logprobs[1 : len(ids)]):
            names = [tok.decode([t], skip_special_tokens=False) for t in want_top[i]]
            assert set(top) <= set(names) and len(top) == len(set(names)), i

    out = cl.completions.create(
        model="default", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    assert out.choices[0].text.startswith(prompt)
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # computed whole
    check(out.choices[0].logprobs, out.usage.completion_tokens)
    chunks = list(
        cl.completions.create(
            model="default",
            prompt=prompt,
            max_tokens=3,
            temperature=0,
            echo=True,
            logprobs=2,
            stream=True,
        )
    )
    assert chunks[0].choices[0].text == prompt
    check(chunks[0].choices[0].logprobs, 0)
    scored = cl.completions.create(
        model="default", prompt=prompt, max_tokens=0, echo=True, logprobs=2
    )
    assert scored.choices[0].text == prompt and scored.usage.completion_tokens == 0
    check(scored.choices[0].logprobs, 0)


def _stage_totals(url: str, stage_names: list[str]) -> dict[str, tuple[float, float]]:
    """(count, sum) of pdserve_request_stage_seconds per stage on one process."""
    return {
        name: (
            metric_or_0(url, "pdserve_request_stage_seconds_count", stage=name),
            metric_or_0(url, "pdserve_request_stage_seconds_sum", stage=name),
        )
        for name in stage_names
    }


def test_ttft_stages_are_recorded_and_add_up_to_the_ttft_the_client_saw(cluster):
    chain = [name for name, _, _ in stages.CHAIN]
    every = list(stages.STAGES)
    nodes = cluster["nodes"].values()
    before = _stage_totals(cluster["api"], every)
    ttft_before = metric_or_0(cluster["api"], "pdserve_time_to_first_token_seconds_sum")
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
