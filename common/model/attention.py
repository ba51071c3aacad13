"""Attention over the paged KV pool behind one interface, one backend chosen at start-up.

    cpu     the C kernels (common.model.cpu.paged_attention): decode and prefill read the pages
            in place; a kernel that did not build, or does not take this shape or dtype,
            leaves its half to the torch backend
    triton  CUDA (or Triton's interpreter, for tests): decode and extend read K/V in place
            through the page table (common.model.triton_attention), with no per-layer gather
            and no repeated KV heads; CUDA-graph capturable
    torch   any device: pages gathered per layer and SDPA on the copies (the reference, and
            the fallback where neither of the others runs)

`make_attention_backend("auto", ...)` takes triton on CUDA where Triton imports, cpu on the
CPU. The model calls `prepare` once per forward (per-batch metadata every layer shares), then
`decode` or `extend` in each layer, after the layer's new K and V are in the pool.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from common.config import ATTENTION_BACKENDS
from common.kv_pool import KVPool
from common.model.cpu.paged_attention import (
    PagedDecodeAttention,
    PagedPrefillAttention,
    paged_decode_attention,
    paged_prefill_attention,
)
from common.model.spec import ModelSpec

logger = logging.getLogger(__name__)


@dataclass
class AttentionBatch:
    """Where this forward's tokens write their KV and which KV each request attends to.

    write_slots: per new token, its slot in the pool's token view (KVPool.tokens) for layer 0's K;
    layer l's K slot is that + 2 * l * page_size and its V slot + (2 * l + 1) * page_size.
    read_rows: per request (extend; host tensors) or padded per batch (decode, when given),
    the pool rows of layer 0's K. Layer l's K row is row + 2 * l and its V row is row + 2 * l
    + 1. A decode batch names its sequences by slot instead (common.model.decode_slots):
    `page_table` [slots, W] int32 page ids on the device, `slots` [B] each sequence's row of
    it; a backend that reads gathered rows builds them from those (`max_pages` wide).
    """

    write_slots: torch.Tensor
    read_rows: list[torch.Tensor] | torch.Tensor | None
    # extend: per request (first new token index, new tokens, total tokens, cached prefix)
    spans: list[tuple[int, int, int, int]] | None = None
    # decode: tokens per sequence [B] (set for decode only)
    seq_lens: torch.Tensor | None = None
    page_table: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    splits: torch.Tensor | None = None  # [B] int: each sequence's attention splits (Triton)
    max_pages: int = 0  # pages of the longest sequence (0: not known; a CUDA graph)
    merge: bool = True  # whether a sequence has more than one split (Triton)
    # what a backend's `prepare` builds once for all layers (masks, padded tables, buffers)
    meta: dict[str, Any] | None = None

    @property
    def is_decode(self) -> bool:
        return self.seq_lens is not None

    def decode_rows(self, layer_rows: int) -> torch.Tensor:
        """Decode: the pool rows of each sequence's pages, [B, max_pages] contiguous (given,
        or gathered from the slots' page table)."""
        if isinstance(self.read_rows, torch.Tensor):
            return self.read_rows
        assert self.page_table is not None and self.slots is not None and self.max_pages > 0
        pages = self.page_table[self.slots, : self.max_pages]
        self.read_rows = pages.long().mul_(layer_rows).contiguous()
        return self.read_rows


