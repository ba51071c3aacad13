"""Losing or pausing decode: kill -9 in prealloc, mid-transfer, mid-stream; SIGSTOP; SIGTERM."""

from __future__ import annotations

import time

import pytest

from tests.faults.checks import (
    assert_ended_well,
    assert_fresh_request_succeeds,
    assert_gateway_idle,
    assert_no_pages_held,
    key_for,
    long_prompt,
    metric_or_zero,
    wait_all,
    wait_metric,
)
from tests.faults.harness import CHUNK, LEASE_S, SLACK_S, Cluster
from tests.faults.streams import Stream
from tests.support.waits import wait_for

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")

DECODE = "decode-0"
PREFILLS = ["prefill-0", "prefill-1"]
DRAIN_TIMEOUT_S = 2.0
# SIGTERM with a drain timeout: the clients' errors come once the drain gives up.
DRAIN_BOUND_S = DRAIN_TIMEOUT_S + 1.0 + SLACK_S


def wait_chunks(streams: list[Stream], n: int, timeout_s: float = 60.0) -> None:
    wait_for(
        lambda: all(s.num_chunks >= n or s.is_done for s in streams),
        timeout_s,
        f"{n} chunks on every stream",
    )
    done = [str(s.outcome) for s in streams if s.is_done]
    assert not done, f"streams ended before the fault: {done}"


def test_kill9_decode_with_requests_in_prealloc(cluster: Cluster) -> None:
    # ~1000 prompt + 512 reserved tokens each: two fit in decode-0's 4096, the rest wait.
    streams = [
        Stream(cluster.api, long_prompt(f"case 4 #{i}", 1000), max_tokens=8).start()
        for i in range(4)
    ]
    wait_metric(
        cluster,
        DECODE,
        "pdserve_queue_requests",
        lambda v: v >= 1,
        "a request in decode's prealloc queue",
        queue="prealloc",
    )
    fault = cluster.kill9(DECODE)
    outcomes = wait_all(streams)
    for outcome in outcomes:
        assert_ended_well(outcome, fault)
    assert any(not o.is_completed for o in outcomes), [str(o) for o in outcomes]
    assert_no_pages_held(cluster, PREFILLS)
    assert_gateway_idle(cluster)
    cluster.restart(DECODE)
    assert_fresh_request_succeeds(cluster)


def test_kill9_decode_mid_transfer_frees_the_prefill_pages(cluster: Cluster) -> None:
    prefill = "prefill-0"
    before = cluster.metric(prefill, "pdserve_prefill_tokens_total")
    stream = Stream(
        cluster.api, long_prompt("case 5"), max_tokens=16, routing_key=key_for(prefill)
    ).start()
    wait_metric(
        cluster,
        prefill,
        "pdserve_prefill_tokens_total",
        lambda v: v - before >= 2 * CHUNK,
        "two chunks prefilled",
    )
    assert cluster.metric(DECODE, "pdserve_queue_requests", queue="transfer") >= 1
    assert cluster.pages_held(prefill) > 0
    fault = cluster.kill9(DECODE)
    [outcome] = wait_all([stream])
    assert_ended_well(outcome, fault, allow_completed=False)
    assert_no_pages_held(cluster, PREFILLS)
    cluster.restart(DECODE)
    assert_fresh_request_succeeds(cluster)


def test_kill9_decode_mid_stream(cluster: Cluster) -> None:
    streams = [
        Stream(cluster.api, f"Story {i}: the lighthouse", max_tokens=200).start() for i in range(2)
    ]
    wait_chunks(streams, 3)
    fault = cluster.kill9(DECODE)
    for outcome in wait_all(streams):
        assert_ended_well(outcome, fault, allow_completed=False)
        assert outcome.text, outcome  # it had streamed tokens before the error
    assert_no_pages_held(cluster, PREFILLS)
    assert_gateway_idle(cluster)
    cluster.restart(DECODE)
    assert_fresh_request_succeeds(cluster)


