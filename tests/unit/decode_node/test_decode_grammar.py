"""Grammars across the split in one process: the real prefill and decode loops, loopback KV
transfer, the tiny Llama, and a 160-token vocabulary where token i reads chr(97 + i % 26)."""

from __future__ import annotations

import threading
import time

import xgrammar as xgr

from common import messages as msg
from common.grammar.backend import GrammarBackend, GrammarState
from common.kv_pool import pages_needed
from common.model.runner import ExtendRequest, ModelRunner
from common.sampler import Sampler
from common.sampling_params import SamplingParams
from decode_node.req import DecodeState
from prefill_node.req_state import PrefillState
from tests.support.decode_harness import (
    PD,
    SMALL_CHUNKS,
    FakeTokenizer,
    UnsafeReceiver,
    assert_all_free,
    greedy,
    prompt,
)

VOCAB = 160
EOS = 0
# Letters only, ending with "z" twice: the tiny model's favourite tokens are mostly refused.
REGEX = "[a-e]{3,12}zz"


def tiny_backend(**kwargs) -> GrammarBackend:
    vocab = [chr(97 + i % 26) for i in range(VOCAB)]
    info = xgr.TokenizerInfo(vocab, vocab_size=VOCAB, stop_token_ids=[EOS])
    return GrammarBackend(info, **kwargs)


def with_grammar(h: PD, backend: GrammarBackend) -> PD:
    h.prefill.grammar = backend
    h.decode.grammar = backend
    return h


def compiled(backend: GrammarBackend, kind: str, text: str) -> xgr.CompiledGrammar:
    ticket = backend.submit(kind, text)
    while (result := backend.poll(ticket)) is None:
        time.sleep(0.001)
    return result


def greedy_under(runner: ModelRunner, ids: list[int], n: int, grammar: GrammarState) -> list[int]:
    """The single-process reference: one extend, then decode, each token under the grammar."""
    pages = runner.pool.allocator.allocate(pages_needed(len(ids) + n, runner.page_size))
    sampler, params = Sampler(), [SamplingParams(temperature=0)]
    try:
        logits = runner.extend([ExtendRequest(ids, 0, pages)]).logits
        out: list[int] = []
        while True:
            token = sampler.sample(logits, params, [None], [grammar]).token_ids[0]
            assert grammar.accept(token)
            out.append(token)
            if grammar.is_terminated or len(out) == n:
                return out
            logits = runner.decode([token], [len(ids) + len(out)], [pages])
    finally:
        runner.pool.allocator.free(pages)


def text_of(tokens: list[int]) -> str:
    return "".join(chr(97 + t % 26) for t in tokens if t != EOS)


def test_grammar_outputs_equal_the_reference_across_chunks_and_retractions(model_dir, ref):
    backend = tiny_backend()
    # 3 requests of 17 + up to 16 tokens in a pool of 14 pages: retractions; 8-token chunks.
    h = with_grammar(
        PD(
            model_dir,
            decode_pages=14,
            num_reserved_decode_tokens=4,
            tokenizer=FakeTokenizer(eos=(EOS,)),
            prefill_cfg=SMALL_CHUNKS,
        ),
        backend,
    )
    try:
        prompts = {f"r{i}": prompt(17, 30 + i) for i in range(3)}
        for i, (rid, ids) in enumerate(prompts.items()):
            h.submit(rid, 200 + i, ids, max_new_tokens=16, regex=REGEX)
        # A retraction on purpose, not by the timing of the transfers: once r1 (15 tokens
        # under the grammar) runs, pages of a failed room take the rest of the pool, so its
        # next page retracts a request; they come back once one is retracted.
        h.run_until(lambda: h.state("r1") is DecodeState.RUNNING, timeout=60)
        held = UnsafeReceiver()
        h.decode.release_queue.add(
            held, h.decode.allocator.allocate(h.decode.allocator.num_free_pages)
        )
        h.run_until(lambda: h.decode.stats.num_retractions > 0, timeout=60)
        held.is_safe = True
        h.run_until(lambda: h.done(*prompts), timeout=60)
        assert held.is_cleared
        grammar = compiled(backend, "regex", REGEX)
        for rid, ids in prompts.items():
            tokens = h.tokens(rid)
            assert tokens == greedy_under(ref, ids, 16, GrammarState(grammar)), rid
            end = h.result(rid)
            assert isinstance(end, msg.ReqFinished)
            if end.finish_reason == "stop":  # the grammar ended it: eos was the only choice
                assert tokens[-1] == EOS and end.matched_stop == EOS
                assert xgr.testing._is_grammar_accept_string(  # type: ignore[attr-defined]
                    xgr.Grammar.from_regex(REGEX), text_of(tokens)
                )
        assert_all_free(h)
    finally:
        h.close()
        backend.close()


