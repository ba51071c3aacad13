"""x @ W.T by whichever kernel measures fastest on this machine at that many rows.

The kernels compute the same product:
  row_major     F.linear(x, W)
  weight_major  (W @ x.T).T, a transposed view (MKL streams W once, row by row)
  packed        oneDNN on W reordered once into its blocked layout (torch.ops.mkldnn)
  amx           bfloat16 on AMX tiles, W reordered once into their layout
                (common.model.amx_gemm: 1.5-2.2x packed's speed at 1-32 rows where it runs)
  panels        float32 on AVX-512 or AVX2, W reordered once into column panels, the next
                panel fetched during the current one's multiply-adds (common.model.f32_gemm:
                1.1-1.4x packed's speed at 8-128 rows on an AMX Xeon; built for AVX2, with
                torch held to AVX2 there, 1.5-1.75x at 8-32 rows)
At 1-64 rows which one is fastest depends on the CPU, the dtype and the row count, and
not monotonically. Measured on an AMX Xeon over 30 layers of SmolLM2's four products,
ms per pass (row_major / weight_major / packed):
  float32   1 row 31 / 31 / 35    2 rows 32 / 67 / 39    8 rows 75 / 68 / 48
  bfloat16  1 row 36 / 28 / 17   32 rows 45 / 44 / 37   64 rows 58 / 33 / 35
So the model measures instead of guessing: `KernelChooser` gives each row bucket (1, 2,
4, ..., 64 for decode; 128, 256, ..., 8192 for prefill, longer passes in the last) every
kernel for TRIALS (5; PREFILL_TRIALS, 3, for prefill) forward passes, timed over their
products only, and the bucket keeps the one with the lowest median; it explores again
after RECHECK_USES passes, since the machine's load changes. Prefill buckets try only the
kernels whose output rows are contiguous (row_major and packed; the residual adds and the
KV scatter read rows) and compare seconds per row, since a bucket's passes differ in
length up to 2x. There too the
CPU decides: on an AMX Xeon F.linear and packed ran alike (193-205 GFLOP/s at 1024 rows,
float32), on an AVX-512 AMD EPYC packed ran 2.4x F.linear (470 vs 196 GFLOP/s; MKL's sgemm
there runs well below the cores' AVX-512 peak). All agree to float rounding; none is exact
against another.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.model.amx_gemm import AmxGemm, AmxWeight
from common.model.f32_gemm import F32Gemm, PanelWeight

ROW_MAJOR, WEIGHT_MAJOR, PACKED, AMX, PANELS = (
    "row_major", "weight_major", "packed", "amx", "panels")
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_BUCKETS = (128, 256, 512, 1024, 2048, 4096, 8192)
BUCKETS = DECODE_BUCKETS + PREFILL_BUCKETS
# the kernels a prefill bucket may choose: their output rows are contiguous
PREFILL_KERNELS = (ROW_MAJOR, PACKED, PANELS)
TRIALS = 5
# a prefill pass times 120+ products of a millisecond or more: less noisy than decode's
PREFILL_TRIALS = 3
RECHECK_USES = 2000
# oneDNN's reorder takes the expected row count as a layout hint; 8 measured as good as
# 1 or 32 across 1-64 rows, and the packed weight serves every row count.
PACK_HINT_ROWS = 8


def mkldnn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 here: AVX-512 BW/VL/DQ or AVX-NE-CONVERT on x86. Without
    them its weight reorder raises (an AVX2-only AMD EPYC), so there is no packed copy."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of this device and dtype get oneDNN's packed copy."""
    return (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and (dtype == torch.float32 or (dtype == torch.bfloat16 and mkldnn_bf16())))


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
    def of(weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           pack: bool = False, amx: AmxGemm | None = None,
           panels: F32Gemm | None = None) -> LinearWeight:
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

    def tensors(self) -> list[torch.Tensor]:
        """The dense tensors a product reads (the packed copy holds the same bytes)."""
        return [self.weight] + ([self.bias] if self.bias is not None else [])


def linear(x: torch.Tensor, w: LinearWeight, kernel: str = ROW_MAJOR,
           out: torch.Tensor | None = None) -> torch.Tensor:
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


@dataclass
class _Bucket:
    samples: dict[str, list[float]]
    choice: str | None = None
    uses: int = 0


@dataclass
class KernelChooser:
    """Per row bucket, which kernel to run: explore each for `trials` passes, then keep the
    fastest median for `recheck_uses` passes. Pure bookkeeping: the caller times the passes.
    Prefill buckets choose among `kernels` that are also PREFILL_KERNELS (row_major if
    none is), by seconds per row."""

    kernels: tuple[str, ...] = (ROW_MAJOR, WEIGHT_MAJOR, PACKED)
    trials: int = TRIALS
    prefill_trials: int = PREFILL_TRIALS
    recheck_uses: int = RECHECK_USES
    _buckets: dict[int, _Bucket] = field(default_factory=dict)

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
        bucket = bucket_of(rows)
        state = self._state(bucket)
        if kernel not in state.samples:
            return
        if state.choice is not None:
            state.uses += 1
            if state.uses >= self.recheck_uses:
                del self._buckets[bucket]
            return
        prefill = is_prefill_bucket(bucket)
        state.samples[kernel].append(seconds / rows if prefill else seconds)
        trials = self.prefill_trials if prefill else self.trials
        if all(len(s) >= trials for s in state.samples.values()):
            state.choice = min(state.samples, key=lambda k: statistics.median(state.samples[k]))

    def choices(self) -> dict[int, str]:
        """The kernel each bucket settled on (buckets still exploring are left out)."""
        return {b: s.choice for b, s in sorted(self._buckets.items()) if s.choice is not None}
