"""Losing a prefill node (kill -9 mid-chunk, mid-transfer, queued), restarts, and identity."""

from __future__ import annotations

import uuid

import pytest

from tests.faults.checks import (
    assert_ended_well,
    assert_fresh_request_succeeds,
    assert_no_pages_held,
    key_for,
    long_prompt,
    metric_or_zero,
    wait_all,
    wait_metric,
)
from tests.faults.harness import API_KEY, CHUNK, TOKEN, Cluster
from tests.faults.streams import Stream
from tests.support.cluster import http
from tests.support.waits import wait_for

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")

VICTIM = "prefill-0"


@pytest.mark.parametrize("num_chunks", [1, 3], ids=["mid-chunk", "mid-transfer"])
def test_kill9_prefill_mid_prompt_migrates_and_frees_decode_pages(
    cluster: Cluster, num_chunks: int
) -> None:
    """After one chunk it is computing the next; after three, earlier pages are in flight."""
    key = key_for(VICTIM)
    before = cluster.metric(VICTIM, "pdserve_prefill_tokens_total")
    stream = Stream(
        cluster.api, long_prompt(f"case {num_chunks}"), max_tokens=16, routing_key=key
    ).start()
    wait_metric(
        cluster,
        VICTIM,
        "pdserve_prefill_tokens_total",
        lambda v: v - before >= num_chunks * CHUNK,
        f"{num_chunks} chunk(s) prefilled",
    )
    if num_chunks > 1:
        assert (
            metric_or_zero(cluster, VICTIM, "pdserve_kv_transfer_rooms", state="Transferring") >= 1
        )
    assert not stream.is_done, stream.outcome
    fault = cluster.kill9(VICTIM)
    [outcome] = wait_all([stream])
    # Its KV had not fully arrived: it moves to the other prefill node (migration) and
    # completes; what the dead room held on decode-0 is freed.
    assert_ended_well(outcome, fault)
    assert outcome.is_completed and outcome.finish_reason == "length", outcome
    assert_no_pages_held(cluster)
    cluster.restart(VICTIM)
    assert_fresh_request_succeeds(cluster, key, VICTIM)


def test_kill9_prefill_with_requests_in_its_bootstrap_queue(cluster: Cluster) -> None:
    key = key_for(VICTIM)
    # Each needs ~1000 prompt + 512 reserved tokens of decode-0's 4096: two fit, the rest
    # wait in decode's prealloc queue, so in the prefill node's bootstrap queue.
    streams = [
        Stream(
            cluster.api, long_prompt(f"case 3 #{i}", 1000), max_tokens=8, routing_key=key
        ).start()
        for i in range(5)
    ]
    wait_metric(
        cluster,
        VICTIM,
        "pdserve_queue_requests",
        lambda v: v >= 1,
        "a request in the bootstrap queue",
        queue="bootstrap",
    )
    fault = cluster.kill9(VICTIM)
    outcomes = wait_all(streams)
    for outcome in outcomes:  # the queued ones move to prefill-1 (migration)
        assert_ended_well(outcome, fault)
        assert outcome.is_completed, outcome
    assert_no_pages_held(cluster)
    cluster.restart(VICTIM)
    assert_fresh_request_succeeds(cluster, key, VICTIM)


def test_first_request_after_a_prefill_restart_on_the_same_ports_succeeds(cluster: Cluster) -> None:
    key = key_for(VICTIM)
    assert_fresh_request_succeeds(cluster, key, VICTIM)  # decode-0 has handshaken the old instance
    cluster.kill9(VICTIM)
    cluster.restart(VICTIM)  # same ports, same node id, a new instance
    assert_fresh_request_succeeds(cluster, key, VICTIM)
    assert_no_pages_held(cluster)


