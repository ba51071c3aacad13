"""One phase of bench/device_check.sh (`--phase a..e`), or the closing table (`--table`).

Phases: a equivalence with transformers (device_check_equiv), b decode ms per step and c
prefill tokens/s (device_check_speed), d NIXL between two processes (device_check_nixl),
e one request end to end (device_check_e2e). Each writes JSON lines to stdout and appends
them to --out; a result with "ok" is a check, "target_met" a performance target.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# The repo root before bench/: bench/transfer.py would shadow the `transfer` package.
_BENCH = os.path.dirname(os.path.realpath(__file__))
_ROOT = os.path.dirname(_BENCH)
sys.path[:] = [
    _ROOT,
    *(p for p in sys.path if os.path.realpath(p or ".") not in (_BENCH, _ROOT)),
    _BENCH,
]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PHASES = {
    "a": "equivalence",
    "b": "decode speed",
    "c": "prefill speed",
    "d": "nixl transfer",
    "e": "end to end",
}
# New Triton compiles each phase may make on a GPU, after the phases before it (their
# kernels stay in Triton's disk cache): a: the tiny shapes in float32 and bfloat16 and the
# two real ones in bfloat16, 7 variants each, less what they share; the later phases reuse
# them. Before the kernels stopped specialising on layers, strides and lengths, phase a
# alone made about 128.
COMPILE_BUDGET = {"a": 30, "b": 7, "c": 7, "d": 0, "e": 7}


def gpu_configs(phase: str) -> list[tuple[str, str, bool]]:
    """The model runners (shape, dtype, decodes) the phase makes on a GPU."""
    if phase == "a":
        from device_check_equiv import GPU_CONFIGS
    elif phase == "b":
        from device_check_speed import GPU_DECODE_CONFIGS as GPU_CONFIGS
    elif phase == "c":
        from device_check_speed import GPU_PREFILL_CONFIGS as GPU_CONFIGS
    elif phase == "d":
        from device_check_nixl import GPU_CONFIGS
    else:
        from device_check_e2e import GPU_CONFIGS
    return list(GPU_CONFIGS)


def compile_budget(phase: str, sink: Any) -> list[Any]:
    """The phase's Triton variants on a GPU (a meta-tensor walk of its runners' serving
    calls) and how many are new after the phases before it; a check against the budget."""
    from device_check_common import compile_plan

    plan = compile_plan(gpu_configs(phase))
    earlier = {v for p in PHASES if p < phase for v in compile_plan(gpu_configs(p))}
    new = [v for v in plan if v not in earlier]
    sink.emit(
        kind="gpu_compiles",
        num_variants=len(plan),
        num_new=len(new),
        budget=COMPILE_BUDGET[phase],
        by_kernel=dict(sorted(_count(v.kernel for v in new).items())),
        ok=len(new) <= COMPILE_BUDGET[phase],
    )
    return plan


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def triton_cache_entries() -> int:
    """Kernels in Triton's disk cache (a folder with a cubin each; its launcher's and
    driver's builds hold none): what was really compiled."""
    import triton  # type: ignore[import-untyped, unused-ignore]

    root = Path(triton.knobs.cache.dir)
    if not root.exists():
        return 0
    return sum(1 for p in root.iterdir() if p.is_dir() and any(p.glob("*.cubin")))


