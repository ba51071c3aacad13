"""Losing the gateway (kill -9 and restart of the bootstrap) and clients that go away."""

from __future__ import annotations

import time

import pytest

from tests.faults.checks import (
    SHORT_PROMPT,
    assert_fresh_request_succeeds,
    assert_gateway_idle,
    assert_no_pages_held,
    key_for,
    long_prompt,
    metric_or_zero,
    wait_all,
    wait_metric,
)
from tests.faults.harness import CHUNK, LEASE_S, OUTCOME_BOUND_S, Cluster
from tests.faults.streams import Stream
from tests.support.waits import wait_for

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")

NODES = ["prefill-0", "prefill-1", "decode-0"]


def test_kill9_bootstrap_makes_the_nodes_abort_its_requests(cluster: Cluster) -> None:
    prefill = "prefill-0"
    before = cluster.metric(prefill, "pdserve_prefill_tokens_total")
    streaming = Stream(cluster.api, "Story: the harbour at night", max_tokens=200).start()
    wait_for(lambda: streaming.num_chunks >= 3, 60, "3 chunks streamed")
    prefilling = Stream(
        cluster.api, long_prompt("case 11"), max_tokens=16, routing_key=key_for(prefill)
    ).start()
    wait_metric(
        cluster,
        prefill,
        "pdserve_prefill_tokens_total",
        lambda v: v - before >= CHUNK,
        "a chunk prefilled",
    )
    assert cluster.pages_held("decode-0") > 0
    fault = cluster.kill9("bootstrap")
    for outcome in wait_all([streaming, prefilling]):
        # The gateway itself is gone: the connection drops at once; it must not hang.
        assert outcome.kind != "timeout" and outcome.ended is not None, outcome
        assert outcome.ended - fault <= OUTCOME_BOUND_S, outcome
        assert not outcome.is_completed, outcome
    # Orphaned requests are aborted on every node without waiting for the gateway to return.
    assert_no_pages_held(cluster, NODES)
    # Same ports. A request sent at the restarted gateway's READY line, before any node
    # has registered again, waits for them (--registration-window) instead of a 503, and
    # every node is known again within about a second (nodes beat at least every second).
    cluster.restart("bootstrap", wait_healthy=False)
    up = time.monotonic()
    first = Stream(cluster.api, SHORT_PROMPT, max_tokens=8).start()
    cluster.wait_healthy()
    known_s = time.monotonic() - up
    (outcome,) = wait_all([first])
    assert outcome.is_completed and outcome.text, f"a request at the restart failed: {outcome}"
    print(f"restarted gateway: every node known again {known_s:.2f} s after its READY line")
    assert_fresh_request_succeeds(cluster)
    assert_fresh_request_succeeds(cluster, key_for(prefill), prefill)


def test_client_disconnect_before_the_first_token_frees_every_page(cluster: Cluster) -> None:
    prefill = "prefill-0"
    before = cluster.metric(prefill, "pdserve_prefill_tokens_total")
    stream = Stream(
        cluster.api, long_prompt("case 12a"), max_tokens=16, routing_key=key_for(prefill)
    ).start()
    wait_metric(
        cluster,
        prefill,
        "pdserve_prefill_tokens_total",
        lambda v: v - before >= CHUNK,
        "a chunk prefilled",
    )
    assert stream.num_chunks == 0, stream.outcome
    stream.close()
    [outcome] = wait_all([stream], 10)
    assert outcome.kind == "disconnected", outcome
    assert_no_pages_held(cluster, NODES)
    assert_gateway_idle(cluster)
    assert_fresh_request_succeeds(cluster, key_for(prefill), prefill)


def test_client_disconnect_mid_stream_frees_every_page(cluster: Cluster) -> None:
    stream = Stream(cluster.api, "Story: the harbour at dawn", max_tokens=200).start()
    wait_for(lambda: stream.num_chunks >= 3, 60, "3 chunks streamed")
    assert not stream.is_done and cluster.pages_held("decode-0") > 0, stream.outcome
    stream.close()
    [outcome] = wait_all([stream], 10)
    assert outcome.kind == "disconnected", outcome
    assert_no_pages_held(cluster, NODES)
    assert_gateway_idle(cluster)
    assert_fresh_request_succeeds(cluster)


def test_sigstop_bootstrap_past_two_leases_then_sigcont_serves_at_once(cluster: Cluster) -> None:
    """A gateway paused past its nodes' leases (SIGSTOP here; a CPU-starved or frozen pod in
    a cluster) did not hear them because it was not running, not because they were gone.
    Before: on SIGCONT its lease timer expired every node at once, and a request sent then
    got a 503 "no prefill node is registered" (the chaos run in CI saw one)."""
    streaming = Stream(cluster.api, "Story: the harbour at noon", max_tokens=200).start()
    wait_for(lambda: streaming.num_chunks >= 3, 60, "3 chunks streamed")
    lost_before = metric_or_zero(cluster, "bootstrap", "pdserve_nodes_lost_total")
    cluster.sigstop("bootstrap")
    time.sleep(2 * LEASE_S + 1.0)
    resumed = cluster.sigcont("bootstrap")
    fresh = [Stream(cluster.api, SHORT_PROMPT, max_tokens=8).start() for _ in range(3)]
    for outcome in wait_all(fresh):
        assert outcome.is_completed and outcome.text, f"a request after the pause: {outcome}"
    # The nodes aborted the paused gateway's stream (it was silent past their lease); its
    # client hears an end within the bound, and nothing stays held.
    [outcome] = wait_all([streaming])
    assert outcome.ended is not None and outcome.ended - resumed <= OUTCOME_BOUND_S, outcome
    assert metric_or_zero(cluster, "bootstrap", "pdserve_nodes_lost_total") == lost_before
    assert_no_pages_held(cluster, NODES)
    assert_gateway_idle(cluster)