def test_sigstop_decode_past_its_lease_then_sigcont(cluster: Cluster) -> None:
    prefill = "prefill-0"
    before = cluster.metric(prefill, "pdserve_prefill_tokens_total")
    streaming = Stream(cluster.api, "Story: the lighthouse keeper", max_tokens=200).start()
    wait_chunks([streaming], 3)
    prefilling = Stream(
        cluster.api, long_prompt("case 8"), max_tokens=16, routing_key=key_for(prefill)
    ).start()
    wait_metric(
        cluster,
        prefill,
        "pdserve_prefill_tokens_total",
        lambda v: v - before >= CHUNK,
        "a chunk prefilled",
    )
    fault = cluster.sigstop(DECODE)
    for outcome in wait_all([streaming, prefilling]):
        assert_ended_well(outcome, fault, allow_completed=False)
    assert_no_pages_held(cluster, PREFILLS)
    time.sleep(max(0.0, fault + LEASE_S + 0.5 - time.monotonic()))
    cluster.sigcont(DECODE)
    # It finds its rooms' leases gone the moment it resumes and frees their pages.
    cluster.wait_pages_zero([DECODE])
    assert_gateway_idle(cluster)
    cluster.wait_healthy()
    assert_fresh_request_succeeds(cluster)


def test_sigterm_decode_under_load_drains_every_stream(cluster: Cluster) -> None:
    streams = [Stream(cluster.api, f"Poem {i}: the sea", max_tokens=40).start() for i in range(3)]
    wait_chunks(streams, 2)
    cluster.sigterm(DECODE)
    for outcome in wait_all(streams):
        assert outcome.is_completed and outcome.finish_reason == "length", outcome
    assert cluster.wait_exit(DECODE, 60) == 0
    assert_no_pages_held(cluster, PREFILLS)
    assert_gateway_idle(cluster)
    cluster.restart(DECODE)
    assert_fresh_request_succeeds(cluster)


def test_sigterm_decode_with_a_short_drain_timeout_fails_streams_cleanly(cluster: Cluster) -> None:
    cluster.restart(DECODE, ["--drain-timeout", str(DRAIN_TIMEOUT_S)])
    streams = [
        Stream(cluster.api, f"Essay {i}: the tides", max_tokens=400).start() for i in range(3)
    ]
    wait_chunks(streams, 2)
    fault = cluster.sigterm(DECODE)
    for outcome in wait_all(streams):
        assert_ended_well(outcome, fault, DRAIN_BOUND_S, allow_completed=False)
    assert_gateway_idle(cluster)
    cluster.wait_exit(DECODE, DRAIN_BOUND_S + 10)
    assert_no_pages_held(cluster, PREFILLS)
    cluster.restart(DECODE)  # without the flag again
    assert_fresh_request_succeeds(cluster)


def test_kill9_decode_holding_a_cached_prefix_for_an_incoming_partial_transfer(
    cluster: Cluster,
) -> None:
    """decode-0 with a prefix cache holds a conversation's first turn; its next turn locks
    that prefix and waits for the rest from prefill-0 when decode-0 is killed. The client
    gets a clear error in bounded time (no other decode node to move to), prefill-0 frees
    the room's pages, and the restarted node serves a fresh request."""
    prefill = "prefill-0"
    key = key_for(prefill)
    try:
        first = long_prompt("cached turn", 600)
        [turn1] = wait_all([Stream(cluster.api, first, max_tokens=8, routing_key=key).start()])
        assert turn1.is_completed, turn1
        hits = metric_or_zero(cluster, DECODE, "pdserve_prefix_cache_hit_tokens_total")
        before = cluster.metric(prefill, "pdserve_prefill_tokens_total")
        # The next turn: the same start, then a long new message that takes several chunks.
        second = first + turn1.text + " and then" + " more" * 1500
        stream = Stream(cluster.api, second, max_tokens=16, routing_key=key).start()
        wait_metric(
            cluster,
            DECODE,
            "pdserve_prefix_cache_hit_tokens_total",
            lambda v: v - hits >= CHUNK,
            "the first turn's pages found in decode-0's cache",
        )
        wait_metric(
            cluster,
            prefill,
            "pdserve_prefill_tokens_total",
            lambda v: v - before >= 2 * CHUNK,
            "two chunks of the next turn prefilled",
        )
        assert cluster.metric(DECODE, "pdserve_queue_requests", queue="transfer") >= 1
        fault = cluster.kill9(DECODE)
        [outcome] = wait_all([stream])
        assert_ended_well(outcome, fault, allow_completed=False)
        assert_no_pages_held(cluster, PREFILLS)
    finally:
        cluster.restart(DECODE)
    assert_fresh_request_succeeds(cluster)
