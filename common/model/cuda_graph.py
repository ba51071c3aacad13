"""The decode step over static input buffers: as CUDA graphs, one per batch bucket, on CUDA;
eagerly through the same buffers elsewhere.

A SmolLM2 decode step is about 800 kernel launches; at batch 1 launching them costs more
than running them. Each bucket (1, 2, 4, 8, then every 16 up to `--cuda-graph-max-bs`,
nano-vllm's and SGLang's shape) is captured once, after the KV pool and the decode slots
exist (their addresses are baked into the graph). A step names its requests by slot
(common.model.decode_slots: each slot's page row and next token live on the device), so:
  1. the host writes three short columns into a pinned buffer: each row's slot, its
     sequence length and its split count (common.model.triton_attention's rule, from the
     lengths), and copies them in ONE non-blocking copy, after the slots' staged changes
     (new pages, first tokens) have gone in their own;
  2. the bucket's graph replays: tokens, positions and KV write slots are gathered on the
     device from the slots' rows, attention reads the pages through them, and padding
     rows decode one token on the pool's spare page (the padding slot);
  3. the bucket's static logits are returned, first `bs` rows.
Nothing in a step waits for the device, and the host's work is O(batch), not O(pages).

Batches over the largest bucket run the same inputs eagerly (said once in the log); so does
every step with `capture=False` and off CUDA, where the CPU kernels read the rows' pages
gathered from the slots' table.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from common.kv_pool import KVPool, pages_needed
from common.model.attention import AttentionBatch
from common.model.decode_slots import DecodeSlots
from common.model.llama import LlamaModel
from common.model.spec import ModelSpec
from common.model.triton_attention import decode_split_counts, num_sms

logger = logging.getLogger(__name__)

_SMALL_BUCKETS = (1, 2, 4, 8)
_COLUMNS = 3  # slots, lengths, split counts


def graph_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_bs (max_bs itself last when off the grid)."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs {max_bs} must be at least 1")
    buckets = [b for b in _SMALL_BUCKETS if b <= max_bs]
    buckets += list(range(16, max_bs + 1, 16))
    if buckets[-1] != max_bs:
        buckets.append(max_bs)
    return buckets


def bucket_for(bs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds `bs` rows, or None (run without a graph)."""
    return next((b for b in buckets if b >= bs), None)


class GraphHost(Protocol):
    """What the graphs read of the ModelRunner that owns them."""

    device: torch.device
    context_length: int
    layer_stride: int
    pool: KVPool
    model: LlamaModel
    slots: DecodeSlots
    spec: ModelSpec

    @property
    def page_size(self) -> int: ...


