"""Accuracy parity on real processes, the short run (bench/parity.py runs all 500 prompts).

Natural-language prompts go through a P/D pair (NIXL) and through a colocated node, with
64-token chunked prefill, prefixes shared between prompts (cache hits), a prefill pool that
evicts and a decode pool small enough to retract; every output equals the single-process
float32 reference, token ids and logprobs (tests/support/parity.py says how). Then an abort
storm: 160 streams dropped by their clients at random moments (queued, prefilling, in
transfer, decoding, retracted) while the parity prompts run again; every surviving output
still equals its reference and no node holds a page at the end.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.parse

import pytest

from tests.support import parity
from tests.support.cluster import colocated as colocated_cluster
from tests.support.cluster import metric, pd_pair

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")

NUM_PROMPTS = 24
MAX_NEW_TOKENS = 16
CONCURRENCY = 16
NUM_ABORTED = 120
PREFILL_ARGS = ["--dtype", "float32", "--chunked-prefill-size", "64", "--max-total-tokens", "1024"]
DECODE_ARGS = [
    "--dtype",
    "float32",
    "--max-total-tokens",
    "384",
    "--num-reserved-decode-tokens",
    "0",
]


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return parity.load_prompts(NUM_PROMPTS)


@pytest.fixture(scope="module")
def refs(prompts: list[str]) -> list[parity.Answer]:
    return parity.references(prompts, MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def pd():
    with pd_pair(PREFILL_ARGS, DECODE_ARGS) as cluster:
        yield cluster


def _wait_no_pages(urls: list[str], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    for url in urls:
        while (held := metric(url, "pdserve_kv_pages_held")) != 0:
            assert time.monotonic() < deadline, f"{url} still holds {held} pages"
            time.sleep(0.2)


def _check(verdict: parity.Verdict) -> None:
    print(f"parity: {json.dumps(verdict.summary())}")
    assert verdict.is_ok, (verdict.errors[:3], verdict.mismatches[:3])
    assert verdict.num_equal >= verdict.num - 2, verdict.summary()  # near ties are rare


def test_pd_outputs_equal_the_reference(pd, prompts, refs) -> None:
    served = parity.serve_all(pd["api"], prompts, MAX_NEW_TOKENS, CONCURRENCY)
    _check(parity.compare(served, refs))
    prefill, decode = pd["prefill"].ready["http_url"], pd["decode"].ready["http_url"]
    assert metric(decode, "pdserve_retractions_total") > 0, "the decode pool never ran short"
    assert metric(prefill, "pdserve_prefix_cache_hit_tokens_total") > 0, "no cache hit"
    _wait_no_pages([prefill, decode])


def _dropped_stream(api: str, prompt: str, rng: random.Random, log: list[str]) -> None:
    """A streamed /generate whose client goes away at a random moment."""
    parts = urllib.parse.urlsplit(api)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
    body = {
        "text": prompt,
        "stream": True,
        "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True},
    }
    try:
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        if rng.random() < 0.3:  # before any byte: queued, prefilling or in transfer
            time.sleep(rng.uniform(0.0, 1.5))
            log.append("before the first byte")
            return
        resp = conn.getresponse()
        for _ in range(rng.randrange(1, 40)):  # decoding, perhaps retracted
            if not resp.readline():
                break
        log.append("mid-stream")
    except OSError as exc:
        log.append(f"error {exc}")
    finally:
        conn.close()


def _aborted(urls: list[str]) -> float:
    total = 0.0
    for url in urls:
        try:
            total += metric(url, "pdserve_requests_total", outcome="aborted")
        except KeyError:  # no request aborted there yet
            pass
    return total


def test_an_abort_storm_leaves_the_survivors_exact_and_no_page_held(pd, prompts, refs) -> None:
    nodes = [pd["prefill"].ready["http_url"], pd["decode"].ready["http_url"]]
    aborted_before = _aborted(nodes)
    rng = random.Random(35)
    log: list[str] = []
    stormers = [
        threading.Thread(
            target=_dropped_stream,
            args=(pd["api"], prompts[i % len(prompts)], random.Random(rng.random()), log),
            daemon=True,
        )
        for i in range(NUM_ABORTED)
    ]
    storm_started = threading.Event()

    def storm() -> None:
        storm_started.set()
        for i in range(0, NUM_ABORTED, 20):  # waves of 20, alongside the survivors
            wave = stormers[i : i + 20]
            for t in wave:
                t.start()
            for t in wave:
                t.join(180)

    storming = threading.Thread(target=storm, daemon=True)
    storming.start()
    storm_started.wait()
    served = parity.serve_all(pd["api"], prompts, MAX_NEW_TOKENS, CONCURRENCY // 2)
    storming.join(600)
    assert not storming.is_alive(), "the storm's clients hung"
    early, mid = log.count("before the first byte"), log.count("mid-stream")
    other = len(log) - early - mid
    aborted = _aborted(nodes) - aborted_before
    print(f"abort storm: {early} before the first byte, {mid} mid-stream, {other} other;")
    print(f"abort storm: the nodes aborted {aborted:g} requests")
    assert (early, mid) != (0, 0) and other == 0, log[:5]
    _check(parity.compare(served, refs))
    _wait_no_pages(nodes)
    # Requests that had already finished when their client left are not aborted; most
    # of the storm's requests (64 tokens each) were cut short on a node.
    assert _aborted(nodes) - aborted_before >= NUM_ABORTED // 2
    # The nodes are whole: a fresh request is exact too.
    again = parity.serve_all(pd["api"], prompts[:4], MAX_NEW_TOKENS, 4)
    _check(parity.compare(again, refs[:4]))


@pytest.fixture(scope="module")
def colocated():
    # One 384-token pool for both halves and no reserved decode tokens: the decode half
    # retracts, as the P/D pair's decode node does.
    args = (
        "--dtype", "float32", "--max-total-tokens", "384", "--chunked-prefill-size", "64",
        "--num-reserved-decode-tokens", "0",
    )  # fmt: skip
    with colocated_cluster(args) as cluster:
        yield cluster


def test_colocated_outputs_equal_the_reference(colocated, prompts, refs) -> None:
    served = parity.serve_all(colocated["api"], prompts, MAX_NEW_TOKENS, CONCURRENCY)
    _check(parity.compare(served, refs))
    url = colocated["node"].ready["http_url"]
    assert metric(url, "pdserve_prefix_cache_hit_tokens_total") > 0, "no cache hit"
    assert metric(url, "pdserve_retractions_total") > 0, "no retraction"
    _wait_no_pages([url])


@pytest.fixture(scope="module")
def pd_host_tier():
    # The pair with a host tier under the prefill node's radix cache and a pool of a fifth
    # of the prompts' tokens: the prefixes the prompts share are evicted between them and
    # loaded back from host memory instead of computed again.
    args = [*PREFILL_ARGS, "--max-total-tokens", "256", "--enable-hierarchical-cache"]
    with pd_pair(args, DECODE_ARGS) as cluster:
        yield cluster


def test_pd_outputs_with_the_host_tier_equal_the_reference(pd_host_tier, prompts, refs) -> None:
    api = pd_host_tier["api"]
    # Twice: the second pass finds every prompt's prefix evicted to the host by the first.
    for _ in range(2):
        served = parity.serve_all(api, prompts, MAX_NEW_TOKENS, CONCURRENCY)
        _check(parity.compare(served, refs))
    prefill = pd_host_tier["prefill"].ready["http_url"]
    decode = pd_host_tier["decode"].ready["http_url"]
    assert metric(prefill, "pdserve_host_cache_hit_tokens_total") > 0, "nothing loaded back"
    assert metric(prefill, "pdserve_prefix_cache_evicted_pages_total") > 0, "no eviction"
    _wait_no_pages([prefill, decode])