def test_a_grammar_that_does_not_compile_fails_its_request_alone(model_dir, ref):
    backend = tiny_backend()
    h = with_grammar(PD(model_dir), backend)
    try:
        h.submit("bad", 1, prompt(9, 1), regex="[a-")
        h.submit("good", 2, prompt(9, 2), max_new_tokens=6)
        h.run_until(lambda: h.done("bad", "good"))
        # The first end is the answer (the gateway ignores later ones): the decode node's.
        # The prefill node, whose transfer the decode node aborted, may report it as well;
        # on a loaded machine that report came within the same step.
        bad = h.first_result("bad")
        assert isinstance(bad, msg.ReqFailed) and bad.status == 400
        assert "invalid regex" in bad.error and "Unclosed" in bad.error
        assert isinstance(h.result("good"), msg.ReqFinished)
        assert h.tokens("good") == greedy(ref, prompt(9, 2), 6)
        # The gateway aborts a failed request on both nodes (the prefill node may still be
        # waiting for the decode node's handshake); the decode node's pages wait in the
        # release queue until the prefill side acks.
        h.prefill.abort("bad", None, "failed on the decode node")
        h.run_until(lambda: h.decode.is_idle() and not h.prefill.states)
        assert_all_free(h)
    finally:
        h.close()
        backend.close()


def test_requests_wait_for_a_slow_compile_then_time_out_alone(model_dir):
    now = [0.0]
    backend = tiny_backend(timeout_s=5.0, clock=lambda: now[0])
    release = threading.Event()
    real = backend._compile

    def slow(kind: str, text: str) -> xgr.CompiledGrammar:
        if text == "slow+":
            release.wait(30)
        return real(kind, text)

    backend._compile = slow  # type: ignore[method-assign]
    h = with_grammar(PD(model_dir), backend)
    try:
        h.submit("slow", 1, prompt(9, 3), regex="slow+")
        h.submit("plain", 2, prompt(9, 4), max_new_tokens=4)
        h.run_until(lambda: h.done("plain"))
        assert h.prefill.states["slow"].state is PrefillState.GRAMMAR
        h.prefill.check_integrity()
        assert h.state("slow") is DecodeState.PREALLOC or h.state("slow") is DecodeState.TRANSFER
        now[0] = 6.0
        h.run_until(lambda: h.done("slow"))
        end = h.result("slow")
        assert isinstance(end, msg.ReqFailed) and end.status == 500
        assert "--grammar-compile-timeout" in end.error
        release.set()
        h.run_until(lambda: h.decode.is_idle() and not h.prefill.states)
        assert_all_free(h)
    finally:
        release.set()
        h.close()
        backend.close()


def test_a_node_without_a_grammar_backend_refuses_grammars(model_dir):
    h = PD(model_dir)
    try:
        h.submit("g", 1, prompt(9, 5), json_schema='{"type": "object"}')
        h.run_until(lambda: h.done("g"))
        end = h.result("g")
        assert isinstance(end, msg.ReqFailed) and end.status == 400
        assert "--grammar-backend none" in end.error
        assert_all_free(h)
    finally:
        h.close()


def test_stop_strings_max_tokens_and_ignore_eos_under_a_grammar(model_dir, ref):
    backend = tiny_backend()
    h = with_grammar(PD(model_dir, tokenizer=FakeTokenizer(eos=(EOS,))), backend)
    try:
        ids = prompt(11, 9)
        h.submit("stop", 1, ids, max_new_tokens=16, regex=REGEX, stop=["z"])
        h.submit("cut", 2, ids, max_new_tokens=2, regex=REGEX)
        h.submit("eos", 3, ids, max_new_tokens=16, regex=REGEX, ignore_eos=True)
        h.run_until(lambda: h.done("stop", "cut", "eos"))
        full = greedy_under(ref, ids, 16, GrammarState(compiled(backend, "regex", REGEX)))
        assert full[-1] == EOS and text_of(full).endswith("zz")
        stop = h.result("stop")  # the stop string inside the grammar's text ends it there
        assert isinstance(stop, msg.ReqFinished) and stop.finish_reason == "stop"
        assert stop.matched_stop == "z" and h.tokens("stop") == full[: len(h.tokens("stop"))]
        cut = h.result("cut")
        assert isinstance(cut, msg.ReqFinished) and cut.finish_reason == "length"
        assert h.tokens("cut") == full[:2]
        eos = h.result("eos")  # a complete grammar ends the request even under ignore_eos
        assert isinstance(eos, msg.ReqFinished) and eos.finish_reason == "stop"
        assert h.tokens("eos") == full and eos.matched_stop == EOS
        assert_all_free(h)
    finally:
        h.close()
        backend.close()
