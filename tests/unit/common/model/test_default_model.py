"""The built-in SmolLM2 default: GGUF conversion and greedy output equal to transformers'."""

from __future__ import annotations

import pytest
import torch

from common.kv_pool import pages_needed
from common.model.cpu.gemm import PACKED, PANELS, ROW_MAJOR, WEIGHT_MAJOR, KernelChooser
from common.model.default_model import default_gguf_path, default_model_dir
from common.model.runner import ExtendRequest, ModelRunner
from common.model.spec import ModelSpec

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir()))


def _greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    pages = runner.pool.allocator.allocate(pages_needed(len(prompt) + n, runner.page_size))
    try:
        logits = runner.extend([ExtendRequest(prompt, 0, pages)]).logits
        out = [int(logits[0].argmax())]
        while len(out) < n:
            logits = runner.decode([out[-1]], [len(prompt) + len(out)], [pages])
            out.append(int(logits[0].argmax()))
        return out
    finally:
        runner.pool.allocator.free(pages)


def test_converted_config_matches_the_gguf():
    spec = ModelSpec.from_dir(default_model_dir())
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert (spec.head_dim, spec.vocab_size, spec.rope_theta) == (64, 49152, 100000.0)
    assert spec.tie_word_embeddings and spec.context_length == 8192
    # A second call reuses the cache instead of converting again.
    assert default_model_dir() == default_model_dir()


def test_greedy_equals_transformers_on_the_gguf(tokenizer):
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    ref.eval()
    # Greedy for exactly NEW_TOKENS: no stop at EOS and no EOS suppression on either side.
    ref.generation_config.eos_token_id = None
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=1024)
    model = runner.model
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        with torch.no_grad():
            expect = ref.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2
            )[0, len(ids) :].tolist()
        assert len(expect) == NEW_TOKENS
        assert _greedy(runner, ids, NEW_TOKENS) == expect
    # Whichever product kernel the runner settles on (common.model.cpu.gemm), the same tokens:
    # each kernel alone on the chat prompt (the last one).
    # (panels: the float32 panel product where the CPU has AVX-512, row_major elsewhere)
    for kernel in (ROW_MAJOR, WEIGHT_MAJOR, PACKED, PANELS):
        model.chooser, model.head_chooser = KernelChooser((kernel,)), KernelChooser((kernel,))
        assert _greedy(runner, ids, NEW_TOKENS) == expect, kernel
    assert runner.pool.allocator.num_used_pages == 0


def test_offline_generation_cuts_at_a_stop_string():
    from common.launch.offline import OfflineResult, generate_stream
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(default_model_dir())
    runner = ModelRunner.from_path(None, progress=False, max_total_tokens=512)
    ids = tok.apply_chat_template([{"role": "user", "content": "Count from one to ten in words."}])
    full = list(generate_stream(runner, tok, ids, SamplingParams(max_new_tokens=40, temperature=0)))
    free_text = full[-1].text
    assert isinstance(full[-1], OfflineResult) and len(free_text) > 20
    stop = free_text[10:14]
    items = list(
        generate_stream(
            runner, tok, ids, SamplingParams(max_new_tokens=40, temperature=0, stop=(stop,))
        )
    )
    result = items[-1]
    assert result.finish_reason.kind.value == "stop" and result.finish_reason.matched == stop
    assert result.text == free_text[: free_text.index(stop)]
    assert "".join(items[:-1]) == result.text
    assert runner.pool.allocator.num_used_pages == 0