class DecodeGraphs:
    """The decode step's static buffers and, on CUDA with `capture`, one captured graph per
    bucket up to `max_bs`."""

    def __init__(
        self, runner: GraphHost, max_bs: int, *, capture: bool, pad: bool | None = None
    ) -> None:
        """`pad`: steps padded to their bucket with padding rows even when no graph runs
        (default: only where graphs are captured; tests run the padding on the CPU)."""
        self.runner = runner
        self.slots = runner.slots
        self.buckets = graph_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.is_captured = False
        self._capture = capture and runner.device.type == "cuda"
        self._pad = self._capture if pad is None else pad
        device = runner.device
        # rows a step may have: every slot (a column is padded to 16 bytes: aligned columns)
        self.num_rows = n = -(-max(self.slots.num_slots, self.max_bs) // 2) * 2
        self._host = [
            torch.zeros(_COLUMNS * n, dtype=torch.long, pin_memory=self._capture)
            for _ in range(2)  # alternating: a step fills one while the last one's copy runs
        ]
        self._copied: list[Any] = [None, None]
        self._turn = 0
        self.static = torch.zeros(_COLUMNS * n, dtype=torch.long, device=device)
        self.slot_ids = self.static[:n]
        self.lens = self.static[n : 2 * n]
        self.splits = self.static[2 * n :]
        self._sms = num_sms(device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._mempool: Any = None
        self._said_eager = False

    def capture(self) -> None:
        """Capture every bucket's graph (CUDA; largest first, so smaller ones share its memory
        pool). Inputs are the padding rows: one token each on the spare page."""
        if not self._capture or self.is_captured:
            return
        self._stage([], [], self.max_bs)
        device = self.runner.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for bs in reversed(self.buckets):
                self._forward(bs, 0, merge=True)  # warm-up outside the capture (allocations)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._mempool, stream=stream):
                    self.logits[bs] = self._forward(bs, 0, merge=True)
                if self._mempool is None:
                    self._mempool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.is_captured = True

    def run(self, slots: Sequence[int], seq_lens: Sequence[int]) -> torch.Tensor:
        """One decode step of the requests in `slots` at these lengths (each feeds its
        slot's next token at position seq_len - 1): [bs, vocab] logits, a view of the
        bucket's static buffer when a graph ran (read it before the next step)."""
        bs = len(slots)
        if bs != len(seq_lens):
            raise ValueError(f"{bs} slots for {len(seq_lens)} lengths")
        if bs > self.num_rows:
            raise ValueError(f"a decode step of {bs} requests exceeds the {self.num_rows} slots")
        for slot, n in zip(slots, seq_lens):
            self.slots.check_step(slot, n)
            if n > self.runner.context_length:
                raise ValueError(f"{n} tokens exceed the context length")
        bucket = bucket_for(bs, self.buckets) if self.is_captured or self._pad else None
        rows = bucket or bs
        splits = self._stage(slots, seq_lens, rows)
        if bucket is not None and self.is_captured:
            self.graphs[bucket].replay()
            return self.logits[bucket][:bs]
        if self._capture and not self._said_eager:
            self._said_eager = True
            logger.info(
                "a decode batch of %d requests runs without a CUDA graph (graphs up to "
                "--cuda-graph-max-bs %d): such batches run eagerly",
                bs,
                self.max_bs,
            )
        max_pages = pages_needed(max(seq_lens, default=1), self.runner.page_size)
        with torch.inference_mode():
            logits = self._forward(rows, max_pages, merge=bool(splits.max(initial=1) > 1))
        return logits[:bs]

    def feed_tokens(self, token_ids: torch.Tensor) -> None:
        """The last step's sampled tokens ([bs] on the device) into its rows' slots: the
        inputs of their next step, written on the device (call before the next step)."""
        bs = token_ids.shape[0]
        self.slots.tokens.index_copy_(0, self.slot_ids[:bs], token_ids)

    def _stage(self, slots: Sequence[int], seq_lens: Sequence[int], rows: int) -> np.ndarray:
        """The slots' staged changes to the device, then this step's columns in one copy,
        padded to `rows` with the padding slot; returns the split counts."""
        n, bs = self.num_rows, len(slots)
        turn = self._turn
        self._turn ^= 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # that buffer's last copy has read it
        host = self._host[turn]
        h = host.numpy()
        h[:bs] = slots
        h[bs:rows] = self.slots.padding_slot
        h[n : n + bs] = seq_lens
        h[n + bs : n + rows] = 1
        splits = decode_split_counts(seq_lens, self.runner.spec.num_kv_heads, self._sms)
        h[2 * n : 2 * n + bs] = splits
        h[2 * n + bs : 2 * n + rows] = 1
        self.slots.flush()
        self.static.copy_(host, non_blocking=self._capture)
        if self._capture:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.runner.device))
            self._copied[turn] = event
        return splits

    def _forward(self, bs: int, max_pages: int, *, merge: bool) -> torch.Tensor:
        """The step for the first `bs` rows of the static columns: tokens, positions and
        write slots gathered from the slots' rows on the device. `max_pages`: pages of the
        longest sequence, for the backends that read gathered rows (0: unknown, a graph:
        the Triton kernels read the table in place)."""
        runner = self.runner
        slots = self.slot_ids[:bs]
        lens = self.lens[:bs]
        positions = lens - 1
        ps = runner.page_size
        table = self.slots.page_table
        pages = table[slots, torch.div(positions, ps, rounding_mode="floor")].long()
        write_slots = pages * (runner.layer_stride * ps) + positions % ps
        batch = AttentionBatch(
            write_slots=write_slots,
            read_rows=None,
            seq_lens=lens,
            page_table=table,
            slots=slots,
            splits=self.splits[:bs],
            max_pages=max_pages,
            merge=merge,
        )
        tokens = self.slots.tokens[slots]
        hidden = runner.model.forward(tokens, positions, runner.pool, batch, None)
        return runner.model.logits(hidden)
