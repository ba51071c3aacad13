"""x @ W.T by whichever kernel measures fastest on this machine at that many rows.

The kernels compute the same product:
  row_major     F.linear(x, W)
  weight_major  (W @ x.T).T, a transposed view (MKL streams W once, row by row)
  packed        oneDNN on W reordered once into its blocked layout (torch.ops.mkldnn)
  amx           bfloat16 on AMX tiles, W reordered once into their layout
                (common.model.cpu.amx_gemm)
  panels        float32 on AVX-512 or AVX2, W reordered once into column panels, the next
                panel fetched during the current one's multiply-adds (common.model.cpu.f32_gemm)
The first three are the libraries' (MKL, oneDNN); amx and panels are hand-written. Which
one is fastest depends on the CPU, the dtype and the row count, not monotonically
(bench/kernel_tables.py prints the table for a machine). So the model
measures instead of guessing, once: at warm-up (`measure`) each row bucket (1, 2, 4, ...,
64 for decode; 128, 256, ..., 8192 for prefill, longer passes in the last) runs every
kernel over the model's products for TRIALS (5; PREFILL_TRIALS, 3, for prefill)
interleaved rounds, and `KernelChooser` keeps the one with the lowest median; a
hand-written kernel only where it beats the best library kernel by MIN_GAIN (3%), so
pdserve's own GEMMs run only where they measurably pay. Decode buckets time every layer's
products (at few rows the weights stream from memory, and how many fit in cache changes
the order), and so do prefill buckets below SUBSET_FROM_ROWS; larger ones, compute-bound,
time the first PREFILL_LAYERS layers' (the layers' shapes are all alike). The LM head is
timed right after a pass of the layers' products, as a forward leaves the caches. Then
`freeze` fixes every bucket: those warm-up did not reach (prefill beyond
MEASURED_PREFILL_ROWS, or HEAD_MEASURED_ROWS for the LM head) take the choice of the
nearest measured bucket below them in their phase, and the copies of the weights no bucket chose are
dropped (LinearWeight.keep_only). A fixed choice never changes (the kernels round
differently, and a node's greedy output must not change during its life); a chooser never
frozen (tests, a runner without warm-up) measures a bucket on its first passes instead and
keeps that choice as well. Prefill buckets try only the kernels whose output rows are
contiguous (row_major, packed and panels; the residual adds and the KV scatter read rows)
and compare seconds per row, since a bucket's passes differ in length up to 2x. All
agree to float rounding; none is exact against another.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.model.cpu.amx_gemm import AmxGemm, AmxWeight
from common.model.cpu.f32_gemm import F32Gemm, PanelWeight

ROW_MAJOR, WEIGHT_MAJOR, PACKED, AMX, PANELS = (
    "row_major",
    "weight_major",
    "packed",
    "amx",
    "panels",
)
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)
BUCKETS = DECODE_BUCKETS + PREFILL_BUCKETS
# the kernels a prefill bucket may choose: their output rows are contiguous
PREFILL_KERNELS = (ROW_MAJOR, PACKED, PANELS)
# pdserve's own kernels: chosen only where their median beats the best library kernel's
# by MIN_GAIN, beyond the medians' noise. Not 10%: a forward's product seconds understate
# what a whole pass gains (SmolLM2 float32, 2-core Xeon: panels 7% ahead in the products of
# 128-token prefills gave those prefills 17-25% more tokens/s, 10.6% at one decode row 6%).
HAND_WRITTEN = (AMX, PANELS)
MIN_GAIN = 0.03
TRIALS = 5
# a prefill pass times 120+ products of a millisecond or more: less noisy than decode's
PREFILL_TRIALS = 3
# warm-up measures the prefill buckets up to this many rows; larger ones take its choice
MEASURED_PREFILL_ROWS = 1024
# the LM head's up to this many: it runs on one row per request (its last token), on a
# prompt's every row only for prompt logprobs (SmolLM2 float32: 6.6 s measuring up to
# 1024 rows, 1.8 s up to 128)
HEAD_MEASURED_ROWS = 128
# and from SUBSET_FROM_ROWS rows times them over PREFILL_LAYERS layers' products only (all
# layers' shapes are alike, and there the products are compute-bound: the choices match all
# layers' at a seventh of the time for SmolLM2). Below, the weights' streaming still
# counts: over four layers, which stay in cache, the panel product's lead at 128 rows
# shrank from 11% to 7% (a whole 128-token prefill: 24%).
PREFILL_LAYERS = 4
SUBSET_FROM_ROWS = 512
# oneDNN's reorder takes the expected row count as a layout hint; 8 measured as good as
# 1 or 32 across 1-64 rows, and the packed weight serves every row count.
PACK_HINT_ROWS = 8


def mkldnn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 here: AVX-512 BW/VL/DQ or AVX-NE-CONVERT on x86. Without
    them its weight reorder raises (an AVX2-only AMD EPYC), so there is no packed copy."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of this device and dtype get oneDNN's packed copy."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and mkldnn_bf16()))
    )


def can_pack(weight: torch.Tensor) -> bool:
    return packs(weight.device, weight.dtype)


@dataclass
class LinearWeight:
    """A linear layer's weight [out, in] (and bias), with its oneDNN-packed copy, its
    AMX-packed copy and its panel copy if asked (each as much memory again as the weight)."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    amx: AmxWeight | None = None
    panels: PanelWeight | None = None

    @staticmethod
    def of(
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        pack: bool = False,
        amx: AmxGemm | None = None,
        panels: F32Gemm | None = None,
    ) -> LinearWeight:
        packed = None
        if pack and can_pack(weight):
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS)
        amx_weight = None
        if amx is not None and amx.packable(weight):
            amx_weight = AmxWeight(amx, amx.pack(weight))
        panel_weight = None
        if panels is not None and panels.packable(weight):
            panel_weight = PanelWeight(panels, panels.pack(weight), weight.shape[0])
        return LinearWeight(weight, bias, packed, amx_weight, panel_weight)

    def keep_only(self, kernels: set[str]) -> None:
        """Drop the copies of the weight that none of `kernels` reads (freeing their memory)."""
        if PACKED not in kernels:
            self.packed = None
        if AMX not in kernels:
            self.amx = None
        if PANELS not in kernels:
            self.panels = None

    def tensors(self) -> list[torch.Tensor]:
        """The dense tensors a product reads (the packed copy holds the same bytes)."""
        return [self.weight] + ([self.bias] if self.bias is not None else [])


