"""The model runner against transformers on tiny random Llama and Qwen2 checkpoints (float32;
bfloat16 prefill against float32 once)."""

from __future__ import annotations

import pytest
import torch

from common.kv_pool import pages_needed
from common.model import runner as runner_module
from common.model.cpu.gemm import PACKED, PANELS, ROW_MAJOR, WEIGHT_MAJOR, KernelChooser
from common.model.cpu.paged_attention import paged_prefill_attention
from common.model.runner import ExtendRequest, ModelRunner
from common.model.workspace import WORKSPACE_ROWS, Workspace

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
PAGE = 4


def _save_tiny(tmp_path, arch: str):
    torch.manual_seed(0)
    common = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=10000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # random norms and biases, so those paths are really checked
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in name else 0.0))
    model.eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


@pytest.fixture(params=["llama", "qwen2"], scope="module")
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    ref = _save_tiny(path, request.param)
    runner = ModelRunner.from_path(str(path), progress=False, page_size=PAGE, num_pages=64)
    return ref, runner


def _ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 160, (n,), generator=g).tolist()


def test_full_prompt_matches_reference(pair):
    ref, runner = pair
    ids = _prompt(23, 1)
    pages = runner.pool.allocator.allocate(pages_needed(len(ids), PAGE))
    out = runner.extend([ExtendRequest(ids, 0, pages, logprob_targets=ids[1:], top_logprobs=3)])
    expect = _ref_logits(ref, ids)
    torch.testing.assert_close(out.logits[0], expect[-1], atol=ATOL, rtol=0)
    ref_logp = torch.log_softmax(expect, -1)
    torch.testing.assert_close(
        out.target_logprobs[0], ref_logp[torch.arange(22), torch.tensor(ids[1:])], atol=ATOL, rtol=0
    )
    top_vals, top_ids = out.top_logprobs[0]
    assert top_ids.tolist() == ref_logp.topk(3, -1).indices.tolist()
    runner.pool.allocator.free(pages)


def test_prompt_logprobs_read_in_row_blocks_equal_one_pass(pair, monkeypatch):
    """Logits are read LOGPROB_ROWS rows at a time; blocks that split the prompt (and
    end inside the targets) give what one pass gives."""
    _, runner = pair
    ids = _prompt(23, 2)
    pages = runner.pool.allocator.allocate(pages_needed(len(ids), PAGE))
    whole = runner.extend([ExtendRequest(ids, 0, pages, logprob_targets=ids[1:], top_logprobs=2)])
    monkeypatch.setattr(runner_module, "LOGPROB_ROWS", 5)
    split = runner.extend([ExtendRequest(ids, 0, pages, logprob_targets=ids[1:], top_logprobs=2)])
    torch.testing.assert_close(split.target_logprobs[0], whole.target_logprobs[0])
    assert split.target_logprobs[0].shape == (22,)
    assert split.top_logprobs[0][1].tolist() == whole.top_logprobs[0][1].tolist()
    assert split.top_logprobs[0][0].shape == (23, 2)
    runner.pool.allocator.free(pages)


def _prefill_kernel(runner):
    """The paged prefill kernel, also where the model would not take it: float32 on the
    CPU, head dim 16, the tiny models are its case."""
    spec = runner.spec
    kernel = paged_prefill_attention(
        runner.device, torch.float32, spec.num_heads, spec.num_kv_heads, spec.head_dim, always=True
    )
    assert kernel is not None
    return kernel


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_prefill_on_the_kernel_and_on_torch_near_float32(tmp_path, arch):
    """bfloat16 chunked prefill, the paged kernel (computing in float32) and torch's flash
    passes alike: the logits within 3% of the largest of transformers' float32 logits
    (measured: 0.3-0.8% for either; attention at a wrong position or scale moves them by
    tens of percent)."""
    ref = _save_tiny(tmp_path, arch)
    runner = ModelRunner.from_path(
        str(tmp_path), progress=False, page_size=PAGE, num_pages=64, dtype="bfloat16"
    )
    spec = runner.spec
    kernel = paged_prefill_attention(
        runner.device, torch.bfloat16, spec.num_heads, spec.num_kv_heads, spec.head_dim, always=True
    )
    assert kernel is not None
    ids = _prompt(120, 5)
    expect = _ref_logits(ref, ids)
    bound = 0.03 * expect.abs().max().item()
    for attention in (kernel, None):
        runner.model.attention.prefill_kernel = attention
        pages = runner.pool.allocator.allocate(pages_needed(len(ids), PAGE))
        for start, stop in [(0, 50), (50, 120)]:  # the second chunk reads the first's pages
            logits = runner.extend([ExtendRequest(ids[start:stop], start, pages)]).logits[0]
            err = (logits - expect[stop - 1]).abs().max().item()
            assert err <= bound, (attention is not None, start, err)
        runner.pool.allocator.free(pages)
    runner.pool.check_integrity()


