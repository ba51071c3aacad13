"""Phases b and c: decode ms per step and prefill tokens/s, pdserve vs transformers, against
the limits measured in the same run.

b (decode): batches of sequences with `ctx`-token contexts (their KV pages are allocated,
not prefilled: attention reads every page all the same), one token per sequence per step,
pdserve with CUDA graphs on and off, transformers on a prefilled DynamicCache cropped back
to `ctx` after each step (so every step sees the same length). Mean ms per step over steps
run back to back (CUDA events), after warm-up. Bound = (weight bytes + batch * ctx * KV
bytes per token) / bandwidth, the bandwidth being a device-to-device copy measured here
counting bytes read + written (gpu-notes' convention, ~4.3 TB/s on the H200); fraction =
bound / measured step.
c (prefill): one prompt of T tokens in one extend, pdserve vs transformers' forward
(last-token logits only, no cache). Model FLOPs = 2 * (layer matmul params) * T + 2 *
hidden * vocab (the LM head, last token only) + attention: per layer 2 * 2 * heads *
head_dim * T(T+1)/2 (QK^T and PV over the causal triangle only). Fraction of the peak =
model FLOP/s / an n^3 matmul's FLOP/s measured here (bf16 8192^3 on the GPU).
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any

import torch
from device_check_common import (
    Deadline,
    Mode,
    Sink,
    checkpoint,
    copy_bandwidth,
    free_memory,
    load_reference,
    log,
    make_runner,
    matmul_peak_tflops,
    rel_err,
    time_ms,
)

PAGE = 16
GPU_DECODE: dict[str, Any] = dict(
    shapes=["llama-3.2-1b", "smollm2-135m"], batches=[1, 32, 128], ctx=512, warmup=5, iters=30
)
CPU_DECODE: dict[str, Any] = dict(shapes=["small"], batches=[1, 4, 16], ctx=64, warmup=5, iters=10)
GPU_PREFILL: dict[str, Any] = dict(shape="llama-3.2-1b", lengths=[1024, 4096, 16384], repeats=3)
CPU_PREFILL: dict[str, Any] = dict(shape="small", lengths=[128, 256, 512], repeats=2)
# the runners the phases make on the GPU (device_check.py precompiles their kernels)
GPU_DECODE_CONFIGS = [(name, "bfloat16", True) for name in GPU_DECODE["shapes"]]
GPU_PREFILL_CONFIGS = [(GPU_PREFILL["shape"], "bfloat16", True)]
TARGET_B1 = 0.60  # of the bound at batch 1 (1B)
TARGET_B128 = 0.50  # of the bound at batch 128 (1B)
TARGET_VS_HF = 2.0  # transformers' step / ours at batch 32
TARGET_PREFILL = 0.40  # of the matmul peak at 4k-16k


def _spec(path: Path) -> Any:
    from common.model.spec import ModelSpec

    return ModelSpec.from_dir(path)


def profile_step(step: Any, device: torch.device, steps: int = 5) -> dict[str, Any]:
    """What one decode step asks of the GPU: device operations (kernels, copies) per step,
    their summed time, and that as a share of the step's wall time (the GPU's busy share;
    the rest is launch and host overhead)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
        wall_us = (time.perf_counter() - start) * 1e6 / steps
    ops = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(getattr(e, "device_time", getattr(e, "cuda_time", 0.0)) for e in ops) / steps
    return dict(
        device_ops_per_step=round(len(ops) / steps, 1),
        busy_us=round(busy_us, 1),
        wall_us=round(wall_us, 1),
        busy_share=round(busy_us / wall_us, 3),
    )