def linear(
    x: torch.Tensor, w: LinearWeight, kernel: str = ROW_MAJOR, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [rows, in] @ w.T (+ bias) by `kernel`; packed, amx and panels fall back to
    row_major without their copy of the weight. `out` (contiguous [rows, out]): where
    row_major writes, the same BLAS call as F.linear's (bit-equal), and where panels
    writes; the other kernels return a tensor of their own, so use the result."""
    if kernel == AMX and w.amx is not None:
        return w.amx(x, w.bias)
    if kernel == PANELS and w.panels is not None:
        return w.panels(x, w.bias, out)
    if kernel == WEIGHT_MAJOR:
        out = torch.mm(w.weight, x.t()).t()
        return out if w.bias is None else out + w.bias
    if kernel == PACKED and w.packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, w.packed, w.bias, "none", [], "")
    if out is not None:
        if w.bias is None:
            return torch.mm(x, w.weight.t(), out=out)
        return torch.addmm(w.bias, x, w.weight.t(), out=out)
    return F.linear(x, w.weight, w.bias)


def bucket_of(rows: int) -> int:
    """The smallest bucket holding `rows`; the largest for more rows than it holds."""
    for b in BUCKETS:
        if rows <= b:
            return b
    return BUCKETS[-1]


def is_prefill_bucket(bucket: int) -> bool:
    return bucket > DECODE_BUCKETS[-1]


def choose(medians: dict[str, float]) -> str:
    """The kernel to keep from each one's median time: the fastest library kernel, unless a
    hand-written one beats it by MIN_GAIN (then the fastest hand-written one)."""
    library = {k: t for k, t in medians.items() if k not in HAND_WRITTEN}
    own = {k: t for k, t in medians.items() if k in HAND_WRITTEN}
    best_library = min(library, key=library.__getitem__) if library else None
    best_own = min(own, key=own.__getitem__) if own else None
    if best_own is None:
        assert best_library is not None
        return best_library
    if best_library is None or own[best_own] <= (1 - MIN_GAIN) * library[best_library]:
        return best_own
    return best_library


@dataclass
class _Bucket:
    samples: dict[str, list[float]]
    choice: str | None = None


@dataclass
class KernelChooser:
    """Per row bucket, which kernel to run: each measured for `trials` passes, then the
    fastest median kept for good. Pure bookkeeping: the caller (or `measure`) times the
    passes. Prefill buckets choose among `kernels` that are also PREFILL_KERNELS (row_major
    if none is), by seconds per row. After `freeze` every bucket has its choice."""

    kernels: tuple[str, ...] = (ROW_MAJOR, WEIGHT_MAJOR, PACKED)
    trials: int = TRIALS
    prefill_trials: int = PREFILL_TRIALS
    _buckets: dict[int, _Bucket] = field(default_factory=dict)
    is_frozen: bool = False

    def candidates(self, bucket: int) -> tuple[str, ...]:
        if not is_prefill_bucket(bucket):
            return self.kernels
        return tuple(k for k in self.kernels if k in PREFILL_KERNELS) or (ROW_MAJOR,)

    def _state(self, bucket: int) -> _Bucket:
        if bucket not in self._buckets:
            self._buckets[bucket] = _Bucket({k: [] for k in self.candidates(bucket)})
        return self._buckets[bucket]

    def pick(self, rows: int) -> str:
        state = self._state(bucket_of(rows))
        if state.choice is not None:
            return state.choice
        # the kernel with the fewest samples so far (ties in `kernels` order)
        return min(state.samples, key=lambda k: len(state.samples[k]))

    def record(self, rows: int, kernel: str, seconds: float) -> None:
        """One timed pass; ignored once its bucket has chosen (a choice is never revisited)."""
        bucket = bucket_of(rows)
        state = self._state(bucket)
        if kernel not in state.samples or state.choice is not None:
            return
        prefill = is_prefill_bucket(bucket)
        state.samples[kernel].append(seconds / rows if prefill else seconds)
        trials = self.prefill_trials if prefill else self.trials
        if all(len(s) >= trials for s in state.samples.values()):
            state.choice = choose(
                {k: statistics.median(samples) for k, samples in state.samples.items()}
            )

    def freeze(self) -> None:
        """Fix every bucket from here on: one still unchosen takes the choice of the nearest
        chosen bucket below it in its phase (decode or prefill), else the nearest above,
        else its first candidate; its samples so far are dropped."""
        chosen = {b: s.choice for b, s in self._buckets.items() if s.choice is not None}
        for bucket in BUCKETS:
            if bucket in chosen:
                continue
            same = [b for b in sorted(chosen) if is_prefill_bucket(b) == is_prefill_bucket(bucket)]
            below = [b for b in same if b < bucket]
            near = below[-1] if below else next((b for b in same if b > bucket), None)
            choice = chosen[near] if near is not None else self.candidates(bucket)[0]
            if choice not in self.candidates(bucket):
                choice = self.candidates(bucket)[0]
            self._buckets[bucket] = _Bucket({}, choice)
        self.is_frozen = True

    def adopt(self, choices: dict[int, str]) -> bool:
        """Take a whole earlier choice (common.model.cpu.choice_cache) and freeze: False,
        and nothing changed, unless it names a candidate kernel for every bucket."""
        if self.is_frozen or set(choices) != set(BUCKETS):
            return False
        if any(k not in self.candidates(b) for b, k in choices.items()):
            return False
        self._buckets = {b: _Bucket({}, choices[b]) for b in BUCKETS}
        self.is_frozen = True
        return True

    def choices(self) -> dict[int, str]:
        """The kernel each bucket settled on (buckets still exploring are left out)."""
        return {b: s.choice for b, s in sorted(self._buckets.items()) if s.choice is not None}

    def chosen_kernels(self) -> set[str]:
        return set(self.choices().values())


def time_products(
    products: Sequence[tuple[LinearWeight, int]], rows: int, kernel: str, dtype: torch.dtype
) -> float:
    """Seconds for one pass of `products` ((weight, input width) each) on `rows` rows."""
    inputs = {width: torch.zeros(rows, width, dtype=dtype) for _, width in products}
    t = time.perf_counter()
    for weight, width in products:
        linear(inputs[width], weight, kernel)
    return time.perf_counter() - t


def measure(
    chooser: KernelChooser,
    products: Sequence[tuple[LinearWeight, int]],
    dtype: torch.dtype,
    max_prefill_rows: int = MEASURED_PREFILL_ROWS,
    prefill_products: Sequence[tuple[LinearWeight, int]] | None = None,
    keep_all_copies: bool = False,
    before: Callable[[int], None] | None = None,
) -> None:
    """Warm-up's measurement: each decode bucket over `products`, and each prefill bucket up
    to `max_prefill_rows` over `products` too below SUBSET_FROM_ROWS and over
    `prefill_products` (default `products`) from there, at the bucket's largest row count,
    every candidate kernel in interleaved rounds until the bucket chooses; then
    `chooser.freeze()`, and the weights keep only the copies chosen (all of them with
    `keep_all_copies`: a bench's side-by-side runs of other kernels). `before(rows)`:
    untimed work before each timed pass, so that the products meet the caches as a forward
    leaves them (the LM head: after the layers' products)."""
    if chooser.is_frozen:
        return

    def timed_pass(products: Sequence[tuple[LinearWeight, int]], rows: int, kernel: str) -> float:
        if before is not None:
            before(rows)
        return time_products(products, rows, kernel, dtype)

    for bucket in BUCKETS:
        prefill = is_prefill_bucket(bucket)
        if prefill and bucket > max_prefill_rows:
            continue
        if bucket in chooser.choices():  # chosen already (in a forward's passes)
            continue
        subset = prefill and bucket >= SUBSET_FROM_ROWS
        timed = (prefill_products or products) if subset else products
        for kernel in chooser.candidates(bucket):  # one untimed pass: first-call costs
            time_products(timed, bucket, kernel, dtype)
        while bucket not in chooser.choices():
            for kernel in chooser.candidates(bucket):
                chooser.record(bucket, kernel, timed_pass(timed, bucket, kernel))
    chooser.freeze()
    if not keep_all_copies:
        kept = chooser.chosen_kernels()
        for weight, _ in products:
            weight.keep_only(kept)