@pytest.mark.parametrize("prefill_kernel", [True, False])
def test_three_chunks_read_prefix_from_pages(pair, prefill_kernel):
    """Later chunks attend to the cached prefix: through the paged prefill kernel, and through
    torch's flash passes over gathered pages (bfloat16, CUDA, no compiler)."""
    ref, runner = pair
    model = runner.model
    saved = model.attention.prefill_kernel
    model.attention.prefill_kernel = _prefill_kernel(runner) if prefill_kernel else None
    try:
        ids = _prompt(30, 2)
        pages = runner.pool.allocator.allocate(pages_needed(len(ids), PAGE))
        expect = _ref_logits(ref, ids)
        # Chunk boundaries off page boundaries on purpose: partial pages get continued.
        for start, stop in [(0, 7), (7, 20), (20, 30)]:
            out = runner.extend([ExtendRequest(ids[start:stop], start, pages)])
            torch.testing.assert_close(out.logits[0], expect[stop - 1], atol=ATOL, rtol=0)
        runner.pool.allocator.free(pages)
    finally:
        model.attention.prefill_kernel = saved


def _extend_then_decode_match_reference(ref, runner, prompts: list[list[int]], steps: int) -> None:
    """One batched extend of `prompts`, then `steps` greedy decode steps; every step's logits
    equal the reference's on the same tokens. The pages are freed after."""
    tables = [runner.pool.allocator.allocate(pages_needed(len(p) + steps, PAGE)) for p in prompts]
    out = runner.extend([ExtendRequest(p, 0, t) for p, t in zip(prompts, tables)])
    for i, p in enumerate(prompts):
        torch.testing.assert_close(out.logits[i], _ref_logits(ref, p)[-1], atol=ATOL, rtol=0)
    seqs = [list(p) for p in prompts]
    nxt = out.logits.argmax(-1).tolist()
    for _ in range(steps):
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = runner.decode(nxt, [len(s) for s in seqs], tables)
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], _ref_logits(ref, s)[-1], atol=ATOL, rtol=0)
        nxt = logits.argmax(-1).tolist()
    for t in tables:
        runner.pool.allocator.free(t)


def test_batched_extend_then_decode_of_different_lengths(pair):
    ref, runner = pair
    # the C kernels built: attention reads the pages in place, the small steps are fused
    model = runner.model
    assert model.attention.decode_kernel is not None and model.fused is not None
    # prefill's kernel in float32 on every CPU; the batch's four spans go through it
    assert model.attention.prefill_kernel is not None
    saved = model.attention.prefill_kernel
    model.attention.prefill_kernel = _prefill_kernel(runner)
    try:
        _extend_then_decode_match_reference(
            ref, runner, [_prompt(n, 10 + n) for n in (5, 17, 11, 1)], steps=9
        )
    finally:
        model.attention.prefill_kernel = saved
    runner.pool.check_integrity()


@pytest.mark.parametrize("kernel", [ROW_MAJOR, WEIGHT_MAJOR, PACKED, PANELS])
def test_decode_matches_reference_on_every_product_kernel(pair, kernel):
    """Each kernel the chooser may settle on gives the reference's logits (qwen2: with biases),
    at decode's rows and at prefill's (weight-major's strided rows are not tried there)."""
    ref, runner = pair
    model = runner.model
    saved = model.chooser, model.head_chooser
    model.chooser = KernelChooser((kernel,), trials=1, prefill_trials=1)
    model.head_chooser = KernelChooser((kernel,), trials=1, prefill_trials=1)
    try:
        _extend_then_decode_match_reference(
            ref, runner, [_prompt(n, 40 + n) for n in (6, 13, 9, 70)], steps=3
        )
        assert model.chooser.choices()[4] == kernel  # 4 rows: bucket 4, one kernel to try
        # the extend's 98 rows: bucket 128
        assert model.chooser.choices()[128] == (ROW_MAJOR if kernel == WEIGHT_MAJOR else kernel)
    finally:
        model.chooser, model.head_chooser = saved