def _decode_ours(
    path: Path,
    cfg: dict[str, Any],
    mode: Mode,
    graphs: bool,
    deadline: Deadline,
    profiles: dict[str, Any],
) -> tuple[str, dict[int, float], torch.Tensor | None]:
    from common.kv_pool import pages_needed

    batches, ctx = cfg["batches"], cfg["ctx"]
    per_seq = pages_needed(ctx + 1, PAGE)
    runner, state = make_runner(
        path,
        dtype=mode.speed_dtype,
        device=str(mode.device),
        page_size=PAGE,
        num_pages=max(batches) * per_seq + 4,
        graphs=graphs,
        graph_max_bs=max(batches),
    )
    tables = [runner.pool.allocator.allocate(per_seq) for _ in range(max(batches))]
    g = torch.Generator().manual_seed(7)
    out: dict[int, float] = {}
    probe = None
    for bs in batches:
        if deadline.left() < 10:
            break
        tokens = torch.randint(0, runner.spec.vocab_size, (bs,), generator=g).tolist()
        lens, pages = [ctx + 1] * bs, tables[:bs]
        out[bs] = time_ms(
            lambda: runner.decode(tokens, lens, pages),
            mode.device,
            warmup=cfg["warmup"],
            iters=cfg["iters"],
        )
        if bs == batches[1]:
            probe = runner.decode(tokens, lens, pages).float().cpu()
            if not mode.is_cpu and deadline.left() > 15:
                try:
                    profiles[f"batch {bs}"] = profile_step(
                        lambda: runner.decode(tokens, lens, pages), mode.device
                    )
                except Exception as exc:  # noqa: BLE001 - the timings stand without it
                    profiles[f"batch {bs}"] = dict(error=f"{type(exc).__name__}: {exc}")
    del runner, tables
    free_memory(mode.device)
    return state, out, probe


@torch.inference_mode()
def _decode_hf(path: Path, cfg: dict[str, Any], mode: Mode, deadline: Deadline) -> dict[int, float]:
    dtype = torch.bfloat16 if mode.speed_dtype == "bfloat16" else torch.float32
    model = load_reference(path, dtype, mode.device, "sdpa")
    vocab, ctx = model.config.vocab_size, cfg["ctx"]
    params = inspect.signature(model.forward).parameters
    cache_kw = "cache" if "cache" in params else "past_key_values"
    out: dict[int, float] = {}
    for bs in cfg["batches"]:
        if deadline.left() < 10:
            break
        ids = torch.randint(0, vocab, (bs, ctx), device=mode.device)
        first = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = getattr(first, "cache", None)  # transformers >= 5.2x; before, past_key_values
        if cache is None:
            cache = first.past_key_values
        step_ids = torch.randint(0, vocab, (bs, 1), device=mode.device)
        step_kw = {cache_kw: cache, "input_ids": step_ids, "use_cache": True}

        def step() -> None:
            model(**step_kw)
            cache.crop(-1)  # back to ctx tokens: each step sees the same length

        out[bs] = time_ms(step, mode.device, warmup=cfg["warmup"], iters=cfg["iters"])
        del first, cache, step_kw
    del model
    free_memory(mode.device)
    return out