def test_registering_a_live_node_id_from_another_instance_is_refused(cluster: Cluster) -> None:
    from common import messages as msg

    intruder = msg.RegisterNode(
        node_id=VICTIM,
        role="prefill",
        request_endpoint="tcp://127.0.0.1:9",
        control_endpoint="tcp://127.0.0.1:9",
        http_url="http://127.0.0.1:9",
        backend="nixl",
        backend_metadata=b"",
        kv_layout={},
        num_pages=1,
        max_running_requests=1,
        protocol_version=msg.PROTOCOL_VERSION,
        auth_token=TOKEN,
        instance_id=uuid.uuid4().hex,
    )
    status, body = http(
        "POST", cluster.registry + "/register", msg.to_jsonable(intruder), token=TOKEN
    )
    assert status == 409, (status, body)
    _, nodes = http("GET", cluster.api + "/nodes", token=API_KEY)
    entry = next(n for n in nodes["nodes"] if n["id"] == VICTIM)
    assert entry["http_url"] == cluster.nodes[VICTIM].http_url, entry
    assert_fresh_request_succeeds(cluster, key_for(VICTIM), VICTIM)


def test_kill9_prefill_spares_requests_already_streaming(cluster: Cluster) -> None:
    """Narrow failures: a request streaming from decode-0 has its KV there; it finishes."""
    key = key_for(VICTIM)
    streaming = Stream(
        cluster.api, "Story: the lighthouse keeper's long night", max_tokens=160, routing_key=key
    ).start()
    wait_for(
        lambda: streaming.num_chunks >= 3 or streaming.is_done,
        60,
        "the streaming request's first chunks",
    )
    before = cluster.metric(VICTIM, "pdserve_prefill_tokens_total")
    chunking = Stream(cluster.api, long_prompt("case 4n"), max_tokens=16, routing_key=key).start()
    wait_metric(
        cluster,
        VICTIM,
        "pdserve_prefill_tokens_total",
        lambda v: v - before >= CHUNK,
        "a chunk of the second request",
    )
    assert not streaming.is_done, streaming.outcome
    fault = cluster.kill9(VICTIM)
    kept, lost = wait_all([streaming, chunking])
    assert kept.is_completed and kept.finish_reason == "length", kept
    assert_ended_well(lost, fault)
    assert lost.is_completed, lost  # it had no KV on decode-0 yet: it moved to prefill-1
    assert_no_pages_held(cluster)
    cluster.restart(VICTIM)
    assert_fresh_request_succeeds(cluster, key, VICTIM)


def test_kill9_prefill_right_after_a_host_tier_load_back_migrates_and_frees_every_page(
    cluster: Cluster,
) -> None:
    """A prefill node with a host tier (--enable-hierarchical-cache) and a pool its
    prompts overflow: a prompt whose prefix was evicted to the host loads it back, and
    the node is killed while it computes the rest. The stream moves to prefill-1 and
    completes; decode-0's pages for the dead room are freed; the node comes back plain."""
    key = key_for(VICTIM)
    host_tier = ["--enable-hierarchical-cache", "--max-total-tokens", "4096"]
    cluster.restart(VICTIM, host_tier)
    try:
        shared = long_prompt("host tier", 1000)
        for tag in ("first", "other 1", "other 2", "other 3"):  # the last three evict it
            prompt = shared if tag == "first" else long_prompt(tag, 1500)
            done = Stream(cluster.api, prompt, max_tokens=4, routing_key=key).start()
            [outcome] = wait_all([done])
            assert outcome.is_completed, outcome
        loaded = metric_or_zero(cluster, VICTIM, "pdserve_host_cache_hit_tokens_total")
        longer = shared + " more" * 1500
        stream = Stream(cluster.api, longer, max_tokens=16, routing_key=key).start()
        wait_metric(
            cluster,
            VICTIM,
            "pdserve_host_cache_hit_tokens_total",
            lambda v: v - loaded >= CHUNK,
            "the shared prefix loaded back from the host tier",
        )
        assert not stream.is_done, stream.outcome
        fault = cluster.kill9(VICTIM)
        [outcome] = wait_all([stream])
        assert_ended_well(outcome, fault)
        assert outcome.is_completed and outcome.finish_reason == "length", outcome
        assert_no_pages_held(cluster)
    finally:
        cluster.restart(VICTIM)  # without the host tier, as the other cases expect it
    assert_fresh_request_succeeds(cluster, key, VICTIM)