@pytest.mark.parametrize("without", ["paged_attention", "both"])
def test_extend_and_decode_on_torch_ops_match_reference(pair, without):
    """Attention over gathered pages and copies (SDPA), and with it the per-layer steps as
    torch ops: the model with --no-cpu-kernels or without a C compiler."""
    ref, runner = pair
    model = runner.model
    saved = model.attention.decode_kernel, model.attention.prefill_kernel, model.fused
    model.attention.decode_kernel = model.attention.prefill_kernel = None  # type: ignore
    if without == "both":
        model.fused = None
    try:
        _extend_then_decode_match_reference(
            ref, runner, [_prompt(n, 70 + n) for n in (6, 21, 2)], steps=3
        )
    finally:
        model.attention.decode_kernel, model.attention.prefill_kernel, model.fused = saved


def test_page_ids_outside_the_pool_are_refused_before_any_write(pair):
    """The CPU kernels write and read the pool unchecked: a bad page id must not get there."""
    _, runner = pair
    before = runner.pool.buffer.clone()
    outside = runner.pool.num_pages
    with pytest.raises(ValueError, match="outside the pool"):
        runner.extend([ExtendRequest(_prompt(5, 1), 0, [outside, 0])])
    with pytest.raises(ValueError, match="outside the pool"):
        runner.extend([ExtendRequest(_prompt(5, 1), 0, [0, -1])])
    with pytest.raises(ValueError, match="outside the pool"):
        runner.decode([3, 4], [5, 2], [[0, 1], [outside]])
    with pytest.raises(ValueError, match="at least one token"):
        runner.decode([3], [0], [[0]])
    with pytest.raises(ValueError, match="pages cannot hold"):
        runner.decode([3], [17], [[0]])
    assert torch.equal(runner.pool.buffer, before)
    assert runner.slots.num_free_slots == runner.slots.num_slots  # a refused step holds none


def test_too_few_pages_is_refused(pair):
    _, runner = pair
    with pytest.raises(ValueError, match="pages cannot hold"):
        runner.extend([ExtendRequest(_prompt(9, 3), 0, [0, 1])])


@pytest.mark.parametrize("steps", ["kernels", "torch_ops"])
def test_prefill_of_many_rows_reuses_one_buffer_per_role(pair, monkeypatch, steps):
    """From WORKSPACE_ROWS rows a pass keeps one buffer per step's output for all its layers
    (no fresh page-faulted tensors per layer), and the logits still match the reference,
    through the extend and the decode steps that read the KV it wrote."""
    ref, runner = pair
    model = runner.model
    taken: dict[str, list[int]] = {}
    original = Workspace.take

    def spy(self, role, *shape):
        out = original(self, role, *shape)
        taken.setdefault(role, []).append(out.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(Workspace, "take", spy)
    saved = (
        model.chooser,
        model.attention.decode_kernel,
        model.attention.prefill_kernel,
        model.fused,
    )
    model.chooser = KernelChooser((ROW_MAJOR,), trials=1, prefill_trials=1)
    if steps == "torch_ops":
        model.attention.decode_kernel = model.attention.prefill_kernel = model.fused = None
    try:
        prompts = [_prompt(150, 80), _prompt(40, 81)]  # 190 rows
        assert sum(map(len, prompts)) >= WORKSPACE_ROWS
        _extend_then_decode_match_reference(ref, runner, prompts, steps=3)
    finally:
        (
            model.chooser,
            model.attention.decode_kernel,
            model.attention.prefill_kernel,
            model.fused,
        ) = saved
    assert model._ws is None  # dropped with its pass
    layers = runner.spec.num_layers
    roles = {"qkv", "o", "gate_up", "down"}
    if steps == "kernels":
        roles |= {"qk", "attn", "act", "h"}
    assert set(taken) == roles
    for role, storages in taken.items():
        # once per layer (h: twice, and once before the first), always the same buffer
        assert len(storages) == (2 * layers + 1 if role == "h" else layers), role
        assert len(set(storages)) == 1, role
