"""Every Triton launch of the model goes through `launch`: the one place that knows what a
launch compiles.

Triton compiles a kernel once per *specialisation*: the dtype of each pointer, whether it
is 16-byte aligned, whether each integer is 1 or divisible by 16, every constexpr, and the
launch options. A serving GPU must not meet a new one mid-stream (a compile takes
seconds), and the prepared GPU check must know its compiles ahead. So:

  - `launch(kernel, grid, *args, **meta)` runs `kernel[grid](*args, **meta)`, after telling
    an active `CompileRecorder` the GPU's cache key of this launch (`Variant`): computed
    with Triton's own specialisation rule for a CUDA target, whatever device the tensors
    are on. Under Triton's interpreter (CPU tensors) the key is the one a GPU would build
    for the same call, with the interpreter-only flags (`INTERPRETER_ONLY`) at their GPU
    values.
  - On tensors of the `meta` device nothing runs: a *dry run* walks the model's launches
    at a GPU model's real shapes on a machine without one (bench/triton_aot.py,
    bench/device_check.py), in no time and no memory.
  - `Variant`s are plain data: bench/triton_aot.py compiles each for sm_90 with Triton's
    own compiler, and a GPU's warm-up compiles them in parallel before serving.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

# constexprs that only work around Triton's interpreter (bfloat16 emulation): on a GPU
# they are always False, so a CPU rehearsal records the GPU's key with them so
INTERPRETER_ONLY = frozenset({"UPCAST", "EMULATE"})
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "enable_fp_fusion", "maxnreg")
ALIGNMENT = 16  # bytes: Triton's divisibility attribute

_TYPE_OF_DTYPE = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
}


@dataclass(frozen=True)
class Variant:
    """One compile of one kernel: what Triton's cache key holds, as plain data.

    `signature`: per parameter, its Triton type (`*bf16`, `i32`, `fp32`, ...) or
    "constexpr"; `constexprs`: the constexpr values by parameter (integers equal to 1
    become constexprs, as Triton does); `attrs`: the parameters whose specialisation
    attribute is a string, in order, with it ("D": divisible by 16; "": not; a constexpr's
    own string value, which Triton keeps there too: its cache key hashes them all);
    `options`: the launch options given."""

    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    attrs: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, Any], ...]

    @property
    def aligned(self) -> tuple[str, ...]:
        """The pointers and integers Triton treats as divisible by 16."""
        kinds = dict(self.signature)
        return tuple(n for n, a in self.attrs if kinds[n] != "constexpr" and "D" in a)

    @property
    def name(self) -> str:
        return f"{self.kernel}[{self.describe()}]"

    def describe(self) -> str:
        """The constexprs and options, short: what tells two variants apart to a reader."""
        parts = [f"{k}={v}" for k, v in self.constexprs]
        parts += [f"{k}={v}" for k, v in self.options]
        dtypes = sorted({t for _, t in self.signature if t.startswith("*")})
        return ",".join(parts + dtypes)

    @property
    def dtype_class(self) -> str:
        """bf16, fp16 or fp32: the widest float pointer type's model dtype (for the rules
        that differ by dtype, such as no spills in 16 bits)."""
        types = {t for _, t in self.signature}
        for name in ("bf16", "fp16"):
            if f"*{name}" in types:
                return name
        return "fp32"

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "kernel": self.kernel,
            "signature": [list(p) for p in self.signature],
            "constexprs": [list(p) for p in self.constexprs],
            "attrs": [list(p) for p in self.attrs],
            "options": [list(p) for p in self.options],
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Variant:
        return Variant(
            d["module"],
            d["kernel"],
            tuple((str(a), str(b)) for a, b in d["signature"]),
            tuple((str(a), b) for a, b in d["constexprs"]),
            tuple((str(a), str(b)) for a, b in d["attrs"]),
            tuple((str(a), b) for a, b in d["options"]),
        )


@dataclass
class CompileRecorder:
    """The distinct variants launched while it is active, in first-launch order."""

    variants: dict[Variant, int] = field(default_factory=dict)  # -> launches

    def note(self, variant: Variant) -> None:
        self.variants[variant] = self.variants.get(variant, 0) + 1

    def by_kernel(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for v in self.variants:
            counts[v.kernel] = counts.get(v.kernel, 0) + 1
        return counts

    @property
    def num_compiles(self) -> int:
        return len(self.variants)


class _Active(threading.local):
    recorders: list[CompileRecorder]

    def __init__(self) -> None:
        self.recorders = []


_active = _Active()


@contextlib.contextmanager
def recording() -> Iterator[CompileRecorder]:
    """Record the variants this thread launches inside the block (nested blocks each see
    the launches made while they are open)."""
    recorder = CompileRecorder()
    _active.recorders.append(recorder)
    try:
        yield recorder
    finally:
        _active.recorders.remove(recorder)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """`kernel[grid](*args, **meta)`, recorded first; nothing runs on meta tensors."""
    is_dry = any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in args)
    if _active.recorders or is_dry:
        variant = variant_of(kernel, args, meta)
        for recorder in _active.recorders:
            recorder.note(variant)
    if is_dry or 0 in grid:
        return
    kernel[grid](*args, **meta)


@dataclass(frozen=True)
class _Param:
    name: str
    is_constexpr: bool
    specialize: bool  # not in do_not_specialize
    align: bool  # not in do_not_specialize_on_alignment


_params_cache: dict[int, tuple[_Param, ...]] = {}


def _params(kernel: Any) -> tuple[_Param, ...]:
    """The kernel's parameters as Triton sees them (a JITFunction, or the interpreter's
    InterpretedFunction: both keep the Python function and the specialisation lists)."""
    cached = _params_cache.get(id(kernel))
    if cached is not None:
        return cached
    fn = kernel.fn
    if hasattr(kernel, "do_not_specialize"):
        dns, dnsa = kernel.do_not_specialize, kernel.do_not_specialize_on_alignment
    else:
        dns = kernel.kwargs.get("do_not_specialize") or ()
        dnsa = kernel.kwargs.get("do_not_specialize_on_alignment") or ()
    out = []
    for i, p in enumerate(inspect.signature(fn).parameters.values()):
        is_constexpr = "constexpr" in str(p.annotation)
        out.append(
            _Param(
                p.name,
                is_constexpr,
                not (i in dns or p.name in dns),
                not (i in dnsa or p.name in dnsa),
            )
        )
    params = tuple(out)
    _params_cache[id(kernel)] = params
    return params


def _is_aligned(t: torch.Tensor) -> bool:
    if t.device.type == "meta":  # a dry run: the base is aligned, as every allocator aligns
        return (t.storage_offset() * t.element_size()) % ALIGNMENT == 0
    return t.data_ptr() % ALIGNMENT == 0


def _int_key(value: int, specialize: bool) -> tuple[str, str | None, Any]:
    """Triton's rule for an integer argument: (type, alignment attribute, constexpr value
    when it is specialised as the constant 1)."""
    kind = "i32" if -(2**31) <= value < 2**31 else ("u64" if value >= 2**63 else "i64")
    if not specialize:
        return kind, None, None
    if value == 1:
        return "constexpr", None, 1
    return kind, "D" if value % ALIGNMENT == 0 else "", None


def variant_of(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> Variant:
    """The GPU's compile of `kernel[grid](*args, **meta)` (Triton's specialisation rule for
    a CUDA target, Triton 3.x): pointers by dtype and 16-byte alignment, integers by
    type, == 1 and divisibility by 16 unless not specialised, floats and bools by type."""
    params = _params(kernel)
    values: dict[str, Any] = {p.name: a for p, a in zip(params, args)}
    options = tuple(sorted((k, v) for k, v in meta.items() if k in LAUNCH_OPTIONS))
    values.update({k: v for k, v in meta.items() if k not in LAUNCH_OPTIONS})
    signature: list[tuple[str, str]] = []
    constexprs: list[tuple[str, Any]] = []
    attrs: list[tuple[str, str]] = []
    for p in params:
        if p.name not in values:
            raise TypeError(f"{kernel.fn.__name__}: no value for {p.name}")
        value = values[p.name]
        if p.is_constexpr:
            if p.name in INTERPRETER_ONLY:
                value = False
            signature.append((p.name, "constexpr"))
            constexprs.append((p.name, _plain(value)))
            if isinstance(value, str):
                attrs.append((p.name, value))
        elif isinstance(value, torch.Tensor):
            signature.append((p.name, "*" + _TYPE_OF_DTYPE[value.dtype]))
            attrs.append((p.name, "D" if p.align and _is_aligned(value) else ""))
        elif isinstance(value, bool):
            signature.append((p.name, "u1"))
        elif isinstance(value, int):
            kind, attr, const = _int_key(value, p.specialize)
            signature.append((p.name, kind))
            if kind == "constexpr":
                constexprs.append((p.name, const))
            elif attr is not None:
                attrs.append((p.name, attr if p.align else ""))
        elif isinstance(value, float):
            signature.append((p.name, "fp32"))
        elif value is None:
            signature.append((p.name, "constexpr"))
            constexprs.append((p.name, None))
        else:
            raise TypeError(f"{kernel.fn.__name__}: cannot key {p.name}={type(value).__name__}")
    return Variant(
        kernel.fn.__module__,
        kernel.fn.__name__,
        tuple(signature),
        tuple(constexprs),
        tuple(attrs),
        options,
    )


def _plain(value: Any) -> Any:
    """A constexpr as JSON-able data (Triton's dtypes by name)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)
