"""The CUDA path of the model runner, whole: Triton attention over the pages and the Triton
fused steps, against transformers on the tiny Llama and Qwen2. On CUDA where torch sees a GPU,
else on CPU tensors in Triton's interpreter (so CI runs the code a GPU runs)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported
pytest.importorskip("triton")

from common.kv_pool import pages_needed  # noqa: E402
from common.model.cuda_graph import DecodeGraphs  # noqa: E402
from common.model.runner import ExtendRequest, ModelRunner  # noqa: E402
from tests.unit.common.model.test_model_runner import _prompt, _ref_logits, _save_tiny  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE = 4
ATOL = 1e-4


@pytest.fixture(params=["llama", "qwen2"], scope="module")
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"triton_{request.param}")
    ref = _save_tiny(path, request.param)
    runner = ModelRunner.from_path(
        str(path),
        progress=False,
        page_size=PAGE,
        num_pages=64,
        device=str(DEVICE),
        dtype="float32",
        attention_backend="triton",
    )
    return ref, runner


def test_the_triton_backend_and_fused_steps_are_the_ones_running(pair):
    _, runner = pair
    assert runner.model.attention.name == "triton"
    assert type(runner.model.fused).__name__ == "TritonFusedOps"


def test_full_and_chunked_prompts_match_transformers(pair):
    ref, runner = pair
    ids = _prompt(23, 5)
    expect = _ref_logits(ref, ids)
    pages = runner.pool.allocator.allocate(pages_needed(len(ids), PAGE))
    try:
        full = runner.extend([ExtendRequest(ids, 0, pages)]).logits[0].cpu()
        torch.testing.assert_close(full, expect[-1], atol=ATOL, rtol=0)
        # chunks that end mid-page: later chunks read the earlier ones' pages in place
        for start, stop in [(0, 7), (7, 16), (16, 23)]:
            out = runner.extend([ExtendRequest(ids[start:stop], start, pages)]).logits[0].cpu()
            torch.testing.assert_close(out, expect[stop - 1], atol=ATOL, rtol=0)
    finally:
        runner.pool.allocator.free(pages)


def test_a_batch_of_spans_then_batched_decode_match_transformers(pair):
    """Spans of 6, 1, 13 tokens in one extend (two after a cached prefix), then steps of
    batched decode, through the padded graph buffers (eager on the CPU, graphs on CUDA)."""
    ref, runner = pair
    prompts = [_prompt(n, 30 + n) for n in (9, 5, 17)]
    prefixes = [4, 0, 4]  # whole pages of each prompt computed first, as a cache hit would
    tables = [runner.pool.allocator.allocate(pages_needed(len(p) + 4, PAGE)) for p in prompts]
    if DEVICE.type != "cuda":  # the graphs' padding, eagerly
        runner.graphs = DecodeGraphs(runner, 4, capture=False, pad=True)
    try:
        runner.extend(
            [ExtendRequest(p[:k], 0, t) for p, k, t in zip(prompts, prefixes, tables) if k]
        )
        out = runner.extend(
            [ExtendRequest(p[k:], k, t) for p, k, t in zip(prompts, prefixes, tables)]
        )
        for i, p in enumerate(prompts):
            torch.testing.assert_close(
                out.logits[i].cpu(), _ref_logits(ref, p)[-1], atol=ATOL, rtol=0
            )
        seqs = [list(p) for p in prompts]
        tokens = [int(x) for x in out.logits.argmax(-1).tolist()]
        for _ in range(3):
            for s, t in zip(seqs, tokens):
                s.append(t)
            logits = runner.decode(tokens, [len(s) for s in seqs], tables).cpu()
            for i, s in enumerate(seqs):
                torch.testing.assert_close(logits[i], _ref_logits(ref, s)[-1], atol=ATOL, rtol=0)
            tokens = [int(x) for x in logits.argmax(-1).tolist()]
    finally:
        for t in tables:
            runner.pool.allocator.free(t)
        runner.pool.check_integrity()