class AttentionBackend(ABC):
    """Attention of one forward's new tokens over the pool, for one model shape and dtype."""

    name = "abstract"

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self.dtype = dtype
        self.device = device
        self.num_groups = spec.num_heads // spec.num_kv_heads  # query heads per KV head
        self.q_size = spec.num_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.layer_rows = 2 * spec.num_layers  # pool rows per page

    @property
    def fills_out(self) -> bool:
        """Whether `extend` writes into a given output buffer (else it allocates its own
        and a buffer would cost a copy)."""
        return True

    def prepare(self, pool: KVPool, batch: AttentionBatch) -> None:
        """Build what every layer of this forward shares (called once, before the layers)."""
        batch.meta = {}

    @abstractmethod
    def decode(
        self, q: torch.Tensor, pool: KVPool, batch: AttentionBatch, layer: int
    ) -> torch.Tensor:
        """q [B, heads, head_dim], one token per sequence (its KV already in the pool);
        returns [B, heads * head_dim]."""

    @abstractmethod
    def extend(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        pool: KVPool,
        batch: AttentionBatch,
        layer: int,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [T, heads, head_dim], the spans' new tokens; k_new [T, kv_heads, head_dim] and
        v_new [T, kv_size] are theirs, already written to the pool. Causal within a span,
        after its cached prefix. Returns [T, heads * head_dim] (in `out` if given)."""


class TorchAttention(AttentionBackend):
    """Pages gathered per layer and SDPA on the copies: any device, the reference path."""

    name = "torch"

    @property
    def fills_out(self) -> bool:
        return False

    def prepare(self, pool: KVPool, batch: AttentionBatch) -> None:
        batch.meta = {}
        if batch.seq_lens is None:
            assert isinstance(batch.read_rows, list)
            # the spans' page rows (host tensors) on the device, once for all layers
            batch.meta["rows"] = [r.to(self.device) for r in batch.read_rows]
            return
        rows = batch.decode_rows(self.layer_rows)
        # SDPA over gathered pages masks the padding past each sequence's length
        width = rows.shape[1] * pool.page_size
        padding = torch.arange(width, device=self.device)[None, :] >= batch.seq_lens[:, None]
        bias = torch.zeros(padding.shape, dtype=self.dtype, device=self.device)
        batch.meta["decode_bias"] = bias.masked_fill_(padding, float("-inf"))[:, None, None, :]
        n = rows.numel()
        # buffers reused across layers keep the gathered KV in cache (4x faster than fresh ones)
        batch.meta["gather_out"] = (
            pool.rows.new_empty(n, pool.rows.shape[1]),
            pool.rows.new_empty(n, pool.rows.shape[1]),
        )

    def decode(
        self, q: torch.Tensor, pool: KVPool, batch: AttentionBatch, layer: int
    ) -> torch.Tensor:
        assert isinstance(batch.read_rows, torch.Tensor) and batch.meta is not None
        bias = batch.meta["decode_bias"]
        gather_out = batch.meta["gather_out"]
        assert isinstance(bias, torch.Tensor) and isinstance(gather_out, tuple)
        k, v = self._gather(pool, batch.read_rows, layer, gather_out)  # [B, T, kvh, d]
        # Each KV head's query heads as rows of one query block: [B, kv_heads, groups, d].
        # Query head h reads KV head h // groups, as in GQA; no KV is repeated, and SDPA
        # with an additive mask runs 1.3-1.7x faster than with enable_gqa and a bool mask.
        bsz = q.shape[0]
        qg = q.reshape(bsz, self.spec.num_kv_heads, self.num_groups, self.spec.head_dim)
        out = F.scaled_dot_product_attention(
            qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, scale=self.scale
        )
        return out.reshape(bsz, self.q_size)

    def extend(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        pool: KVPool,
        batch: AttentionBatch,
        layer: int,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        assert batch.spans is not None and batch.meta is not None
        outs = []
        for i, ((start, num_new, total, prefix), rows) in enumerate(
            zip(batch.spans, batch.meta["rows"])
        ):
            outs.append(
                self._span(
                    q, k_new, v_new, pool, batch, layer, i, start, num_new, total, prefix, rows
                )
            )
        result = torch.cat(outs) if len(outs) > 1 else outs[0]
        if out is None:
            return result
        return out.copy_(result)

    def _span(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        pool: KVPool,
        batch: AttentionBatch,
        layer: int,
        i: int,
        start: int,
        num_new: int,
        total: int,
        prefix: int,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        # The new tokens' K/V are at hand: only a cached prefix is read from the pages.
        k = k_new[start : start + num_new]
        v = v_new[start : start + num_new].reshape(num_new, *k.shape[1:])
        qr = q[start : start + num_new].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        if prefix == 0:
            out = F.scaled_dot_product_attention(
                qr, self._heads(k), self._heads(v), is_causal=True, scale=self.scale
            )
        else:
            num_pages = -(-prefix // pool.page_size)
            pk, pv = self._gather(pool, rows[:num_pages], layer)
            if q.device.type == "cpu":
                out = self._after_prefix(qr, k, v, pk[:prefix], pv[:prefix])
            else:
                k, v = torch.cat([pk[:prefix], k]), torch.cat([pv[:prefix], v])
                mask = self._prefix_mask(batch, i, prefix, total, q)
                out = F.scaled_dot_product_attention(
                    qr, self._heads(k), self._heads(v), attn_mask=mask, scale=self.scale
                )
        return out[0].transpose(0, 1).reshape(num_new, self.q_size)

    def _gather(
        self,
        pool: KVPool,
        rows: torch.Tensor,
        layer: int,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the pages in `rows` for one layer: each [..., pages * page_size,
        kv_heads, head_dim]."""
        shape = (
            *rows.shape[:-1],
            rows.shape[-1] * pool.page_size,
            self.spec.num_kv_heads,
            self.spec.head_dim,
        )
        base = rows.reshape(-1) + 2 * layer
        if out is None:
            return (
                pool.rows.index_select(0, base).view(shape),
                pool.rows.index_select(0, base + 1).view(shape),
            )
        torch.index_select(pool.rows, 0, base, out=out[0])
        torch.index_select(pool.rows, 0, base + 1, out=out[1])
        return out[0].view(shape), out[1].view(shape)

    @staticmethod
    def _prefix_mask(
        batch: AttentionBatch, i: int, prefix: int, total: int, q: torch.Tensor
    ) -> torch.Tensor:
        """Causal after a cached prefix (CUDA; the CPU splits the pass, `_after_prefix`):
        new token j sees keys 0..prefix + j. Additive (0 or -inf) in the model's dtype and
        built once per forward, not per layer: SDPA turns a bool mask into this on every call
        (with the comparison, 6% of a chunked 4k prefill on the CPU)."""
        assert batch.meta is not None
        masks = batch.meta.setdefault("prefix_masks", {})
        assert isinstance(masks, dict)
        if i not in masks:
            key_pos = torch.arange(total, device=q.device)
            query_pos = torch.arange(prefix, total, device=q.device)
            hidden = key_pos[None, :] > query_pos[:, None]
            mask = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device)
            masks[i] = mask.masked_fill_(hidden, float("-inf"))
        return masks[i]

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[n, kv_heads, d] -> [1, heads, n, d], each KV head repeated for its query heads.
        4-D inputs with the KV heads repeated run SDPA's flash kernel on CPU; 3-D or
        enable_gqa run the math kernel (12x slower at 4096 tokens, quadratic memory)."""
        return x.transpose(0, 1).repeat_interleave(self.num_groups, dim=0).unsqueeze(0)

    def _after_prefix(
        self,
        qr: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefix_k: torch.Tensor,
        prefix_v: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of new tokens after a cached prefix (a later chunk, a cache hit), CPU.

        As two flash passes merged by their log-sum-exps: the prefix's keys, all visible,
        and the new tokens' own, causal. One masked pass over the concatenated keys reads
        a [new, total] mask per head and skips no block above the diagonal, so is slower;
        the two agree within float rounding (test_model_runner.py: three chunks against one pass).
        """
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out_new, lse_new = flash(qr, self._heads(k), self._heads(v), 0.0, True, scale=self.scale)
        out_pre, lse_pre = flash(
            qr, self._heads(prefix_k), self._heads(prefix_v), 0.0, False, scale=self.scale
        )
        top = torch.maximum(lse_new, lse_pre)
        w_new = (lse_new - top).exp_().unsqueeze(-1)
        w_pre = (lse_pre - top).exp_().unsqueeze(-1)
        merged = (out_new.float() * w_new + out_pre.float() * w_pre) / (w_new + w_pre)
        return merged.to(qr.dtype)


