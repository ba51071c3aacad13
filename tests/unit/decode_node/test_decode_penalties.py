"""Penalties and min_tokens across the split: the prefill loop samples the first token
with them, the decode loop every later one, with the counts carried over (real loops,
loopback transfer, tiny Llama); outputs equal a single-process run."""

from __future__ import annotations

import pytest

from common import messages as msg
from common.kv_pool import pages_needed
from common.model.runner import ExtendRequest
from common.penalties import PenaltyState
from common.sampler import Sampler
from common.sampling_params import SamplingParams
from tests.support.decode_harness import PD, FakeTokenizer, greedy, prompt


def reference(runner, ids, n, params, eos=()):
    """One request alone: extend, then decode, sampling greedily with its penalties."""
    pages = runner.pool.allocator.allocate(pages_needed(len(ids) + n, runner.page_size))
    try:
        logits = runner.extend([ExtendRequest(ids, 0, pages)]).logits
        state = PenaltyState.for_request(params, runner.spec.vocab_size, "cpu", ids, (), eos)
        out = []
        while True:
            token = Sampler().sample(logits, [params], [None], None, [state]).token_ids[0]
            out.append(token)
            state.accept(token)
            if len(out) == n or (token in eos and len(out) >= params.min_tokens):
                return out
            logits = runner.decode([token], [len(ids) + len(out)], [pages])
    finally:
        runner.pool.allocator.free(pages)


PENALTIES = [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.0, "repetition_penalty": 1.4},
    {"repetition_penalty": 0.7, "frequency_penalty": -0.5},
    {"logit_bias": ((3, 8.0), (11, -100.0)), "presence_penalty": 0.5},
]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_penalised_greedy_outputs_equal_a_single_process_run(model_dir, ref, penalties):
    h = PD(model_dir, decode_pages=28, num_reserved_decode_tokens=4)
    try:
        work = {f"r{i}": prompt(9 + 5 * i, 80 + i) for i in range(4)}
        for i, (rid, ids) in enumerate(work.items()):
            h.submit(rid, 900 + i, ids, max_new_tokens=24, **penalties)
        h.run_until(lambda: h.done(*work), timeout=60)
        params = SamplingParams(max_new_tokens=24, temperature=0.0, **penalties)
        for rid, ids in work.items():
            assert isinstance(h.result(rid), msg.ReqFinished)
            expected = reference(ref, ids, 24, params)
            assert h.tokens(rid) == expected, rid
            assert expected != greedy(ref, ids, 24)  # the penalty changed something
    finally:
        h.close()


def test_min_tokens_holds_back_eos_on_both_nodes(model_dir, ref):
    ids = prompt(11, 91)
    plain = greedy(ref, ids, 6)
    eos = (plain[0], plain[2])  # the first token itself would end the request
    h = PD(model_dir, tokenizer=FakeTokenizer(eos=eos))
    try:
        h.submit("early", 1, ids, max_new_tokens=6)
        h.submit("held", 2, ids, max_new_tokens=6, min_tokens=4)
        h.run_until(lambda: h.done("early", "held"))
        assert h.tokens("early") == [plain[0]]
        params = SamplingParams(max_new_tokens=6, temperature=0.0, min_tokens=4)
        held = h.tokens("held")
        assert held == reference(ref, ids, 6, params, eos)
        assert not set(held[:4]) & set(eos)
    finally:
        h.close()