def run_phase(phase: str, is_cpu: bool, out: str, work: Path, deadline_s: float) -> int:
    import torch
    from device_check_common import Deadline, Mode, Sink, quiet_transformers

    # a timeout's SIGTERM unwinds through the phases' finally blocks (children stopped)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    quiet_transformers()
    mode = Mode(is_cpu)
    sink = Sink(out, phase)
    started = time.monotonic()
    deadline = Deadline(deadline_s)
    if not is_cpu and not torch.cuda.is_available():
        sink.emit(kind="error", ok=False, error="no CUDA device (use --cpu)")
        return 1
    work.mkdir(parents=True, exist_ok=True)
    from common.model.triton_launch import CompileRecorder, recording

    # the phase's Triton variants on a GPU and the budget (the rehearsal's verdict on the
    # CPU); on a GPU they are compiled at once before the phase runs
    plan = compile_budget(phase, sink)
    entries = _precompile(plan, sink) if not is_cpu else 0
    recorder = CompileRecorder()
    try:
        if phase == "a":
            from device_check_equiv import run
        elif phase == "b":
            from device_check_speed import run_decode as run
        elif phase == "c":
            from device_check_speed import run_prefill as run
        elif phase == "d":
            from device_check_nixl import run
        else:
            from device_check_e2e import run
        with recording() as recorder:
            run(mode, sink, work, deadline)
    except Exception as exc:  # noqa: BLE001 - a crash is a result of the phase
        sink.emit(
            kind="error",
            ok=False,
            error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc()[-1500:],
        )
    if not is_cpu:
        _compiles_seen(plan, list(recorder.variants), entries, sink)
    device = torch.cuda.get_device_name(0) if not is_cpu else "cpu"
    sink.summary(time.monotonic() - started, name=PHASES[phase], device=device)
    return 0


def _precompile(plan: list[Any], sink: Any) -> int:
    """GPU: the phase's variants compiled at once in parallel processes (as a node's
    warm-up does), timed; returns the Triton cache's entries after."""
    import torch

    from common.model.kernel_variants import device_target, precompile

    before = triton_cache_entries()
    started = time.monotonic()
    results = precompile(plan, device_target(torch.device("cuda", 0)))
    failed = [c.variant.name for c in results if c.error]
    after = triton_cache_entries()
    sink.emit(
        kind="precompile",
        num_variants=len(plan),
        num_compiled=after - before,
        seconds=round(time.monotonic() - started, 2),
        failed=failed,
        ok=not failed,
    )
    return after


def _compiles_seen(plan: list[Any], launched: list[Any], entries: int, sink: Any) -> None:
    """GPU: the variants the phase's own process launched, and what Triton compiled while
    the phase ran, its node processes too (nothing, when the walk and the precompile saw
    every variant)."""
    planned = set(plan)
    unplanned = [v.name for v in launched if v not in planned]
    jit = triton_cache_entries() - entries
    sink.emit(
        kind="compiles",
        num_launched_variants=len(launched),
        unplanned=unplanned[:20],
        jit_compiles_during_phase=jit,
        ok=not unplanned and jit == 0,
    )


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.4g}"
    return "-" if value is None else str(value)


# per kind: the fields that make a row
COLUMNS = {
    "equivalence": ["model", "dtype", "case", "err", "bound", "argmax_agree", "hf_bf16_err"],
    "greedy_per_position": ["model", "dtype", "argmax_agree", "num_positions"],
    "bandwidth": ["copy_gbps", "read_write_gbps"],
    "decode": [
        "model",
        "graphs",
        "batch",
        "ms_per_step",
        "bound_ms",
        "fraction_of_bound",
        "hf_ms_per_step",
        "speedup_vs_hf",
        "target",
    ],
    "graphs_vs_eager": ["model", "batch", "err", "bound"],
    "matmul_peak": ["dtype", "n", "tflops"],
    "prefill": [
        "model",
        "tokens",
        "ms",
        "tokens_per_s",
        "model_tflops",
        "fraction_of_peak",
        "hf_tokens_per_s",
        "speedup_vs_hf",
        "logits_err_vs_hf",
        "target",
    ],
    "nixl": [
        "device",
        "num_pages",
        "bytes",
        "best_write_ms",
        "gbps",
        "copy_gbps",
        "fraction_of_copy",
        "bytes_equal",
        "target",
        "error",
    ],
    "tokenizer": ["model", "vocab_size", "num_ids", "num_chat_ids"],
    "e2e": [
        "model",
        "transfer_backend",
        "startup_s",
        "request_s",
        "completion_tokens",
        "finish_reason",
        "exit_codes",
        "error",
    ],
    "e2e_without_nixl": ["model", "transfer_backend", "completion_tokens", "exit_codes", "error"],
    "gpu_compiles": ["num_variants", "num_new", "budget", "by_kernel"],
    "precompile": ["num_variants", "num_compiled", "seconds", "failed"],
    "compiles": ["num_launched_variants", "jit_compiles_during_phase", "unplanned"],
}