def run_decode(mode: Mode, sink: Sink, work: Path, deadline: Deadline) -> None:
    cfg = CPU_DECODE if mode.is_cpu else GPU_DECODE
    bw = copy_bandwidth(mode.device, (64 if mode.is_cpu else 2048) << 20)
    sink.emit(kind="bandwidth", convention="bytes read + written per second", **bw)
    bandwidth = bw["read_write_gbps"] * 1e9
    for name in cfg["shapes"]:
        if deadline.left() < 20:
            sink.emit(kind="skipped", model=name, reason="phase deadline")
            continue
        path = checkpoint(name, work, mode.device)
        spec = _spec(path)
        elem = 2 if mode.speed_dtype == "bfloat16" else 4
        weight_bytes = spec.num_params() * elem
        kv_per_token = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * elem
        log(f"decode: {name}")
        ours: list[tuple[str, dict[int, float]]] = []
        probes: list[torch.Tensor] = []
        for graphs in (True, False):
            profiles: dict[str, Any] = {}
            try:
                state, times, probe = _decode_ours(path, cfg, mode, graphs, deadline, profiles)
            except Exception as exc:  # noqa: BLE001 - reported, the other variant still runs
                sink.emit(
                    kind="decode",
                    model=name,
                    graphs="on" if graphs else "off",
                    ok=False,
                    error=f"{type(exc).__name__}: {exc}",
                )
                free_memory(mode.device)
                continue
            if times:
                label = f"{state}, asked {'on' if graphs else 'off'}" if mode.is_cpu else state
                ours.append((label, times))
            if probe is not None:
                probes.append(probe)
            for what, fields in profiles.items():
                sink.emit(
                    kind="decode_profile",
                    model=name,
                    graphs="on" if graphs else "off",
                    at=what,
                    ok="error" not in fields,
                    **fields,
                )
        hf: dict[int, float] = {}
        try:
            if deadline.left() > 15:
                hf = _decode_hf(path, cfg, mode, deadline)
        except Exception as exc:  # noqa: BLE001
            sink.emit(
                kind="error",
                model=name,
                what="transformers decode",
                ok=False,
                error=f"{type(exc).__name__}: {exc}",
            )
            free_memory(mode.device)
        for state, times in ours:
            for bs, ms in times.items():
                bound_ms = (weight_bytes + bs * cfg["ctx"] * kv_per_token) / bandwidth * 1e3
                frac = bound_ms / ms
                fields: dict[str, Any] = dict(
                    kind="decode",
                    model=name,
                    dtype=mode.speed_dtype,
                    graphs=state,
                    batch=bs,
                    ctx=cfg["ctx"],
                    ms_per_step=round(ms, 4),
                    bound_ms=round(bound_ms, 4),
                    fraction_of_bound=round(frac, 3),
                    tokens_per_s=round(bs / ms * 1e3, 1),
                    hf_ms_per_step=round(hf[bs], 4) if bs in hf else None,
                    speedup_vs_hf=round(hf[bs] / ms, 2) if bs in hf else None,
                    ok=ms > 0,
                )
                if not mode.is_cpu and state != "off":
                    target, met = _decode_target(name, bs, frac, fields["speedup_vs_hf"])
                    if target:
                        fields.update(target=target, target_met=met)
                sink.emit(**fields)
        if len(probes) == 2:  # the same step with graphs and without
            err = rel_err(probes[0], probes[1])
            bound = 1e-5 if mode.speed_dtype == "float32" else 2e-2
            sink.emit(
                kind="graphs_vs_eager",
                model=name,
                batch=cfg["batches"][1],
                err=err,
                bound=bound,
                ok=err <= bound,
            )


def _decode_target(name: str, bs: int, frac: float, speedup: float | None) -> tuple[str, Any]:
    if bs == 32 and speedup is not None:
        return f">= {TARGET_VS_HF}x transformers", speedup >= TARGET_VS_HF
    if name != "llama-3.2-1b":
        return "", None
    if bs == 1:
        return f">= {TARGET_B1:.0%} of bound", frac >= TARGET_B1
    if bs == 128:
        return f">= {TARGET_B128:.0%} of bound", frac >= TARGET_B128
    return "", None


def _prefill_flops(spec: Any, tokens: int) -> float:
    layer = spec.hidden_size * spec.head_dim * (2 * spec.num_heads + 2 * spec.num_kv_heads)
    layer += 3 * spec.hidden_size * spec.intermediate_size
    linear = 2 * spec.num_layers * layer * tokens + 2 * spec.hidden_size * spec.vocab_size
    attention = spec.num_layers * 4 * spec.num_heads * spec.head_dim * tokens * (tokens + 1) / 2
    return float(linear + attention)


