"""The grammar's token bitmask applied to a batch of logits: one fill and one masking kernel."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import xgrammar as xgr

from common.grammar.backend import GrammarState

# On the CPU, xgrammar's torch-op kernel over the whole batch beats its C++ kernel per row
# once a quarter of the rows follow a grammar (batch 32, SmolLM2's 49152 ids, 2 cores:
# 2.4 ms for all rows against 7.8 ms; the C++ one costs about 0.24 ms a row).
CPU_WHOLE_BATCH_SHARE = 0.25


class GrammarMasker:
    """Masks the logits rows whose request follows a grammar.

    The rows' bitmasks are filled in one xgrammar call (C++ threads, no Python loop over
    the batch or the vocabulary), copied to the logits' device once and applied by
    xgrammar's kernel: every token the grammar forbids gets -inf, so greedy, sampling and
    the logprobs all see the masked row.
    """

    def __init__(self) -> None:
        self._batches: dict[str, xgr.BatchGrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None

    @torch.inference_mode()  # the runner's logits are inference tensors: masked in place
    def apply(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
        """The logits with the grammar rows masked: `logits` itself, masked in place, when it
        is contiguous, else a contiguous copy (xgrammar's kernels index rows by shape, not by
        stride: on a transposed [B, V] view, as a weight-major LM head returns, they mask
        the wrong entries of every row)."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return logits
        logits = logits.contiguous()
        batch, vocab = logits.shape
        bitmask = self._buffer(batch, vocab)
        matchers = [states[i].matcher for i in rows]  # type: ignore[union-attr]
        on_cpu = logits.device.type == "cpu"
        self._batch(on_cpu).batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        if on_cpu and len(rows) >= CPU_WHOLE_BATCH_SHARE * batch:
            if len(rows) < batch:  # rows without a grammar allow every token
                free = [i for i, s in enumerate(states) if s is None]
                bitmask[free] = -1
            xgr.apply_token_bitmask_inplace(logits, bitmask[:batch], backend="torch_native")
        elif on_cpu:
            xgr.apply_token_bitmask_inplace(logits, bitmask[:batch], indices=rows, backend="cpu")
        else:
            device_mask = bitmask[:batch].to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, device_mask, indices=rows)
        return logits

    def _batch(self, on_cpu: bool) -> xgr.BatchGrammarMatcher:
        """The fill's threads: one when the model runs on the CPU (its cores are torch's;
        more threads measured slower at batch 32 on two cores), else half the cores."""
        key = "cpu" if on_cpu else "device"
        if key not in self._batches:
            threads = 1 if on_cpu else max(1, min(8, (os.cpu_count() or 2) // 2))
            self._batches[key] = xgr.BatchGrammarMatcher(max_threads=threads)
        return self._batches[key]

    def _buffer(self, batch: int, vocab: int) -> torch.Tensor:
        """A host bitmask of at least `batch` rows, kept between steps (pinned with CUDA, so
        its copy to the device is asynchronous)."""
        words = (vocab + 31) // 32
        buf = self._bitmask
        if buf is None or buf.shape[0] < batch or buf.shape[1] != words:
            buf = xgr.allocate_token_bitmask(max(batch, 8), vocab)
            if torch.cuda.is_available():
                buf = buf.pin_memory()
            self._bitmask = buf
        return buf
