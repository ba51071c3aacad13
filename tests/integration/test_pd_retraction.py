"""One prefill and one decode process (NIXL) under 32 concurrent greedy requests and a decode pool
small enough to force retractions: every output equals the single-process reference."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.cluster import metric, pd_pair

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")
openai = pytest.importorskip("openai")

NUM_REQUESTS = 32
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pd():
    # 32 requests x (prompt + 16 tokens) need ~800 tokens: 384 force retractions.
    with pd_pair(
        ["--max-total-tokens", "4096"],
        ["--max-total-tokens", "384", "--num-reserved-decode-tokens", "0"],
    ) as cluster:
        yield cluster


def reference_outputs(prompts: list[str]) -> list[str]:
    from common.launch.offline import generate_stream
    from common.model.default_model import default_model_dir
    from common.model.runner import ModelRunner
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=512)
    params = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0)
    return [list(generate_stream(runner, tok, tok.encode(p), params))[-1].text for p in prompts]


def test_concurrent_greedy_requests_survive_retraction_unchanged(pd):
    prompts = [f"Fact number {i} about the ocean:" for i in range(NUM_REQUESTS)]
    cl = openai.OpenAI(base_url=pd["api"] + "/v1", api_key="none", max_retries=0, timeout=600)
    outputs: dict[int, str | Exception] = {}

    def one(i: int) -> None:
        try:
            resp = cl.completions.create(
                model="default", prompt=prompts[i], max_tokens=MAX_TOKENS, temperature=0
            )
            outputs[i] = resp.choices[0].text
        except Exception as exc:  # noqa: BLE001 - reported below
            outputs[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_REQUESTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    errors = {i: o for i, o in outputs.items() if isinstance(o, Exception)}
    assert len(outputs) == NUM_REQUESTS and not errors, errors
    decode_url = pd["decode"].ready["http_url"]
    assert metric(decode_url, "pdserve_retractions_total") > 0, "the pool never ran short"
    expected = reference_outputs(prompts)
    mismatched = [i for i in range(NUM_REQUESTS) if outputs[i] != expected[i]]
    assert not mismatched, [(outputs[i], expected[i]) for i in mismatched[:3]]
    deadline = time.monotonic() + 30
    for node in (pd["prefill"], pd["decode"]):
        while metric(node.ready["http_url"], "pdserve_kv_pages_held") != 0:
            assert time.monotonic() < deadline, f"{node.name} still holds pages"
            time.sleep(0.2)


def test_n_seeded_samples_copy_the_prompt_and_survive_retraction_with_every_page_back(pd):
    """8 prompts with n = 4 (32 samples) under the same small decode pool: later samples copy
    the first one's prompt KV on the decode node, the pool runs short and retracts, and choice
    i of each prompt still equals the single-process run seeded sample_seed(seed, i). After,
    neither node holds a page, the decode pool is empty and no idle check found one astray."""
    from common.launch.offline import generate_stream
    from common.model.default_model import default_model_dir
    from common.model.runner import ModelRunner
    from common.sampler import sample_seed
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    n, seed = 4, 1234
    animals = "cat dog fox owl eel bee ant yak".split()
    prompts = [f"A short story about a {animal}:" for animal in animals]
    decode_url = pd["decode"].ready["http_url"]

    def decode_metric(name: str) -> float:
        try:
            return metric(decode_url, name)
        except KeyError:  # a labelled series appears with its first increment
            return 0.0

    retractions = decode_metric("pdserve_retractions_total")
    copied = decode_metric("pdserve_group_sample_tokens_total")
    cl = openai.OpenAI(base_url=pd["api"] + "/v1", api_key="none", max_retries=0, timeout=600)
    outputs: dict[int, list[str] | Exception] = {}

    def one(i: int) -> None:
        try:
            resp = cl.completions.create(
                model="default",
                prompt=prompts[i],
                max_tokens=MAX_TOKENS,
                temperature=0.8,
                seed=seed + i,
                n=n,
            )
            assert [c.index for c in resp.choices] == list(range(n))
            outputs[i] = [c.text for c in resp.choices]
        except Exception as exc:  # noqa: BLE001 - reported below
            outputs[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    errors = {i: o for i, o in outputs.items() if isinstance(o, Exception)}
    assert len(outputs) == len(prompts) and not errors, errors
    assert decode_metric("pdserve_retractions_total") > retractions, "the pool never ran short"
    assert decode_metric("pdserve_group_sample_tokens_total") > copied, "no sample copied"

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=512)
    for i, prompt in enumerate(prompts):
        for k in range(n):
            params = SamplingParams(
                max_new_tokens=MAX_TOKENS, temperature=0.8, seed=sample_seed(seed + i, k)
            )
            expected = list(generate_stream(runner, tok, tok.encode(prompt), params))[-1].text
            assert outputs[i][k] == expected, (i, k)  # type: ignore[index]

    deadline = time.monotonic() + 30
    for node in (pd["prefill"], pd["decode"]):
        while metric(node.ready["http_url"], "pdserve_kv_pages_held") != 0:
            assert time.monotonic() < deadline, f"{node.name} still holds pages"
            time.sleep(0.2)
    assert metric(decode_url, "pdserve_kv_pages_used") == 0  # no prefix cache: nothing kept
    assert decode_metric("pdserve_integrity_check_failures_total") == 0
