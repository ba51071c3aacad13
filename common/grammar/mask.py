"""The grammar's token bitmask applied to a batch of logits: one fill and one masking kernel."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import xgrammar as xgr

from common.grammar.backend import GrammarState


class GrammarMasker:
    """Masks, in place, the logits rows whose request follows a grammar.

    The rows' bitmasks are filled in one xgrammar call (C++ threads, no Python loop over
    the batch or the vocabulary), copied to the logits' device once and applied by
    xgrammar's kernel (CUDA or Triton on a GPU, C++ on the CPU): every token the grammar
    forbids gets -inf, so greedy, sampling and the logprobs all see the masked row.
    """

    def __init__(self, max_threads: int | None = None) -> None:
        threads = max_threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self._bitmask: torch.Tensor | None = None

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
        self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        device_mask = bitmask if logits.device.type == "cpu" else bitmask.to(logits.device)
        xgr.apply_token_bitmask_inplace(logits, device_mask[:batch], indices=rows)
        return logits

    def _buffer(self, batch: int, vocab: int) -> torch.Tensor:
        """A host bitmask of at least `batch` rows, kept between steps."""
        words = (vocab + 31) // 32
        buf = self._bitmask
        if buf is None or buf.shape[0] < batch or buf.shape[1] != words:
            buf = xgr.allocate_token_bitmask(max(batch, 8), vocab)
            self._bitmask = buf
        return buf
