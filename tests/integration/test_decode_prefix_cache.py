"""The decode prefix cache on real processes: a bootstrap, one prefill node and two decode
nodes with --disaggregation-decode-enable-radix-cache (NIXL). Conversations of three turns
through /generate, each turn the last prompt, the model's answer and a new message:
outputs equal the single-process reference, every later turn lands on the decode node that
holds its conversation (session affinity) and receives only the pages after what that node
caches (bytes counted on the prefill node), and no page is held at the end."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from common.kv_pool import KVLayout, pages_needed
from tests.support.cluster import http, metric, pd_pair

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")

MAX_TOKENS = 8
TOPICS = ["the ocean", "mountains", "old trains"]
FOLLOW_UPS = [" Tell me one more thing about it.", " Why is that so?"]


@pytest.fixture(scope="module")
def pd():
    cache = ["--disaggregation-decode-enable-radix-cache", "--max-total-tokens", "2048"]
    with pd_pair(["--max-total-tokens", "4096"], cache, num_decode=2) as cluster:
        yield cluster


def counter(url: str, name: str) -> float:
    """A counter's value; 0 before its first increment (not exported until then)."""
    try:
        return metric(url, name)
    except KeyError:
        return 0.0


def generate(api: str, ids: list[int]) -> list[int]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    req = urllib.request.Request(
        api + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())["output_ids"]


def test_later_turns_move_only_their_new_pages_and_stay_exact(pd):
    from common.launch.offline import generate_stream
    from common.model.default_model import default_model_dir
    from common.model.runner import ModelRunner
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=1024)
    params = SamplingParams(max_new_tokens=MAX_TOKENS, temperature=0)
    status, nodes = http("GET", pd["api"] + "/nodes")
    layout = next(n["kv_layout"] for n in nodes["nodes"] if n["role"] == "prefill")
    page = layout["page_size"]
    prefill_url = pd["prefill"].ready["http_url"]
    decode_urls = [d.ready["http_url"] for d in pd["decodes"]]
    sent_before = counter(prefill_url, "pdserve_kv_transfer_bytes_total")

    chats = {t: tok.encode(f"Here is a short fact about {t}:") for t in TOPICS}
    last_kv: dict[str, int] = {}  # tokens of the last turn's KV on its decode node
    moved_pages = full_pages = hit_pages = 0
    for turn in range(3):
        for topic in TOPICS:  # round-robin: the other conversations run in between
            ids = chats[topic]
            out = generate(pd["api"], ids)
            expected = list(generate_stream(runner, tok, ids, params))[-1].token_ids
            assert out == expected, (topic, turn)
            held = 0
            if topic in last_kv:  # whole pages of it, at most up to the new last token's page
                held = min(last_kv[topic] // page, (len(ids) - 1) // page)
            hit_pages += held
            moved_pages += pages_needed(len(ids), page) - held
            full_pages += pages_needed(len(ids), page)
            last_kv[topic] = len(ids) + len(out) - 1  # every token but the last has KV
            if turn < 2:
                chats[topic] = ids + out + tok.encode(FOLLOW_UPS[turn])
    bytes_per_page = KVLayout(**layout).bytes_per_page
    sent = metric(prefill_url, "pdserve_kv_transfer_bytes_total") - sent_before
    assert sent == moved_pages * bytes_per_page, (sent / bytes_per_page, moved_pages)
    assert hit_pages >= 2 * len(TOPICS)  # every later turn found at least a page
    assert moved_pages == full_pages - hit_pages
    # Every hit was on the node holding its conversation (hits add up over both nodes).
    hits = sum(counter(u, "pdserve_prefix_cache_hit_tokens_total") for u in decode_urls)
    assert hits == hit_pages * page
    deadline = time.monotonic() + 30
    for url in (prefill_url, *decode_urls):
        while metric(url, "pdserve_kv_pages_held") != 0:
            assert time.monotonic() < deadline, f"{url} still holds pages"
            time.sleep(0.2)
