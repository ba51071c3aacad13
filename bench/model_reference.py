"""bench/model_runner.py's yardsticks: this machine's GEMM rate and read bandwidth (the
bounds), and transformers' side of each comparison (decode time, greedy continuations,
teacher-forced logits)."""

from __future__ import annotations

import time

import torch

from common.model.cpu.gemm import PACK_HINT_ROWS, can_pack


def gemm_flops_per_s(dtype: torch.dtype, n: int = 1024, reps: int = 10) -> float:
    """The machine's GEMM rate: the faster of torch's matmul and oneDNN on a packed weight
    (the runner's product kernels; on an AVX-512 AMD EPYC the second ran 2.4x the first)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    products = [lambda: a @ b]
    if can_pack(b):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, PACK_HINT_ROWS)
        products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for product in products:
        for _ in range(3):
            product()
        for _ in range(reps):
            t = time.perf_counter()
            product()
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def read_bytes_per_s(megabytes: int = 512, reps: int = 5) -> float:
    """Memory read bandwidth: a sum over a tensor far larger than the caches."""
    a = torch.ones(megabytes << 18, dtype=torch.float32)
    a.sum()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best


def hf_decode_seconds(
    model, prompts: list[list[int]], new_tokens: int
) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.no_grad():
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t
    return total - prefill, out[:, ids.shape[1] :].tolist()


def hf_forced_logits(model, prompts: list[list[int]], continuations: list[list[int]]) -> list:
    """transformers' next-token logits along given continuations (teacher forcing, one pass
    per prompt): [steps, vocab] float32 each, as greedy_prompts.forced_logits gives ours."""
    outs = []
    with torch.no_grad():
        for p, c in zip(prompts, continuations):
            logits = model(torch.tensor([list(p) + list(c[:-1])])).logits[0, len(p) - 1 :]
            outs.append(logits.float())
    return outs


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations, one prompt at a time (no padding to differ by)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            outs.append(out[0, len(p) :].tolist())
    return outs
