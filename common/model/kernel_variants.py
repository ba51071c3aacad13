"""The Triton compiles a model configuration makes on a GPU, found without one, and made
ahead of serving.

`serving_variants` walks a ModelRunner's serving calls (warm-up, extends of several
lengths with and without a cached prefix, decode steps at every graph bucket and beyond)
on `meta` tensors: common.model.triton_launch records each launch's GPU compile key and
runs nothing, so a 70B configuration is walked in milliseconds on any machine.
`compile_variant` compiles one with Triton's own compiler for a target (sm_90 on a CPU-only
machine: bench/triton_aot.py, the test of every kernel and variant), and `precompile` makes
a list of them in parallel processes before a GPU node serves: Triton's disk cache then
holds each, and the first request meets no compile.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

import torch

from common.kv_pool import pages_needed, torch_dtype
from common.model.spec import ModelSpec
from common.model.triton_launch import Variant, recording

logger = logging.getLogger(__name__)

# extend calls the walk makes: (new tokens, cached prefix) per span, as one batch each
EXTEND_CALLS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((1, 0),),
    ((7, 0),),
    ((64, 0),),
    ((300, 0),),
    ((5, 0), (17, 16), (1, 33)),
    ((40, 21),),
)
H100_TARGET = ("cuda", 90, 32)  # Triton's GPUTarget(backend, capability, warp size)


def meta_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors for `spec` (Llama-family names), on `meta`: shapes only."""
    meta = torch.device("meta")
    h, inter = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    out = {
        "model.embed_tokens.weight": torch.empty(spec.vocab_size, h, device=meta),
        "model.norm.weight": torch.empty(h, device=meta),
    }
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = torch.empty(spec.vocab_size, h, device=meta)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        if spec.attention_bias:
            shapes |= {
                f"self_attn.{n}_proj.bias": (d,) for n, d in (("q", q), ("k", kv), ("v", kv))
            }
        for name, shape in shapes.items():
            out[p + name] = torch.empty(shape, device=meta)
    return out


def serving_variants(
    spec: ModelSpec,
    dtype: str,
    page_size: int,
    *,
    decodes: bool = True,
    graph_max_bs: int = 128,
    context_length: int | None = None,
) -> list[Variant]:
    """The distinct compiles a GPU node of this configuration makes while it serves (its
    warm-up, extends, decode steps in and past the graphs' buckets), in launch order."""
    from common.model.runner import ExtendRequest, ModelRunner

    torch_dtype(dtype)  # a clear error for an unknown name
    longest = max(sum(n + p for n, p in call) for call in EXTEND_CALLS) + 2 * page_size
    with recording() as recorder:
        runner = ModelRunner(
            spec,
            meta_weights(spec),
            dtype=dtype,
            device="meta",
            page_size=page_size,
            num_pages=max(256, 4 * pages_needed(longest, page_size)),
            context_length=context_length,
            attention_backend="triton",
            cuda_graph_max_bs=graph_max_bs,
            decodes=decodes,
            max_decode_slots=graph_max_bs + 1,
        )
        runner.warmup()
        alloc = runner.pool.allocator
        for call in EXTEND_CALLS:
            call = tuple((min(n, runner.context_length - p), p) for n, p in call)
            tables = [alloc.allocate(pages_needed(n + p, page_size)) for n, p in call]
            runner.extend(
                [ExtendRequest([1] * n, p, t) for (n, p), t in zip(call, tables, strict=True)]
            )
            for t in tables:
                alloc.free(t)
        if decodes:
            graphs = runner.graphs
            for bs in graphs.buckets:  # what capture() runs, then an eager step past them
                graphs._stage([], [], bs)
                graphs._forward(bs, 0, merge=True)
            page = alloc.allocate(1)
            bs = graph_max_bs + 1
            runner.decode([1] * bs, [page_size] * bs, [page] * bs)
            alloc.free(page)
    return list(recorder.variants)


@dataclass(frozen=True)
class Compiled:
    """One variant compiled for a target: what ptxas says of it."""

    variant: Variant
    seconds: float
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int
    shared_bytes: int  # Triton's dynamic shared memory (what the launch asks for)
    error: str = ""

    @property
    def has_spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


def compile_variant(variant: Variant, target: tuple[str, int, int] = H100_TARGET) -> Compiled:
    """`variant` compiled by Triton for `target` (no GPU needed: Triton's compiler and the
    ptxas in its wheel), then its PTX through ptxas -v for registers and spills. The
    kernels must be jit functions: call it in a process without TRITON_INTERPRET."""
    import triton  # type: ignore[import-untyped, unused-ignore]
    from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped, unused-ignore]

    started = time.perf_counter()
    try:
        src = ast_source(variant)
        kernel = triton.compile(src, target=GPUTarget(*target), options=dict(variant.options))
        usage = _ptxas_usage(kernel.asm["ptx"], target[1])
        return Compiled(
            variant,
            time.perf_counter() - started,
            usage["registers"],
            usage["spill_stores"],
            usage["spill_loads"],
            usage["stack"],
            int(kernel.metadata.shared),
        )
    except Exception as exc:  # noqa: BLE001 - the result names the kernel and variant
        return Compiled(variant, time.perf_counter() - started, 0, 0, 0, 0, 0, repr(exc)[:2000])


