"""The decode and prefill loops under faults.

A dead gateway, a lost prefill node, a late write, the drain timeout.
"""

from __future__ import annotations

import pytest

from common import messages as msg
from decode_node.req import DecodeState
from tests.support.decode_harness import PD, assert_all_free, prompt


@pytest.fixture
def h(model_dir):
    pd = PD(model_dir)
    yield pd
    pd.close()


def test_requests_of_a_gateway_that_is_gone_are_aborted_on_both_nodes(h):
    alive = {"g1": True, "g2": True}
    for sched in (h.decode, h.prefill):
        sched.gateway_watch.is_alive = lambda gid, now: alive.get(gid, False)
        sched.gateway_watch.interval_s = 0.0  # the tiny model decodes 200 tokens in 0.25 s
        sched.gateway_watch.heard_grace_s = 0.0  # else a request counts as word for 2 s
    h.submit("orphan", 1, prompt(9, 1), gateway_id="g1", max_new_tokens=200)
    h.submit("queued", 2, prompt(40, 2), gateway_id="g1", max_new_tokens=200)
    h.submit("kept", 3, prompt(9, 3), gateway_id="g2", max_new_tokens=12)
    h.run_until(lambda: h.state("orphan") is DecodeState.RUNNING)
    alive["g1"] = False  # its gateway was killed: nobody reads these tokens any more
    h.run_until(lambda: h.done("orphan", "queued", "kept"))
    for rid in ("orphan", "queued"):
        assert isinstance(h.result(rid), msg.ReqFailed), (rid, h.replies[rid][-3:])
        assert "gateway is gone" in h.result(rid).error
    assert isinstance(h.result("kept"), msg.ReqFinished)
    assert len(h.tokens("orphan")) < 200
    h.run_until(lambda: h.decode.is_idle() and not h.prefill.states)
    assert_all_free(h)


def test_a_request_naming_a_lost_prefill_node_fails_fast_and_holds_nothing(h):
    h.is_prefill_paused = True  # the handshake never completes: the request sits in prealloc
    h.submit("r", 1, prompt(9, 1))
    h.run_until(lambda: h.state("r") is DecodeState.PREALLOC)
    free = h.runner.pool.allocator.num_free_pages
    h.known_prefill_nodes.discard("p")  # the registry declared it lost
    h.step()
    assert "r" not in h.decode.reqs  # failed in that very step, before any page was given
    h.run_until(lambda: h.done("r"))  # the reply crosses a socket
    assert isinstance(h.result("r"), msg.ReqFailed) and h.result("r").status == 503
    assert "lost" in h.result("r").error
    assert h.runner.pool.allocator.num_free_pages == free and h.decode.stats.num_held_pages() == 0


def test_a_late_write_fails_every_other_request_holding_its_pages(h):
    h.submit("victim", 1, prompt(9, 1), max_new_tokens=200)
    h.submit("bystander", 2, prompt(9, 2), max_new_tokens=200)
    h.run_until(lambda: all(h.state(r) is DecodeState.RUNNING for r in ("victim", "bystander")))
    pages = list(h.decode.reqs["victim"].pages[:2])
    # A paused prefill node reports that its write of an older room (77) may have landed
    # after the fence, in pages the victim now holds.
    h.pkv.send(
        h.dkv.control_endpoint,
        msg.LateWrite(
            node_id=h.pkv.node_id, instance_id=h.pkv.instance_id, room=77, dst_pages=pages
        ),
    )
    h.run_until(lambda: h.done("victim"))
    assert isinstance(h.result("victim"), msg.ReqFailed) and h.result("victim").status == 500
    assert "KV integrity" in h.result("victim").error
    assert h.state("bystander") is DecodeState.RUNNING
    assert h.dkv.metrics.num_late_writes == 1


def test_the_drain_timeout_fails_what_is_left_with_a_clean_error(h):
    h.submit("a", 1, prompt(9, 1), max_new_tokens=200)
    h.submit("b", 2, prompt(9, 2), max_new_tokens=200)
    h.run_until(lambda: h.state("a") is DecodeState.RUNNING)
    h.decode.fail_all(503, "the decode node is shutting down (drain timeout)")
    h.prefill.fail_all(503, "the prefill node is shutting down (drain timeout)")
    h.run_until(lambda: h.done("a", "b") and h.decode.is_idle())
    for rid in ("a", "b"):
        assert isinstance(h.result(rid), msg.ReqFailed) and h.result(rid).status == 503
    assert_all_free(h)


def test_an_exception_in_one_request_fails_it_and_the_nodes_serve_on(h, monkeypatch):
    """Isolation: a bug hit by one request's input fails that request (500), nothing else."""
    sampler = h.prefill.sampler
    real_sample = sampler.sample

    def sample(logits, params, generators, grammars=None, penalties=None):
        if params[0].seed == 13:  # the poisoned request
            raise OverflowError("sampling blew up")
        return real_sample(logits, params, generators, grammars, penalties)

    monkeypatch.setattr(sampler, "sample", sample)
    import decode_node.scheduler as dsched

    real_build = dsched.build_request

    def build(g, *args):
        if g.rid == "bad-decode":
            raise ValueError("building blew up")
        return real_build(g, *args)

    monkeypatch.setattr(dsched, "build_request", build)
    h.submit("bad-prefill", 1, prompt(9, 1), seed=13)
    h.submit("bad-decode", 2, prompt(9, 2))
    h.submit("good", 3, prompt(9, 3), max_new_tokens=6)
    h.run_until(lambda: h.done("bad-prefill", "bad-decode", "good"))
    for rid in ("bad-prefill", "bad-decode"):
        result = h.result(rid)
        assert isinstance(result, msg.ReqFailed) and result.status == 500, result
        assert "internal error" in result.error
    assert isinstance(h.result("good"), msg.ReqFinished) and len(h.tokens("good")) == 6
    # On a ReqFailed the gateway aborts the request on both nodes.
    h.decode.abort("bad-prefill", None, "failed elsewhere")
    h.prefill.abort("bad-decode", None, "failed elsewhere")
    h.run_until(lambda: h.decode.is_idle() and not h.prefill.states)
    assert_all_free(h)