def table(path: str) -> int:
    """Print the results file as a table per phase; 0 when every check passed."""
    lines = [json.loads(raw) for raw in Path(path).read_text().splitlines() if raw.strip()]
    is_all_ok = True
    for phase, name in PHASES.items():
        rows = [r for r in lines if r.get("phase") == phase]
        if not rows:
            continue
        end: dict[str, Any] = next((r for r in rows if r.get("kind") == "phase_end"), {})
        summary = next((r for r in rows if r.get("kind") == "summary"), None)
        phase_ok = bool(summary and summary["ok"]) and end.get("rc", 0) == 0
        is_all_ok &= phase_ok
        print(
            f"\n== {phase}: {name}: {'OK' if phase_ok else 'FAILED'}, "
            f"{_fmt(end.get('elapsed_s'))} s (exit {end.get('rc', '-')}"
            f"{', timed out' if end.get('timed_out') else ''})"
        )
        for r in rows:
            kind = r.get("kind")
            if kind in ("summary", "phase_end"):
                continue
            cols = COLUMNS.get(kind or "", ["reason", "error"])
            cells = [f"{c}={_fmt(r.get(c))}" for c in cols if c in r]
            verdict = "" if "ok" not in r else ("ok  " if r["ok"] else "FAIL")
            if r.get("target_met") is not None:
                verdict += " target met" if r["target_met"] else " target MISSED"
            print(f"  {kind:<20} {verdict:<18} " + "  ".join(cells))
    print(f"\ndevice check: {'every check passed' if is_all_ok else 'some checks FAILED'}")
    return 0 if is_all_ok else 1


def failed_phases(path: str) -> list[str]:
    """The phases of an earlier results file to run again: those that failed, timed out,
    or never ended (a call cut short), in order; none when every phase passed."""
    rows = []
    if Path(path).exists():
        rows = [json.loads(raw) for raw in Path(path).read_text().splitlines() if raw.strip()]
    # the phases the run was asked for (its first line, written by device_check.sh)
    plan = next((r for r in rows if r.get("kind") == "plan"), None)
    asked = plan["phases"].split(",") if plan else list(PHASES)
    out = []
    for phase in asked:
        mine = [r for r in rows if r.get("phase") == phase]
        end = next((r for r in mine if r.get("kind") == "phase_end"), None)
        summary = next((r for r in mine if r.get("kind") == "summary"), None)
        passed = bool(summary and summary.get("ok")) and end is not None and end.get("rc") == 0
        if not passed:
            out.append(phase)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=sorted(PHASES))
    p.add_argument("--table", metavar="JSONL", help="print the results file as tables")
    p.add_argument(
        "--failed-phases", metavar="JSONL", help="print the phases of a results file to rerun"
    )
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", help="results file (JSON lines, appended)")
    p.add_argument("--work", default="/tmp/pdserve-device-check", help="checkpoints, logs")
    p.add_argument("--deadline", type=float, default=100.0, help="seconds for the phase")
    args = p.parse_args()
    if args.table:
        return table(args.table)
    if args.failed_phases:
        print(",".join(failed_phases(args.failed_phases)))
        return 0
    if not args.phase or not args.out:
        p.error("--phase and --out are needed (or --table)")
    return run_phase(args.phase, args.cpu, args.out, Path(args.work), args.deadline)


if __name__ == "__main__":
    sys.exit(main())