def ast_source(variant: Variant) -> Any:
    """Triton's compile source for `variant`, as its JIT builds it for the same launch (so
    the disk cache's key is the one that launch looks up)."""
    from triton.compiler import ASTSource  # type: ignore[import-untyped, unused-ignore]

    fn = getattr(importlib.import_module(variant.module), variant.kernel)
    if not hasattr(fn, "arg_names"):
        raise RuntimeError(f"{variant.kernel} is not a jit function (TRITON_INTERPRET set?)")
    names = list(fn.arg_names)
    constexprs = {(names.index(k),): v for k, v in variant.constexprs}
    attrs = {
        (names.index(k),): [["tt.divisibility", 16]] if "D" in a else [] for k, a in variant.attrs
    }
    return ASTSource(fn, dict(variant.signature), constexprs, attrs)


_USAGE = {
    "registers": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def _ptxas_usage(ptx: str, capability: int) -> dict[str, int]:
    from triton.backends.nvidia.compiler import get_ptxas  # type: ignore[import-untyped]

    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        done = subprocess.run(
            [get_ptxas(capability).path, "-v", f"--gpu-name={arch}", path, "-o", path + ".cubin"],
            capture_output=True,
            text=True,
            check=True,
        )
    out = {}
    for key, pattern in _USAGE.items():
        m = pattern.search(done.stderr)
        out[key] = int(m.group(1)) if m else 0
    return out


def _worker_init() -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # the kernels as jit functions


def precompile(
    variants: Sequence[Variant],
    target: tuple[str, int, int],
    workers: int | None = None,
) -> list[Compiled]:
    """Compile every variant in `workers` processes (default: the machine's cores), into
    Triton's disk cache as the first launch would: a node's warm-up, before it serves.
    A variant precompiled into this cache before (a marker beside Triton's entries, keyed
    by its source's hash, the target and the options) is skipped, so a restart or a second
    node spawns no process; the returned list holds only the variants compiled now."""
    markers = _markers(variants, target)
    variants = [v for v in variants if not os.path.exists(markers[v])]
    if not variants:
        return []
    workers = max(1, min(workers or os.cpu_count() or 1, len(variants)))
    env_interp = os.environ.pop("TRITON_INTERPRET", None)  # spawned children inherit it
    try:
        with ProcessPoolExecutor(
            workers, mp_context=get_context("spawn"), initializer=_worker_init
        ) as pool:
            results = list(pool.map(compile_variant, variants, [target] * len(variants)))
    finally:
        if env_interp is not None:
            os.environ["TRITON_INTERPRET"] = env_interp
    for c in results:
        if not c.error:
            os.makedirs(os.path.dirname(markers[c.variant]), exist_ok=True)
            with open(markers[c.variant], "w") as f:
                f.write(c.variant.name + "\n")
    return results


def _markers(variants: Sequence[Variant], target: tuple[str, int, int]) -> dict[Variant, str]:
    """Where each variant's "precompiled" marker lives in Triton's cache folder."""
    import hashlib

    from triton import knobs  # type: ignore[import-untyped, unused-ignore]

    root = os.path.join(knobs.cache.dir, "pdserve-precompiled")
    out = {}
    interp = os.environ.pop("TRITON_INTERPRET", None)
    try:
        for v in variants:
            try:
                source = ast_source(v).hash()
            except RuntimeError:  # the interpreter's functions: nothing to mark
                source = "interpreted"
            key = f"{source}-{target}-{v.options}"
            out[v] = os.path.join(root, hashlib.sha256(key.encode()).hexdigest())
    finally:
        if interp is not None:
            os.environ["TRITON_INTERPRET"] = interp
    return out


def precompile_serving(
    spec: ModelSpec,
    dtype: str,
    page_size: int,
    device: torch.device,
    *,
    decodes: bool,
    graph_max_bs: int,
    context_length: int | None,
) -> list[Compiled]:
    """A GPU node's Triton kernels compiled before its runner is made (whose pool sizing
    already runs a forward): every variant its configuration launches, at once, in parallel,
    instead of one by one as the launches meet them; logged. Failures are logged and left
    to the launch, which compiles again and raises where it really fails."""
    started = time.perf_counter()
    variants = serving_variants(
        spec,
        dtype,
        page_size,
        decodes=decodes,
        graph_max_bs=graph_max_bs,
        context_length=context_length,
    )
    results = precompile(variants, device_target(device))
    failed = [c for c in results if c.error]
    for c in failed:
        logger.warning("precompiling %s failed: %s", c.variant.name, c.error[:500])
    logger.info(
        "Triton: %d kernel variants, %d compiled ahead in %.1f s (%d failed)",
        len(variants),
        len(results),
        time.perf_counter() - started,
        len(failed),
    )
    return results


def device_target(device: torch.device) -> tuple[str, int, int]:
    """The Triton target of a CUDA device."""
    major, minor = torch.cuda.get_device_capability(device)
    return ("cuda", 10 * major + minor, 32)


def union(groups: Iterable[Iterable[Variant]]) -> list[Variant]:
    """The distinct variants of several walks, in first-seen order."""
    seen: dict[Variant, None] = {}
    for group in groups:
        for v in group:
            seen.setdefault(v)
    return list(seen)


def describe(results: Sequence[Compiled]) -> list[dict[str, Any]]:
    """One JSON-able row per compiled variant (the AOT table's rows)."""
    return [
        {
            "kernel": c.variant.kernel,
            "variant": c.variant.describe(),
            "dtype": c.variant.dtype_class,
            "registers": c.registers,
            "spill_stores": c.spill_store_bytes,
            "spill_loads": c.spill_load_bytes,
            "stack": c.stack_bytes,
            "shared_bytes": c.shared_bytes,
            "seconds": round(c.seconds, 2),
            "error": c.error,
        }
        for c in results
    ]
