"""Decode as CUDA graphs, one per batch bucket, over static input buffers.

A SmolLM2 decode step is about 800 kernel launches; at batch 1 launching them costs more
than running them. Each bucket (1, 2, 4, 8, then every 16 up to `--cuda-graph-max-bs`,
nano-vllm's and SGLang's shape) is captured once, after the KV pool exists (its address is
baked into the graph). A step then:
  1. writes its inputs into one pinned host buffer (token ids, positions' lengths, KV write
     slots, page table) and copies them to the device in ONE non-blocking copy: the page
     table is stored page-major ([pages, rows]), so the prefix of columns the batch uses is
     one contiguous block whatever the graph's width;
  2. replays the bucket's graph (no host synchronisation inside: attention reads lengths
     and pages from the device, and the padding rows decode one token on a scratch page);
  3. returns the bucket's static logits, first `bs` rows.
The sampler's one `.tolist()` is the step's only synchronisation.

On the CPU (and with `capture=False`) the same buffers run the model eagerly: the padding,
the scratch page and the page-major table are tested where no GPU is.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from common.kv_pool import KVPool, pages_needed
from common.model.attention import AttentionBatch
from common.model.llama import LlamaModel

_SMALL_BUCKETS = (1, 2, 4, 8)
# Tokens per sequence a graph's page table holds: its width sets the attention kernel's
# grid, so longer sequences (rare) run the step without a graph rather than widen every one.
GRAPH_MAX_CONTEXT = 32768


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

    @property
    def page_size(self) -> int: ...


class DecodeGraphs:
    """The decode step's static buffers and, on CUDA, one captured graph per bucket."""

    def __init__(self, runner: GraphHost, max_bs: int, *, capture: bool) -> None:
        self.runner = runner
        self.buckets = graph_buckets(max_bs)
        self.max_bs = n = self.buckets[-1]
        self.width = pages_needed(
            min(runner.context_length, GRAPH_MAX_CONTEXT), runner.page_size
        )  # pages per row
        self.is_captured = False
        self._capture = capture and runner.device.type == "cuda"
        device = runner.device
        # Padding rows decode one token here: their KV write and read touch no live page
        # (the pool's spare page, which the allocator never hands out).
        if not runner.pool.spare_page_ids:
            raise ValueError("decode graphs need a KV pool with a spare page")
        self.scratch_page = runner.pool.spare_page_ids[0]
        self._scratch_row = self.scratch_page * runner.layer_stride
        # [tokens | lengths | write slots | page table, page-major] as one flat buffer
        self._size = 3 * n + self.width * n
        self.host = torch.zeros(self._size, dtype=torch.long, pin_memory=self._capture)
        self._host_np = self.host.numpy()
        self.static = torch.zeros(self._size, dtype=torch.long, device=device)
        self.tokens = self.static[:n]
        self.lens = self.static[n : 2 * n]
        self.slots = self.static[2 * n : 3 * n]
        self.table = self.static[3 * n :].view(self.width, n)  # [page index, row]
        self._copied: torch.cuda.Event | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self._mempool: Any = None

    def fits(self, bs: int, seq_lens: Sequence[int]) -> bool:
        return bs <= self.max_bs and max(seq_lens) <= self.width * self.runner.page_size

    def capture(self) -> None:
        """Capture every bucket's graph (CUDA; largest first, so smaller ones share its memory
        pool). Inputs are the padding rows: one token each on the scratch page."""
        if not self._capture or self.is_captured:
            return
        self._fill([], [], [], self.max_bs)
        self.static.copy_(self.host)
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for bs in reversed(self.buckets):
                self._forward(bs)  # warm-up outside the capture (Triton compiles, allocs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._mempool, stream=stream):
                    self.logits[bs] = self._forward(bs)
                if self._mempool is None:
                    self._mempool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.current_stream(self.runner.device).wait_stream(stream)
        torch.cuda.synchronize(self.runner.device)
        self.is_captured = True

    def run(
        self,
        token_ids: Sequence[int],
        seq_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """One decode step through the bucket's graph (eagerly without one): [bs, vocab]."""
        bs = len(token_ids)
        bucket = bucket_for(bs, self.buckets)
        assert bucket is not None and self.fits(bs, seq_lens)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the host buffer
        used = self._fill(token_ids, seq_lens, page_tables, bucket)
        # one copy: tokens, lengths, slots and the table's used columns are a prefix
        end = 3 * self.max_bs + used * self.max_bs
        self.static[:end].copy_(self.host[:end], non_blocking=self._capture)
        if self._capture:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if self.is_captured:
            self.graphs[bucket].replay()
            return self.logits[bucket][:bs]
        with torch.inference_mode():
            return self._forward(bucket)[:bs]

    def _fill(
        self,
        token_ids: Sequence[int],
        seq_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
        bucket: int,
    ) -> int:
        """Write a step's inputs into the host buffer, padding rows up to `bucket`; returns
        the page-table columns in use."""
        n, ps, stride = self.max_bs, self.runner.page_size, self.runner.layer_stride
        h = self._host_np
        bs = len(token_ids)
        lens = np.ones(bucket, dtype=np.int64)
        lens[:bs] = seq_lens
        h[:bs] = token_ids
        h[bs:bucket] = 0
        h[n : n + bucket] = lens
        pages_used = (lens + ps - 1) // ps
        width = int(pages_used.max())
        table = h[3 * n :].reshape(self.width, n)
        if bs:
            # every row's pages at once: (page index, row) coordinates of one flat list
            used = pages_used[:bs]
            flat = np.fromiter(
                itertools.chain.from_iterable(p[:u] for p, u in zip(page_tables, used.tolist())),
                dtype=np.int64,
                count=int(used.sum()),
            )
            first = np.cumsum(used) - used  # each row's first page in `flat`
            table[np.arange(flat.size) - np.repeat(first, used), np.repeat(np.arange(bs), used)] = (
                flat * stride
            )
            last = lens[:bs] - 1  # each row's new token: its page and slot
            h[2 * n : 2 * n + bs] = flat[first + last // ps] * (stride * ps) + last % ps
        table[:width, bs:bucket] = self._scratch_row
        h[2 * n + bs : 2 * n + bucket] = self.scratch_page * stride * ps
        return width

    def _forward(self, bs: int) -> torch.Tensor:
        runner = self.runner
        rows = self.table[:, :bs].t()  # [bs, width], page-major underneath
        if not self._capture:
            rows = rows.contiguous()  # the CPU kernels want rows of pages contiguous
        lens = self.lens[:bs]
        batch = AttentionBatch(write_slots=self.slots[:bs], read_rows=rows, seq_lens=lens)
        hidden = runner.model.forward(self.tokens[:bs], lens - 1, runner.pool, batch, None)
        return runner.model.logits(hidden)
