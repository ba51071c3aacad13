"""Phase a: pdserve's ModelRunner against transformers on the same ids, float32 and bfloat16.

For each shape and dtype: a full prompt (last logits, and the greedy token at every
position), the same prompt in 3 chunks through `extend` with prefix_len (off page
boundaries), and batched decode (4 sequences of different lengths after one batched
extend, then teacher-forced steps with the same random ids on both sides). The error is
max |ours - reference| / max(1, max |reference|) over every compared logit vector.
float32: against transformers' float32 eager attention, within tests/support/tolerance.py's
FLOAT32_REL. bfloat16: against the same float32 reference, within max(BF16_REL, twice
transformers' own bfloat16 error on the same ids); the greedy agreement is stated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from device_check_common import (
    BF16_REL,
    FLOAT32_REL,
    Deadline,
    Mode,
    Sink,
    checkpoint,
    free_memory,
    load_reference,
    log,
    make_runner,
    rel_err,
)

PAGE = 16
DECODE_STEPS = 4

# shape: (prompt length, decode sequence lengths); the big shapes stay short
CASES_GPU = {
    "tiny-llama": (40, [5, 17, 30, 41]),
    "tiny-qwen2": (40, [5, 17, 30, 41]),
    "smollm2-135m": (200, [9, 64, 150, 200]),
    "llama-3.2-1b": (256, [9, 64, 150, 256]),
}
CASES_CPU = {"tiny-llama": (40, [5, 17, 30, 41]), "tiny-qwen2": (40, [5, 17, 30, 41])}
# float32 on the tiny shapes only: the real ones in float32 compile the slowest variants (a
# float32 extend takes seconds) for no check the tiny ones do not make
DTYPES_GPU = {
    "tiny-llama": ("float32", "bfloat16"),
    "tiny-qwen2": ("float32", "bfloat16"),
    "smollm2-135m": ("bfloat16",),
    "llama-3.2-1b": ("bfloat16",),
}
# the runners the phase makes on the GPU (device_check.py precompiles their kernels)
GPU_CONFIGS = [(name, dtype, True) for name, dtypes in DTYPES_GPU.items() for dtype in dtypes]
# seconds a shape needs at least (both dtypes, its checkpoint included) before it is begun
NEEDS_S = {"tiny-llama": 8, "tiny-qwen2": 8, "smollm2-135m": 20, "llama-3.2-1b": 35}


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def _ref_logits(model: Any, ids: list[int], device: torch.device) -> torch.Tensor:
    return model(torch.tensor([ids], device=device)).logits[0].float()


class _Refs:
    """Reference logits of one model for each id sequence, computed once per sequence."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def __call__(self, ids: list[int]) -> torch.Tensor:
        key = tuple(ids)
        if key not in self._cache:
            self._cache[key] = _ref_logits(self.model, ids, self.device)
        return self._cache[key]


def _cases(runner: Any, prompt_len: int, lens: list[int], vocab: int) -> dict[str, Any]:
    """Run the three cases on pdserve; returns per case the (sequence, row, our logits)
    triples to compare, and the greedy tokens per position of the full prompt."""
    from common.kv_pool import pages_needed
    from common.model.runner import ExtendRequest

    alloc = runner.pool.allocator
    out: dict[str, Any] = {}
    ids = _ids(prompt_len, vocab, 1)
    pages = alloc.allocate(pages_needed(prompt_len, PAGE))
    res = runner.extend([ExtendRequest(ids, 0, pages, top_logprobs=1)])
    greedy = res.top_logprobs[0][1][:, 0].tolist()
    out["full"] = [(ids, prompt_len - 1, res.logits[0].clone())]
    out["full_greedy"] = (ids, greedy)
    alloc.free(pages)

    a, b = prompt_len // 5 + 1, prompt_len // 2 + 3  # chunk ends off page boundaries
    pages = alloc.allocate(pages_needed(prompt_len, PAGE))
    out["chunked"] = []
    for start, stop in [(0, a), (a, b), (b, prompt_len)]:
        res = runner.extend([ExtendRequest(ids[start:stop], start, pages)])
        out["chunked"].append((ids, stop - 1, res.logits[0].clone()))
    alloc.free(pages)

    prompts = [_ids(n, vocab, 10 + i) for i, n in enumerate(lens)]
    fed = [_ids(DECODE_STEPS, vocab, 100 + i) for i in range(len(lens))]
    tables = [alloc.allocate(pages_needed(n + DECODE_STEPS, PAGE)) for n in lens]
    res = runner.extend([ExtendRequest(p, 0, t) for p, t in zip(prompts, tables)])
    full = [p + f for p, f in zip(prompts, fed)]
    rows = [(full[i], n - 1, res.logits[i].clone()) for i, n in enumerate(lens)]
    for k in range(DECODE_STEPS):
        seq_lens = [n + k + 1 for n in lens]
        logits = runner.decode([f[k] for f in fed], seq_lens, tables)
        rows += [(full[i], n + k, logits[i].clone()) for i, n in enumerate(lens)]
    out["decode"] = rows
    for t in tables:
        alloc.free(t)
    runner.pool.allocator.check_integrity()
    return out


def _compare(rows: list[tuple[list[int], int, torch.Tensor]], ref: _Refs) -> tuple[float, float]:
    """(scaled error, greedy agreement) over the rows."""
    err, agree = 0.0, 0
    for ids, row, ours in rows:
        expect = ref(ids)[row]
        err = max(err, rel_err(ours, expect))
        agree += int(int(ours.argmax()) == int(expect.argmax()))
    return err, agree / len(rows)


