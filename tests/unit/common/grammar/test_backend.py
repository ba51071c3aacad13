"""The grammar backend (compile off the loop, cache, timeouts), matchers and the batched mask,
with the built-in model's real tokenizer."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import xgrammar as xgr

from common.grammar.backend import GrammarBackend, GrammarError, GrammarState
from common.grammar.mask import GrammarMasker
from common.model.default_model import default_model_dir
from common.sampler import Sampler
from common.sampling_params import SamplingParams
from common.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # the built-in model's tokenizer (converted once per machine)

VOCAB = 49152
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(default_model_dir())


@pytest.fixture
def backend(tokenizer: Tokenizer):
    b = GrammarBackend.for_tokenizer(tokenizer, VOCAB, timeout_s=5.0)
    yield b
    b.close()


def wait(backend: GrammarBackend, ticket) -> xgr.CompiledGrammar:
    deadline = time.monotonic() + 10
    while (compiled := backend.poll(ticket)) is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return compiled


def test_the_same_grammar_compiles_once(backend: GrammarBackend) -> None:
    first = backend.submit("json_schema", SCHEMA)
    second = backend.submit("json_schema", SCHEMA)
    assert second.future is first.future
    assert wait(backend, first) is wait(backend, second)
    other = backend.submit("regex", "[0-9]+")
    assert other.future is not first.future


def test_a_bad_grammar_fails_its_ticket_with_400(backend: GrammarBackend) -> None:
    ticket = backend.submit("regex", "[a-")
    with pytest.raises(GrammarError) as info:
        wait(backend, ticket)
    assert info.value.status == 400
    assert "Unclosed '['" in str(info.value) and ".cc:" not in str(info.value)


def test_a_slow_compile_times_out_with_500_and_serves_the_next_request(
    tokenizer: Tokenizer,
) -> None:
    now = [0.0]
    backend = GrammarBackend.for_tokenizer(tokenizer, VOCAB, timeout_s=2.0, clock=lambda: now[0])
    release = threading.Event()
    real = backend._compile

    def slow(kind: str, text: str) -> xgr.CompiledGrammar:
        release.wait(10)
        return real(kind, text)

    backend._compile = slow  # type: ignore[method-assign]
    try:
        ticket = backend.submit("regex", "a+")
        assert backend.poll(ticket) is None
        now[0] = 2.5
        with pytest.raises(GrammarError) as info:
            backend.poll(ticket)
        assert info.value.status == 500 and "--grammar-compile-timeout" in str(info.value)
        release.set()
        later = backend.submit("regex", "a+")  # the compile went on: the cache serves it
        assert wait(backend, later) is not None
    finally:
        release.set()
        backend.close()


def test_a_matcher_rebuilt_from_the_tokens_is_in_the_same_state(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    compiled = wait(backend, backend.submit("json_schema", SCHEMA))
    tokens = tokenizer.encode('{"name": "Ada", "age": 3')
    live = GrammarState(compiled)
    for t in tokens:
        assert live.accept(t)
    rebuilt = GrammarState(compiled, tokens)
    masks = xgr.allocate_token_bitmask(2, VOCAB)
    live.matcher.fill_next_token_bitmask(masks, 0)
    rebuilt.matcher.fill_next_token_bitmask(masks, 1)
    assert torch.equal(masks[0], masks[1])
    assert rebuilt.num_accepted == len(tokens)
    with pytest.raises(GrammarError):
        GrammarState(compiled, tokenizer.encode("not json"))


def test_the_sampler_masks_only_grammar_rows(backend: GrammarBackend, tokenizer) -> None:
    compiled = wait(backend, backend.submit("regex", "(yes|no)"))
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    bad = tokenizer.encode("maybe")[0]
    logits[:, bad] = 50.0  # every row's favourite is a token the grammar forbids
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1)] * 2
    plain = Sampler().sample(logits.clone(), params[:3], [None, None, None])
    states = [GrammarState(compiled), None, GrammarState(compiled)]
    gens = [None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    out = Sampler().sample(logits.clone(), params[:3], gens, states)
    assert plain.token_ids[0] == bad and out.token_ids[1] == bad  # row 1 has no grammar
    for row in (0, 2):
        text = tokenizer.decode([out.token_ids[row]])
        assert "yes".startswith(text) or "no".startswith(text), text
        assert states[row].accept(out.token_ids[row])  # type: ignore[union-attr]


def test_a_completed_grammar_allows_only_the_stop_token(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    compiled = wait(backend, backend.submit("ebnf", 'root ::= "ok"'))
    state = GrammarState(compiled, tokenizer.encode("ok"))
    logits = torch.zeros(1, VOCAB)
    out = Sampler().sample(logits, [SamplingParams(temperature=0)], [None], [state])
    assert out.token_ids == [2]  # <|im_end|>, the tokenizer's eos
    assert state.accept(2) and state.is_terminated


def test_the_mask_lands_on_the_right_rows_of_a_transposed_logits_view(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    """A weight-major LM head returns [B, V] as a transposed view; xgrammar's CPU kernel masks
    the wrong entries of such a view (every row's), so the masker works on a contiguous copy."""
    compiled = wait(backend, backend.submit("regex", "(yes|no)"))
    torch.manual_seed(1)
    base = torch.randn(VOCAB, 3)
    states = [GrammarState(compiled), None, GrammarState(compiled)]
    masked = GrammarMasker().apply(base.t(), states)
    allowed = (masked > float("-inf")).sum(dim=-1).tolist()
    assert allowed[1] == VOCAB and 0 < allowed[0] == allowed[2] < 50
    assert torch.equal(masked[1], base.t()[1])


@pytest.mark.parametrize("num_grammar_rows", [1, 8, 32])
def test_the_mask_is_the_same_whichever_kernel_applies_it(
    backend: GrammarBackend, tokenizer: Tokenizer, num_grammar_rows: int
) -> None:
    """Few grammar rows take xgrammar's C++ kernel per row, many its torch kernel over the
    whole batch: the masked logits are equal to a row-by-row reference either way."""
    compiled = wait(backend, backend.submit("json_schema", SCHEMA))
    prefix = tokenizer.encode('{"name": "A')
    states = [
        GrammarState(compiled, prefix[: i % len(prefix)]) if i < num_grammar_rows else None
        for i in range(32)
    ]
    torch.manual_seed(2)
    logits = torch.randn(32, VOCAB)
    expected = logits.clone()
    for i, s in enumerate(states):
        if s is not None:
            row = xgr.allocate_token_bitmask(1, VOCAB)
            s.matcher.fill_next_token_bitmask(row, 0)
            bits = (row[0][torch.arange(VOCAB) // 32] >> (torch.arange(VOCAB) % 32)) & 1
            expected[i][bits == 0] = float("-inf")
    assert torch.equal(GrammarMasker().apply(logits, states), expected)


def test_the_runners_inference_tensors_are_masked_in_place(
    backend: GrammarBackend, tokenizer: Tokenizer
) -> None:
    compiled = wait(backend, backend.submit("regex", "(yes|no)"))
    with torch.inference_mode():
        logits = torch.randn(4, VOCAB)
    masked = GrammarMasker().apply(logits, [GrammarState(compiled)] * 4)
    assert masked is logits and int((logits[0] > float("-inf")).sum()) < 50