class CpuKernelAttention(TorchAttention):
    """The C kernels where they build and take the shape; torch's path for a missing half."""

    name = "cpu"

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, dtype, device)
        args = (device, dtype, spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self.decode_kernel: PagedDecodeAttention | None = paged_decode_attention(*args)
        self.prefill_kernel: PagedPrefillAttention | None = paged_prefill_attention(*args)

    @property
    def fills_out(self) -> bool:
        return self.prefill_kernel is not None

    def prepare(self, pool: KVPool, batch: AttentionBatch) -> None:
        kernel = self.decode_kernel if batch.is_decode else self.prefill_kernel
        if kernel is not None:
            batch.meta = {}  # the kernels read the host-side rows as they are
            if batch.is_decode:
                batch.decode_rows(self.layer_rows)
            return
        super().prepare(pool, batch)

    def decode(
        self, q: torch.Tensor, pool: KVPool, batch: AttentionBatch, layer: int
    ) -> torch.Tensor:
        if self.decode_kernel is None:
            return super().decode(q, pool, batch, layer)
        assert isinstance(batch.read_rows, torch.Tensor) and batch.seq_lens is not None
        return self.decode_kernel(
            pool.rows, batch.read_rows, batch.seq_lens, layer, q, pool.page_size, self.scale
        )

    def extend(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        pool: KVPool,
        batch: AttentionBatch,
        layer: int,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.prefill_kernel is None:
            return super().extend(q, k_new, v_new, pool, batch, layer, out)
        assert batch.spans is not None and isinstance(batch.read_rows, list)
        # every span's keys from its pages, the new tokens' among them (just written)
        result = q.new_empty(q.shape[0], self.q_size) if out is None else out
        for (start, num_new, _, prefix), rows in zip(batch.spans, batch.read_rows):
            end = start + num_new
            self.prefill_kernel(
                pool.rows,
                rows,
                layer,
                q[start:end],
                prefix,
                result[start:end],
                pool.page_size,
                self.scale,
            )
        return result


class TritonAttention(AttentionBackend):
    """Paged attention in Triton kernels: decode and extend read K/V where the pages lie."""

    name = "triton"

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, dtype, device)
        from common.model import triton_attention, triton_extend

        self._kernels = triton_attention
        self._extend = triton_extend

    def prepare(self, pool: KVPool, batch: AttentionBatch) -> None:
        batch.meta = {}
        if batch.seq_lens is not None:
            assert batch.page_table is not None and batch.slots is not None
            # the splits' buffers, shared by every layer of this step (stream order)
            bsz = batch.seq_lens.shape[0]
            batch.meta["partials"] = self._kernels.split_buffers(
                bsz, self.spec.num_heads, self.spec.head_dim, self.device
            )
            return
        assert batch.spans is not None and isinstance(batch.read_rows, list)
        # one padded table of page ids and the spans' offsets for all layers, copied to the
        # device once per forward (the extend kernel runs every span in one launch)
        width = max(r.shape[0] for r in batch.read_rows)
        table = torch.zeros((len(batch.spans), width), dtype=torch.int32)
        for i, rows in enumerate(batch.read_rows):
            # host tensors of layer-0 K rows: their page ids, no copy back from the device
            table[i, : rows.shape[0]] = torch.div(rows, self.layer_rows, rounding_mode="floor")
        spans = torch.tensor([[s[0], s[1], s[3]] for s in batch.spans], dtype=torch.long)
        pin = self.device.type == "cuda"
        if pin:
            table, spans = table.pin_memory(), spans.pin_memory()
        spans_d = spans.to(self.device, non_blocking=pin)
        batch.meta["table"] = table.to(self.device, non_blocking=pin)
        batch.meta["q_starts"], batch.meta["num_new"], batch.meta["prefixes"] = spans_d.unbind(1)
        batch.meta["max_new"] = max(s[1] for s in batch.spans)

    def decode(
        self, q: torch.Tensor, pool: KVPool, batch: AttentionBatch, layer: int
    ) -> torch.Tensor:
        assert batch.page_table is not None and batch.slots is not None
        assert batch.seq_lens is not None and batch.splits is not None
        assert batch.meta is not None
        return self._kernels.paged_decode_attention(
            pool.rows,
            batch.page_table,
            batch.slots,
            batch.seq_lens,
            batch.splits,
            layer,
            q,
            pool.page_size,
            self.spec.num_layers,
            self.scale,
            self.spec.num_kv_heads,
            partials=batch.meta["partials"],
            merge=batch.merge,
        )

    def extend(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        pool: KVPool,
        batch: AttentionBatch,
        layer: int,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        meta = batch.meta
        assert meta is not None
        max_new = meta["max_new"]
        assert isinstance(max_new, int)
        return self._extend.paged_extend_attention(
            pool.rows,
            meta["table"],
            meta["q_starts"],
            meta["num_new"],
            meta["prefixes"],
            max_new,
            layer,
            q,
            pool.page_size,
            self.spec.num_layers,
            self.scale,
            self.spec.num_kv_heads,
            out=out,
        )


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can serve on `device`: Triton imports, and there is CUDA,
    its interpreter, or a dry run's meta device (imported only when asked: the CPU
    backends never load Triton)."""
    from common.model.triton_attention import triton_runs_on

    return triton_runs_on(device)


def make_attention_backend(
    name: str,
    spec: ModelSpec,
    dtype: torch.dtype,
    device: torch.device,
    *,
    cpu_kernels: bool = True,
) -> AttentionBackend:
    """The backend `name` (one of ATTENTION_BACKENDS) for this model on `device`.

    auto: triton on CUDA and on `meta` (a dry run; torch there when Triton is missing, with a
    warning), cpu on the CPU (torch with cpu_kernels off). An explicit name that cannot run
    here is an error."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; expected one of {list(ATTENTION_BACKENDS)}"
        )
    if name == "auto":
        if device.type in ("cuda", "meta"):
            if triton_usable(device):
                name = "triton"
            else:
                logger.warning(
                    "Triton is not importable: attention on CUDA runs on gathered "
                    "pages (SDPA), several times slower"
                )
                name = "torch"
        else:
            name = "cpu" if cpu_kernels else "torch"
    if name == "triton":
        if not triton_usable(device):
            raise ValueError(
                "--attention-backend triton needs Triton (and CUDA, or "
                "TRITON_INTERPRET=1 for tests)"
            )
        return TritonAttention(spec, dtype, device)
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU, not {device}")
        return CpuKernelAttention(spec, dtype, device)
    return TorchAttention(spec, dtype, device)