def run(mode: Mode, sink: Sink, work: Path, deadline: Deadline) -> None:
    device = mode.device
    cases = CASES_CPU if mode.is_cpu else CASES_GPU
    for name, (prompt_len, lens) in cases.items():
        if deadline.left() < NEEDS_S[name] * (0.3 if mode.is_cpu else 1):
            sink.emit(kind="skipped", model=name, reason="phase deadline")
            continue
        log(f"equivalence: {name}")
        try:
            path = checkpoint(name, work, device)
            ref32 = _Refs(load_reference(path, torch.float32, device, "eager"), device)
        except Exception as exc:  # noqa: BLE001
            sink.emit(
                kind="equivalence", model=name, ok=False, error=f"{type(exc).__name__}: {exc}"
            )
            continue
        for dtype in ("float32", "bfloat16") if mode.is_cpu else DTYPES_GPU[name]:
            if deadline.left() < NEEDS_S[name] / 2 * (0.3 if mode.is_cpu else 1):
                sink.emit(kind="skipped", model=name, dtype=dtype, reason="phase deadline")
                continue
            try:
                _one(sink, name, dtype, path, device, ref32, prompt_len, lens)
            except Exception as exc:  # noqa: BLE001 - one shape's failure is its own result
                sink.emit(
                    kind="equivalence",
                    model=name,
                    dtype=dtype,
                    ok=False,
                    error=f"{type(exc).__name__}: {exc}",
                )
            free_memory(device)
        del ref32
        free_memory(device)
    if deadline.left() > 20:
        try:
            _pool_sizing(sink, mode, work)
        except Exception as exc:  # noqa: BLE001
            sink.emit(kind="pool_sizing", ok=False, error=f"{type(exc).__name__}: {exc}")
        free_memory(device)


def _pool_sizing(sink: Sink, mode: Mode, work: Path) -> None:
    """The pool as --mem-fraction-static sizes it (the default on CUDA): after the weights and
    a warm-up forward at the largest batch, the fraction of the device less what is in use.
    On the CPU a fraction 512 MiB above what is in use now (the rule reads MemAvailable)."""
    from common.model.memory import device_memory

    name = "tiny-llama" if mode.is_cpu else "smollm2-135m"
    path = checkpoint(name, work, mode.device)
    before = device_memory(mode.device)
    fraction = min(1.0, (before.in_use + (512 << 20)) / before.total) if mode.is_cpu else 0.5
    runner, _ = make_runner(
        path,
        dtype="bfloat16",
        device=str(mode.device),
        page_size=PAGE,
        mem_fraction_static=fraction,
        graph_max_bs=32,
    )
    after = device_memory(mode.device)
    nbytes = runner.pool.nbytes
    ceiling = int(fraction * before.total) - before.in_use
    gib = 2**30
    # the CPU's memory moves with every other process: only the order of magnitude is checked
    slack = (256 << 20) if mode.is_cpu else 0
    sink.emit(
        kind="pool_sizing",
        model=name,
        fraction=round(fraction, 4),
        total_gib=round(before.total / gib, 2),
        in_use_before_gib=round(before.in_use / gib, 2),
        pool_gib=round(nbytes / gib, 3),
        pages=runner.pool.num_pages,
        in_use_after_gib=round(after.in_use / gib, 2),
        ok=0 < nbytes <= ceiling + slack and (mode.is_cpu or nbytes > ceiling - 8 * gib),
    )
    del runner


def _one(
    sink: Sink,
    name: str,
    dtype: str,
    path: Path,
    device: torch.device,
    ref32: _Refs,
    prompt_len: int,
    lens: list[int],
) -> None:
    """One shape in one dtype: run the cases on pdserve, compare, emit."""
    vocab = ref32.model.config.vocab_size
    runner, graphs = make_runner(
        path, dtype=dtype, device=str(device), page_size=PAGE, num_pages=96, graph_max_bs=8
    )
    ours = _cases(runner, prompt_len, lens, vocab)
    del runner
    ref16 = None
    if dtype == "bfloat16":
        ref16 = _Refs(load_reference(path, torch.bfloat16, device, "sdpa"), device)
    for case in ("full", "chunked", "decode"):
        err, agree = _compare(ours[case], ref32)
        fields: dict[str, Any] = dict(
            kind="equivalence",
            model=name,
            dtype=dtype,
            case=case,
            graphs=graphs,
            err=err,
            argmax_agree=round(agree, 4),
            num_vectors=len(ours[case]),
        )
        if ref16 is None:
            fields.update(bound=FLOAT32_REL, ok=err <= FLOAT32_REL)
        else:
            hf_err, hf_agree = _compare([(i, r, ref16(i)[r]) for i, r, _ in ours[case]], ref32)
            bound = max(BF16_REL, 2 * hf_err)
            fields.update(
                bound=bound,
                hf_bf16_err=hf_err,
                hf_bf16_argmax_agree=round(hf_agree, 4),
                ok=err <= bound,
            )
        sink.emit(**fields)
    ids, greedy = ours["full_greedy"]
    expect = ref32(ids).argmax(-1).tolist()
    same = sum(int(a == b) for a, b in zip(greedy, expect)) / len(expect)
    sink.emit(
        kind="greedy_per_position",
        model=name,
        dtype=dtype,
        argmax_agree=round(same, 4),
        num_positions=len(expect),
    )
    del ref16
