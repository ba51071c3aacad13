"""A migrated request on the real prefill and decode loops (one process, loopback KV): given
the output the client already has (GenerateReq.output_ids), the pair goes on from there and
the whole output equals the unmigrated one, greedy, seeded or under a grammar."""

from __future__ import annotations

from common import messages as msg
from common.grammar.backend import GrammarState
from tests.support.decode_harness import (
    PD,
    SMALL_CHUNKS,
    FakeTokenizer,
    assert_all_free,
    greedy,
    prompt,
)
from tests.unit.decode_node.test_decode_grammar import (
    EOS,
    REGEX,
    compiled,
    greedy_under,
    tiny_backend,
    with_grammar,
)


def test_greedy_output_goes_on_from_any_point_across_chunks_and_retractions(model_dir, ref):
    # 17 + 16 tokens each in 14 pages of 4: retractions; 8-token prefill chunks.
    h = PD(model_dir, decode_pages=14, num_reserved_decode_tokens=4, prefill_cfg=SMALL_CHUNKS)
    try:
        ids = {k: prompt(17, 50 + k) for k in (0, 1, 6, 12)}
        full = {k: greedy(ref, ids[k], 16) for k in ids}
        for k in ids:  # not migrated, after the first token, mid-way, near the end
            h.submit(f"m{k}", 300 + k, ids[k], max_new_tokens=16, output_ids=full[k][:k])
        h.run_until(lambda: h.done(*(f"m{k}" for k in ids)), timeout=60)
        assert h.decode.stats.num_retractions > 0
        for k in ids:
            assert h.tokens(f"m{k}") == full[k][k:], k
            end = h.result(f"m{k}")
            assert isinstance(end, msg.ReqFinished) and end.finish_reason == "length"
            # usage counts the tokens before the migration as output, the prompt once
            assert (end.num_prompt_tokens, end.num_output_tokens) == (17, 16)
        assert_all_free(h)
    finally:
        h.close()


def test_seeded_sampling_goes_on_with_the_same_sequence(pd):
    ids = prompt(13, 8)
    sampling = {"temperature": 1.0, "seed": 1234, "max_new_tokens": 10}
    pd.submit("whole", 1, ids, **sampling)
    pd.run_until(lambda: pd.done("whole"))
    whole = pd.tokens("whole")
    assert len(whole) == 10
    pd.submit("again", 2, ids, **sampling)
    pd.submit("moved", 3, ids, output_ids=whole[:4], **sampling)
    pd.submit("other_seed", 4, ids, **{**sampling, "seed": 99})
    pd.run_until(lambda: pd.done("again", "moved", "other_seed"))
    assert pd.tokens("again") == whole
    assert pd.tokens("moved") == whole[4:]
    assert pd.tokens("other_seed") != whole  # the draws do depend on the seed


def test_a_grammar_goes_on_from_the_tokens_so_far(model_dir, ref):
    backend = tiny_backend()
    h = with_grammar(PD(model_dir, tokenizer=FakeTokenizer(eos=(EOS,))), backend)
    try:
        ids = prompt(17, 40)
        full = greedy_under(ref, ids, 16, GrammarState(compiled(backend, "regex", REGEX)))
        assert len(full) > 4
        h.submit("moved", 1, ids, max_new_tokens=16, regex=REGEX, output_ids=full[:3])
        h.run_until(lambda: h.done("moved"), timeout=60)
        assert h.tokens("moved") == full[3:]
        assert_all_free(h)
    finally:
        h.close()
        backend.close()


def test_output_that_already_reached_max_new_tokens_is_refused(pd):
    ids = prompt(9, 3)
    pd.submit("over", 5, ids, max_new_tokens=4, output_ids=[7, 8, 9, 10])
    pd.run_until(lambda: pd.done("over"))
    end = pd.result("over")
    assert isinstance(end, msg.ReqFailed) and end.status == 400 and not end.retryable
    assert "max_new_tokens" in end.error
    pd.run_until(lambda: pd.decode.is_idle() and pd.prefill.stats.num_held_pages() == 0)
