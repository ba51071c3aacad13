"""Fencing: a prefill node paused past two leases writes into no page its room no longer owns."""

from __future__ import annotations

import random
import time

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
from tests.faults.harness import CHUNK, LEASE_S, Cluster
from tests.faults.streams import Outcome, Stream, run
from tests.support.tolerance import FLOAT32_REL, assert_close_scaled
from tests.support.waits import wait_for

pytestmark = pytest.mark.slow
pytest.importorskip("nixl._api", reason="NIXL is not installed")

PAUSED, HEALTHY, DECODE = "prefill-0", "prefill-1", "decode-0"
# ~1400 tokens of varied text: its KV differs from the paused request's at every position,
# and it fills decode-0's lowest pages, where the paused request's later chunks were to go.
_WORDS = ("harbour", "lamp", "storm", "keeper", "gull", "rope", "tide", "beacon", "fog", "stone")
_RNG = random.Random(7)
VICTIM_PROMPT = "Log of the lighthouse: " + " ".join(_RNG.choice(_WORDS) for _ in range(1400))
VICTIM_TOKENS = 48
LATE = "pdserve_kv_late_writes_total"


def victim(cluster: Cluster) -> Stream:
    return Stream(
        cluster.api,
        VICTIM_PROMPT,
        max_tokens=VICTIM_TOKENS,
        logprobs=1,
        routing_key=key_for(HEALTHY),
    )


def assert_same_generation(got: Outcome, expected: Outcome) -> None:
    assert got.is_completed, got
    assert got.tokens == expected.tokens, (got.text, expected.text)
    assert_close_scaled(got.token_logprobs, expected.token_logprobs, FLOAT32_REL)


def test_sigstop_prefill_past_two_leases_writes_nothing_stale(cluster: Cluster) -> None:
    # The reference, twice: the second served from prefill-1's radix cache, as the victim will be.
    first = victim(cluster).start().wait(90)
    reference = victim(cluster).start().wait(90)
    assert first.is_completed and len(reference.token_logprobs) == VICTIM_TOKENS, reference
    assert reference.tokens == first.tokens

    late_before = {n: metric_or_zero(cluster, n, LATE) for n in (PAUSED, HEALTHY, DECODE)}
    before = cluster.metric(PAUSED, "pdserve_prefill_tokens_total")
    paused = Stream(
        cluster.api, long_prompt("case 7"), max_tokens=16, routing_key=key_for(PAUSED)
    ).start()
    wait_metric(
        cluster,
        PAUSED,
        "pdserve_prefill_tokens_total",
        lambda v: v - before >= 2 * CHUNK,
        "two chunks prefilled",
    )
    assert cluster.metric(DECODE, "pdserve_queue_requests", queue="transfer") >= 1
    fault = cluster.sigstop(PAUSED)
    [outcome] = wait_all([paused])
    # Its prefill node is lost to the gateway once its lease runs out: it moves to the
    # healthy prefill node (migration) and completes.
    assert_ended_well(outcome, fault)
    assert outcome.is_completed, outcome
    assert_no_pages_held(cluster, [HEALTHY, DECODE])  # the room's pages are free again (fenced)
    time.sleep(max(0.0, fault + 2 * LEASE_S + 0.5 - time.monotonic()))

    # The victim gets the freed pages; the paused node wakes while it decodes from them.
    stream = victim(cluster).start()
    wait_for(lambda: stream.num_chunks >= 1 or stream.is_done, 60, "the victim's first token")
    cluster.sigcont(PAUSED)
    got = stream.wait(90)
    assert_same_generation(got, reference)
    # A write that may have landed after its fence is one the fence let through.
    assert {n: metric_or_zero(cluster, n, LATE) for n in late_before} == late_before

    assert_no_pages_held(cluster, [PAUSED, HEALTHY, DECODE])
    cluster.wait_healthy()
    assert_fresh_request_succeeds(cluster, key_for(PAUSED), PAUSED)
    assert_same_generation(
        run(
            cluster.api,
            VICTIM_PROMPT,
            max_tokens=VICTIM_TOKENS,
            logprobs=1,
            routing_key=key_for(HEALTHY),
            timeout_s=90,
        ),
        reference,
    )