@torch.inference_mode()
def run_prefill(mode: Mode, sink: Sink, work: Path, deadline: Deadline) -> None:
    from common.kv_pool import pages_needed
    from common.model.runner import ExtendRequest

    cfg = CPU_PREFILL if mode.is_cpu else GPU_PREFILL
    dtype = torch.bfloat16 if mode.speed_dtype == "bfloat16" else torch.float32
    peak = matmul_peak_tflops(mode.device, 1024 if mode.is_cpu else 8192, dtype)
    sink.emit(
        kind="matmul_peak",
        dtype=mode.speed_dtype,
        tflops=round(peak, 2),
        n=1024 if mode.is_cpu else 8192,
    )
    path = checkpoint(cfg["shape"], work, mode.device)
    spec = _spec(path)
    lengths = cfg["lengths"]
    g = torch.Generator().manual_seed(3)
    prompts = {n: torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for n in lengths}
    ours: dict[int, tuple[float, torch.Tensor]] = {}
    try:
        runner, _ = make_runner(
            path,
            dtype=mode.speed_dtype,
            device=str(mode.device),
            page_size=PAGE,
            num_pages=pages_needed(max(lengths), PAGE) + 4,
            graph_max_bs=1,
        )
        pages = runner.pool.allocator.allocate(pages_needed(max(lengths), PAGE))
        for n in lengths:
            if deadline.left() < 15:
                sink.emit(kind="skipped", tokens=n, reason="phase deadline")
                continue
            req = [ExtendRequest(prompts[n], 0, pages)]
            logits = runner.extend(req).logits[0].float().cpu()  # also the warm-up
            ms = min(
                time_ms(lambda: runner.extend(req), mode.device, warmup=0, iters=1)
                for _ in range(cfg["repeats"])
            )
            ours[n] = (ms, logits)
        del runner
    except Exception as exc:  # noqa: BLE001 - what was measured is still reported
        sink.emit(kind="prefill", what="pdserve", ok=False, error=f"{type(exc).__name__}: {exc}")
    free_memory(mode.device)
    hf: dict[int, tuple[float, torch.Tensor]] = {}
    try:
        if ours and deadline.left() > 15:
            model = load_reference(path, dtype, mode.device, "sdpa")
            for n in ours:
                if deadline.left() < 8:
                    break
                ids = torch.tensor([prompts[n]], device=mode.device)
                logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1]
                ms = min(
                    time_ms(
                        lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1),
                        mode.device,
                        warmup=0,
                        iters=1,
                    )
                    for _ in range(cfg["repeats"])
                )
                hf[n] = (ms, logits.float().cpu())
            del model
    except Exception as exc:  # noqa: BLE001
        sink.emit(
            kind="error",
            what="transformers prefill",
            ok=False,
            error=f"{type(exc).__name__}: {exc}",
        )
    free_memory(mode.device)
    for n, (ms, logits) in ours.items():
        flops = _prefill_flops(spec, n)
        frac = flops / (ms * 1e-3) / 1e12 / peak
        fields: dict[str, Any] = dict(
            kind="prefill",
            model=cfg["shape"],
            dtype=mode.speed_dtype,
            tokens=n,
            ms=round(ms, 3),
            tokens_per_s=round(n / ms * 1e3),
            model_tflops=round(flops / (ms * 1e-3) / 1e12, 2),
            fraction_of_peak=round(frac, 3),
        )
        ok = bool(torch.isfinite(logits).all())
        if n in hf:
            err = rel_err(logits, hf[n][1])
            fields.update(
                hf_ms=round(hf[n][0], 3),
                hf_tokens_per_s=round(n / hf[n][0] * 1e3),
                speedup_vs_hf=round(hf[n][0] / ms, 2),
                logits_err_vs_hf=err,
            )
            ok = ok and err <= 0.1  # a sanity bound: wrong attention is off by O(1)
        fields["ok"] = ok
        if not mode.is_cpu and n >= 4096:
            fields.update(
                target=f">= {TARGET_PREFILL:.0%} of peak", target_met=frac >= TARGET_PREFILL
            )
        sink.emit(**fields)
