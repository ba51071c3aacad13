"""bfloat16 against float32 on the built-in SmolLM2: greedy agreement over the model bench's prompts.

The float32 reference is our runner, which test_default_model holds equal to transformers'
float32. Thresholds, from bench/model_runner.py on an AMX Xeon (16 prompts, 32 tokens):
ours in bfloat16 matched float32 at the first token on 16/16 prompts and over all 32 on
11/16 (mean common prefix 26.9 tokens); transformers' own bfloat16 scored the same (16/16,
11/16, 26.8). Greedy continuations part once two logits come within bfloat16's rounding
(8 bits of mantissa), so whole-continuation matches are not all expected, and on a CPU
without native bf16 the emulated kernels round differently: the bars leave room for that
and still catch a broken bfloat16 path (a wrong cast or accumulation flips first tokens
and parts continuations within a few tokens).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from common.model.default_model import default_model_dir
from common.model.runner import ModelRunner
from common.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PROMPTS_MODULE = Path(__file__).resolve().parents[2] / "bench" / "greedy_prompts.py"
NEW_TOKENS = 32
MIN_FIRST_TOKEN = 14 / 16
MIN_ALL_TOKENS = 6 / 16
MIN_MEAN_COMMON_PREFIX = 16.0


def _prompts_module():
    spec = importlib.util.spec_from_file_location("greedy_prompts", PROMPTS_MODULE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bfloat16_greedy_agrees_with_float32_over_the_bench_prompts():
    gp = _prompts_module()
    prompts = gp.chat_ids(Tokenizer.from_pretrained(default_model_dir()))
    assert len(prompts) == 16
    outs = {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner.from_path(None, progress=False, dtype=dtype, max_total_tokens=4096)
        outs[dtype] = gp.greedy(runner, prompts, NEW_TOKENS)
        assert runner.pool.allocator.num_used_pages == 0
        assert all(len(o) == NEW_TOKENS for o in outs[dtype])
    score = gp.agreement(outs["float32"], outs["bfloat16"])
    assert score["first_token"] >= MIN_FIRST_TOKEN, score
    assert score["all_tokens"] >= MIN_ALL_TOKENS, score
    assert score["mean_common_prefix"] >= MIN_MEAN_COMMON_PREFIX, score


def test_agreement_counts_first_tokens_whole_continuations_and_common_prefixes():
    gp = _prompts_module()
    ref = [[1, 2, 3], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    got = [[1, 2, 3], [1, 2, 0], [0, 5, 6], [7, 8, 9]]
    assert gp.agreement(ref, got) == {"first_token": 0.75, "all_tokens": 0.5,
                                      "mean_common_prefix": (3 + 2 + 0 + 3) / 4}
