"""What the device check's phases share: the JSON-line sink, deadlines, timers, model shapes
and their random-weight checkpoints, the runner factory and the machine's measured limits."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent


def _tolerance_module() -> Any:
    """tests/support/tolerance.py, loaded by path.

    A wheel's stray top-level `tests` package cannot shadow it.
    """
    spec = importlib.util.spec_from_file_location(
        "pdserve_tolerance", ROOT / "tests" / "support" / "tolerance.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLOAT32_REL: float = _tolerance_module().FLOAT32_REL  # the CPU tests' float32 tolerance
BF16_REL = 2e-2  # bfloat16: at least this much, or twice transformers' own bf16 error


@dataclass
class Mode:
    """GPU or CPU run: the device, the shapes and sizes each phase uses."""

    is_cpu: bool
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        self.device = torch.device("cpu") if self.is_cpu else torch.device("cuda", 0)

    @property
    def speed_dtype(self) -> str:
        # bf16 is what the GPU serves; on the CPU float32 keeps the smoke test quick and exact
        return "float32" if self.is_cpu else "bfloat16"


class Sink:
    """Writes each result as one JSON line to stdout and appends it to the results file."""

    def __init__(self, path: str, phase: str) -> None:
        self.path = path
        self.phase = phase
        self.results: list[dict[str, Any]] = []

    def emit(self, **fields: Any) -> dict[str, Any]:
        line = {"phase": self.phase, **fields}
        text = json.dumps(line, default=_jsonable)
        print(text, flush=True)
        with open(self.path, "a") as f:
            f.write(text + "\n")
        self.results.append(line)
        return line

    def summary(self, elapsed_s: float, **fields: Any) -> None:
        checks = [r for r in self.results if "ok" in r]
        self.emit(
            kind="summary",
            ok=bool(checks) and all(r["ok"] for r in checks),
            num_checks=len(checks),
            num_failed=sum(1 for r in checks if not r["ok"]),
            elapsed_s=round(elapsed_s, 2),
            **fields,
        )


def _jsonable(x: Any) -> Any:
    if isinstance(x, (torch.dtype, torch.device, Path)):
        return str(x)
    if isinstance(x, float):
        return x
    return repr(x)


class Deadline:
    """The phase's Python-side deadline: work that would not finish in time is skipped."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, *, warmup: int, iters: int) -> float:
    """Mean milliseconds per call of `fn` run back to back (CUDA events on a GPU), after
    `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters


def copy_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """A device-to-device copy of `nbytes` (best of 5): GB/s of bytes copied, and GB/s
    counting bytes read + written (the convention of gpu-notes' ~4.3 TB/s)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = min(time_ms(lambda: dst.copy_(src), device, warmup=1, iters=1) for _ in range(5))
    del src, dst
    copied = nbytes / (best * 1e-3) / 1e9
    return {
        "copy_gbps": round(copied, 1),
        "read_write_gbps": round(2 * copied, 1),
        "copy_bytes": nbytes,
    }


def matmul_peak_tflops(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """TFLOP/s of an n^3 matmul on random data (mean of 10 after 3 warm-ups)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, device, warmup=3, iters=10)
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ----- model shapes and their random-weight checkpoints -----

_TINY = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name: (architecture, config, random norms and biases, bfloat16 on disk)
SHAPES: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    # tests/unit/common/model/test_model_runner.py's _save_tiny
    "tiny-llama": (
        "llama",
        dict(**_TINY, tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
        True,
        False,
    ),
    "tiny-qwen2": (
        "qwen2",
        dict(**_TINY, tie_word_embeddings=True, rope_theta=10000.0),
        True,
        False,
    ),
    "smollm2-135m": (
        "llama",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_theta=100000.0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        False,
        True,
    ),
    "llama-3.2-1b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=32768,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
        ),
        False,
        True,
    ),
    # the CPU run's stand-in for the two real shapes (speed, transfer, end to end)
    "small": (
        "llama",
        dict(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_theta=10000.0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        True,
        False,
    ),
}


# (shape, dtype, decodes): a model runner configuration a phase makes on the GPU
RunnerConfig = tuple[str, str, bool]


def spec_of(name: str) -> Any:
    """The ModelSpec of one of SHAPES."""
    from common.model.spec import ModelSpec

    arch, cfg, _, _ = SHAPES[name]
    return ModelSpec.from_hf_config({**cfg, "model_type": arch})


def compile_plan(configs: list[RunnerConfig], page_size: int = 16) -> list[Any]:
    """The Triton variants (common.model.triton_launch.Variant) the configurations' runners
    launch on a GPU, found by walking their serving calls on meta tensors."""
    from common.model.kernel_variants import serving_variants, union

    return union(
        serving_variants(spec_of(shape), dtype, page_size, decodes=decodes)
        for shape, dtype, decodes in configs
    )


def quiet_transformers() -> None:
    """No progress bars or warnings from transformers in the results' output."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def hf_model_class(arch: str) -> Any:
    import transformers

    return transformers.Qwen2ForCausalLM if arch == "qwen2" else transformers.LlamaForCausalLM


def checkpoint(name: str, work: Path, device: torch.device) -> Path:
    """The shape's random-weight checkpoint under `work`, made on `device` the first time
    (a later phase reuses it). Weights saved in bfloat16 are bf16-exact, so a float32
    reference loaded from them holds the same values pdserve loads."""
    import transformers

    path = work / "ckpt" / name
    if (path / "complete").exists():
        return path
    arch, cfg_kwargs, randomize, bf16 = SHAPES[name]
    config_cls = transformers.Qwen2Config if arch == "qwen2" else transformers.LlamaConfig
    cfg = config_cls(**cfg_kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = hf_model_class(arch)(cfg)
    if randomize:  # random norms and biases, so those paths are really compared
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("bias") or "norm" in pname:
                    p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in pname else 0.0))
    if bf16:
        model = model.to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    (path / "complete").write_text("ok\n")
    del model
    return path


def load_reference(path: Path, dtype: torch.dtype, device: torch.device, attn: str) -> Any:
    """transformers' model from the checkpoint, in `dtype` on `device`, eval mode."""
    import transformers

    kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation=attn)
    has_accelerate = importlib.util.find_spec("accelerate") is not None
    if has_accelerate:
        kwargs["device_map"] = str(device)  # straight onto the device, no CPU copy first
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    if not has_accelerate:
        model = model.to(device)  # type: ignore[arg-type]
    return model.eval()


def make_runner(
    path: Path, *, graphs: bool | None = None, graph_max_bs: int | None = None, **kwargs: Any
) -> tuple[Any, str]:
    """A ModelRunner from `path` with CUDA graphs on or off; returns (runner, "on" | "off" |
    "n/a (cpu)")."""
    from common.model.runner import ModelRunner

    graph_kw: dict[str, Any] = {}
    if graphs is not None:
        graph_kw["disable_cuda_graph"] = not graphs
    if graph_max_bs is not None:
        graph_kw["cuda_graph_max_bs"] = graph_max_bs
    runner = ModelRunner.from_path(str(path), progress=False, **kwargs, **graph_kw)
    if runner.device.type != "cuda":
        return runner, "n/a (cpu)"
    return runner, "off" if graphs is False else "on"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max(1, max |ref|): the tests' scaled tolerance, as a number."""
    got, ref = got.float(), ref.float().to(got.device)
    scale = max(1.0, float(ref.abs().max()))
    return float((got - ref).abs().max()) / scale


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)
