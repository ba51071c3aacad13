"""bfloat16 against float32 on the built-in SmolLM2, over the model bench's prompts.

The float32 reference is our runner, which test_default_model holds equal to transformers'
float32. Two measures (bench/model_runner.py prints both, for transformers' bfloat16 too):

Teacher-forced, the stable one: both dtypes are fed float32's greedy continuation (32
tokens) and their next-token choices and distributions compared at every step. On an AMX
Xeon ours matched float32's choice at 98.0-99.4% of the 512 steps with a mean KL of 0.0010,
with and without the C kernels alike; a broken bfloat16 path (a wrong cast, a bad
accumulation) moves KL by orders of magnitude and the choices by more than a few percent.
Bars: 95% and KL 0.005, room for CPUs without native bf16, whose emulated kernels round
differently.

Free-running greedy, the one users see: greedy continuations part for good once two logits
come within bfloat16's rounding (8 bits of mantissa), so whole matches swing with any
rounding change: 7-11 of 16 prompts across our kernel variants of equal teacher-forced
accuracy (transformers' bfloat16: 11/16; first token 16/16 and a mean common prefix of
24.4-26.9 tokens for all). Bars: 14/16 first tokens, 4/16 whole, a mean prefix of 16.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from common.model.default_model import default_model_dir
from common.model.runner import ModelRunner
from common.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PROMPTS_MODULE = Path(__file__).resolve().parents[4] / "bench" / "greedy_prompts.py"
NEW_TOKENS = 32
MIN_FIRST_TOKEN = 14 / 16
MIN_ALL_TOKENS = 4 / 16
MIN_MEAN_COMMON_PREFIX = 16.0
MIN_FORCED_ARGMAX_MATCH = 0.95
MAX_FORCED_KL = 0.005


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
    outs, forced = {}, {}
    reference: list[list[int]] = []
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner.from_path(None, progress=False, dtype=dtype, max_total_tokens=4096)
        outs[dtype] = gp.greedy(runner, prompts, NEW_TOKENS)
        reference = reference or outs[dtype]
        forced[dtype] = gp.forced_logits(runner, prompts, reference)
        assert runner.pool.allocator.num_used_pages == 0
        assert all(len(o) == NEW_TOKENS for o in outs[dtype])
    score = gp.agreement(outs["float32"], outs["bfloat16"])
    assert score["first_token"] >= MIN_FIRST_TOKEN, score
    assert score["all_tokens"] >= MIN_ALL_TOKENS, score
    assert score["mean_common_prefix"] >= MIN_MEAN_COMMON_PREFIX, score
    teacher = gp.forced_agreement(forced["float32"], forced["bfloat16"])
    assert teacher["argmax_match"] >= MIN_FORCED_ARGMAX_MATCH, teacher
    assert teacher["kl"] <= MAX_FORCED_KL, teacher
    # and float32 forced along its own greedy path picks exactly that path
    assert all(f.argmax(-1).tolist() == o for f, o in zip(forced["float32"], outs["float32"]))


def test_agreement_counts_first_tokens_whole_continuations_and_common_prefixes():
    gp = _prompts_module()
    ref = [[1, 2, 3], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    got = [[1, 2, 3], [1, 2, 0], [0, 5, 6], [7, 8, 9]]
    assert gp.agreement(ref, got) == {
        "first_token": 0.75,
        "all_tokens": 0.5,
        "mean_common_prefix": (3 + 2 + 0 + 3) / 4,
    }


def test_forced_agreement_compares_choices_and_distributions_step_by_step():
    import torch

    gp = _prompts_module()
    ref = [torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]])]
    same = gp.forced_agreement(ref, ref)
    assert same["argmax_match"] == 1.0 and abs(same["kl"]) < 1e-7
    flipped = gp.forced_agreement(ref, [torch.tensor([[2.0, 0.0, 0.0], [3.0, 0.0, 0.0]])])
    assert flipped["argmax_match"] == 0.5 and flipped["kl"] > 0.5
