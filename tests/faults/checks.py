"""What each fault case asserts: the outcome in time, no page held, the next request served."""

from __future__ import annotations

import time
from collections.abc import Callable

from bootstrap.router import HashRing, affinity_key
from tests.faults import report
from tests.faults.harness import OUTCOME_BOUND_S, Cluster
from tests.faults.streams import Outcome, Stream, run
from tests.support.waits import wait_for

SHORT_PROMPT = "The capital of France is"
# Longest wait for a stage of a request (a chunk computed, a queue entered) on this machine.
STAGE_TIMEOUT_S = 60.0
# Longest a request that completes may take here (queued behind others on the decode pool).
STREAM_TIMEOUT_S = 90.0


def long_prompt(tag: str, num_words: int = 1990) -> str:
    """About `num_words` + 10 tokens (" word" is one token), unique by `tag`: no cache holds it."""
    return f"{tag}: once upon a time" + " word" * num_words


def key_for(node_id: str, prefill_ids: tuple[str, ...] = ("prefill-0", "prefill-1")) -> str:
    """A routing key whose home on the gateway's ring is `node_id`."""
    ring = HashRing(prefill_ids)
    for i in range(10_000):
        key = f"key-{i}"
        if next(ring.walk(affinity_key([], key))) == node_id:
            return key
    raise AssertionError(f"no routing key lands on {node_id}")


def metric_or_zero(cluster: Cluster, node: str, name: str, **labels: str) -> float:
    try:
        return cluster.metric(node, name, **labels)
    except KeyError:
        return 0.0


def wait_metric(
    cluster: Cluster,
    node: str,
    name: str,
    cond: Callable[[float], bool],
    what: str,
    timeout_s: float = STAGE_TIMEOUT_S,
    **labels: str,
) -> float:
    """Poll a node's metric until `cond(value)`; the value."""
    box: list[float] = [0.0]

    def check() -> bool:
        box[0] = metric_or_zero(cluster, node, name, **labels)
        return cond(box[0])

    wait_for(check, timeout_s, f"{what} ({node} {name}{labels}, last {box[0]})", interval_s=0.03)
    return box[0]


def assert_ended_well(
    outcome: Outcome,
    fault_t: float,
    bound_s: float = OUTCOME_BOUND_S,
    *,
    allow_completed: bool = True,
) -> None:
    """A completed answer, or a clean error at most `bound_s` after the fault: never a hang."""
    report.fault(fault_t, is_the_fault=True)
    assert outcome.ended is not None and outcome.kind != "timeout", f"request hung: {outcome}"
    if allow_completed and outcome.is_completed:
        return
    assert outcome.is_clean_error, f"not a clean error: {outcome}"
    late = outcome.ended - fault_t
    assert late <= bound_s, f"error {late:.2f} s after the fault (bound {bound_s:g} s): {outcome}"


def wait_all(streams: list[Stream], timeout_s: float = STREAM_TIMEOUT_S) -> list[Outcome]:
    """Wait for every stream; one still open after `timeout_s` in all is recorded as a hang."""
    deadline = time.monotonic() + timeout_s
    outcomes = [s.wait(max(0.5, deadline - time.monotonic())) for s in streams]
    for o in outcomes:
        report.outcome(o.kind, o.ended)
    return outcomes


def assert_fresh_request_succeeds(
    cluster: Cluster, routing_key: str | None = None, prefill: str | None = None
) -> None:
    """A new request completes (on `prefill` when given: its prompt counter grows)."""
    before = cluster.metric(prefill, "pdserve_prompt_tokens_total") if prefill else 0.0
    outcome = run(cluster.api, SHORT_PROMPT, max_tokens=8, routing_key=routing_key, timeout_s=60)
    assert outcome.is_completed and outcome.text, f"fresh request failed: {outcome}"
    report.recovered()
    if prefill:
        after = cluster.metric(prefill, "pdserve_prompt_tokens_total")
        assert after > before, f"the fresh request did not go to {prefill}"


def assert_no_pages_held(cluster: Cluster, names: list[str] | None = None) -> float:
    """Every (named or live) node holds no page within the bound; the seconds it took."""
    took = cluster.wait_pages_zero(names)
    targets = cluster.alive_nodes() if names is None else names
    report.pages_zero({n: cluster.pages_held(n) for n in targets})
    return took


def assert_gateway_idle(cluster: Cluster, within_s: float = OUTCOME_BOUND_S) -> None:
    seen: list[float] = []

    def idle() -> bool:
        seen.append(cluster.inflight())
        return seen[-1] == 0

    try:
        wait_for(idle, within_s, "pdserve_gateway_inflight_requests == 0", interval_s=0.1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; values seen: {sorted(set(seen))}") from None
