"""ModelRunner: batched extend (prefill, chunked) and decode over the paged KV pool."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from common.kv_pool import KVLayout, KVPool, pages_needed, torch_dtype
from common.model.attention import AttentionBatch
from common.model.cpu import choice_cache
from common.model.cpu.gemm import (
    DECODE_BUCKETS,
    PREFILL_BUCKETS,
    SUBSET_FROM_ROWS,
    bucket_of,
)
from common.model.cpu.library import report_variant
from common.model.cuda_graph import DecodeGraphs
from common.model.decode_slots import DecodeSlots, default_num_slots
from common.model.llama import LlamaModel
from common.model.loader import load_spec, load_state_dict, resolve_model_dir
from common.model.memory import DEFAULT_CUDA_FRACTION, device_memory, kv_pool_bytes
from common.model.spec import ModelSpec
from common.work_done import COMPLETED, WorkDone, record_work_done

logger = logging.getLogger(__name__)

DEFAULT_GRAPH_MAX_BS = 128  # --cuda-graph-max-bs
DEFAULT_WARMUP_TOKENS = 8192  # the prefill the pool's sizing leaves activations for
# a bound on the forward passes one row bucket takes to choose its kernels (it takes
# trials x kernels, 25 at most)
MAX_CHOOSING_PASSES = 60
LOGPROB_ROWS = 1024  # rows of logits at a time when every position's logprobs are read


@dataclass(frozen=True)
class ExtendRequest:
    """One request's share of an extend batch.

    The first `prefix_len` tokens are already in `page_ids`; `token_ids` are new and get
    their KV written after them. `page_ids` must cover prefix_len + len(token_ids) tokens.
    `logprob_targets`, when given, are the token ids whose logprob to read at each new
    position (target i is the token that follows new token i; at most len(token_ids)).
    """

    token_ids: Sequence[int]
    prefix_len: int
    page_ids: Sequence[int]
    logprob_targets: Sequence[int] | None = None
    top_logprobs: int = 0


@dataclass
class ExtendResult:
    logits: torch.Tensor  # [B, vocab] float32 at each request's last new token
    # per request: logprobs of its targets (None when not asked), and top-k per position
    target_logprobs: list[torch.Tensor | None] = field(default_factory=list)
    top_logprobs: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    # the end of the device work that wrote this pass's KV: pages are read (a transfer)
    # only once it has completed (common.work_done)
    done: WorkDone = COMPLETED


class ModelRunner:
    """Owns the model weights and the KV pool of one node; the one place that runs torch."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        *,
        dtype: str = "float32",
        device: str = "cpu",
        page_size: int = 16,
        num_pages: int | None = None,
        max_total_tokens: int | None = None,
        kv_memory_bytes: int | None = None,
        mem_fraction_static: float | None = None,
        context_length: int | None = None,
        pack_weights: bool = True,
        cpu_kernels: bool = True,
        attention_backend: str = "auto",
        cuda_graph_max_bs: int = DEFAULT_GRAPH_MAX_BS,
        disable_cuda_graph: bool = False,
        decodes: bool = True,
        warmup_tokens: int = DEFAULT_WARMUP_TOKENS,
        kernel_cache_dir: str | None = None,
        max_decode_slots: int | None = None,
    ) -> None:
        """`pack_weights`: on the CPU, also keep packed weights (twice the weight memory:
        oneDNN's layout, or in bfloat16 with AMX and the C kernels the AMX tiles' layout;
        three times in float32 with AVX-512 or AVX2 and the C kernels, whose panel layout comes
        too) so the products can run on whichever kernel measures fastest.
        `cpu_kernels`: on the CPU, the C kernels of common.model.cpu.library where they
        build (decode attention over the pages in place, the fused per-layer steps, the
        AMX product, the float32 panel product).
        `attention_backend`: common.model.attention's choice (auto: triton on CUDA, the C
        kernels on the CPU).
        The pool: `num_pages`, else `max_total_tokens`, else `kv_memory_bytes`, else
        `mem_fraction_static` of the device less what is in use after the weights and a
        warm-up forward at the largest batch (`warmup_tokens` prefill tokens, decode at
        `cuda_graph_max_bs`) — the default on CUDA, at common.model.memory's fraction; on
        the CPU without it, 2 GiB.
        On CUDA decode runs as CUDA graphs, one per batch bucket up to `cuda_graph_max_bs`
        (common.model.cuda_graph), captured at `warmup()` or the first decode, unless
        `disable_cuda_graph`; either way a step's inputs go to the device in one copy.
        `decodes`: False for a runner that never decodes in batches (a prefill node): no
        graph buffers, and the sizing's warm-up runs no decode step.
        `kernel_cache_dir`: on the CPU, where warm-up's kernel choice is kept and found
        again (common.model.cpu.choice_cache); None: measured at every start.
        `max_decode_slots`: requests a decode step can hold at once (common.model.decode_slots;
        None: the pool's default max running requests, decode_slots.default_num_slots).
        On CUDA the device (`cuda:N`) is made this process's current one first: Triton,
        CUDA graphs, events and streams all launch on the current device."""
        self.device = use_device(device)
        self.spec = spec
        self.dtype_name = dtype
        self.context_length = min(context_length or spec.context_length, spec.context_length)
        self.model = LlamaModel(
            spec,
            weights,
            torch_dtype(dtype),
            self.device,
            pack=pack_weights,
            cpu_kernels=cpu_kernels,
            attention_backend=attention_backend,
        )
        if self.device.type == "cpu":
            report_variant(cpu_kernels)
        self.layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, page_size, dtype)
        self.layer_stride = 2 * spec.num_layers  # pool rows per page
        self.cuda_graph_max_bs = cuda_graph_max_bs
        self.decodes = decodes
        self.warmup_tokens = warmup_tokens
        self.kernel_cache_dir = kernel_cache_dir
        self.max_decode_slots = max_decode_slots
        if num_pages is None:
            if max_total_tokens is None and kv_memory_bytes is None:
                if mem_fraction_static is not None or self.device.type == "cuda":
                    kv_memory_bytes = self._bytes_by_fraction(
                        mem_fraction_static or DEFAULT_CUDA_FRACTION
                    )
                else:
                    kv_memory_bytes = 2 << 30
            num_pages = KVPool.num_pages_for(self.layout, max_total_tokens, kv_memory_bytes)
        # one spare page: decode graphs' padding rows write their KV there, outside the pages
        # any request or peer can hold
        self.pool = KVPool(self.layout, num_pages, self.device, spare_pages=1)
        logger.info(
            "KV pool: %d pages of %d tokens, %.2f GiB on %s",
            num_pages,
            page_size,
            self.pool.nbytes / (1 << 30),
            self.device,
        )
        # graphs or not, a step's inputs travel in one copy from pinned memory; graphs need
        # the Triton kernels (the torch backend gathers pages by the step's width)
        capture = decodes and not disable_cuda_graph and self.model.attention.name == "triton"
        self.slots, self.graphs = self._decode_state(self.pool, capture)
        if capture and self.slots.num_slots > self.graphs.max_bs:
            logger.info(
                "decode batches of up to %d requests run as CUDA graphs; larger ones (up to "
                "%d) run eagerly (--cuda-graph-max-bs)",
                self.graphs.max_bs,
                self.slots.num_slots,
            )

    def _decode_state(self, pool: KVPool, capture: bool) -> tuple[DecodeSlots, DecodeGraphs]:
        """The decode slots of `pool` (one page row per request, common.model.decode_slots)
        and the step's buffers (graphs when `capture`, on CUDA)."""
        num_slots = self.max_decode_slots
        if num_slots is None:
            num_slots = default_num_slots(pool.num_pages, self.page_size) if self.decodes else 1
        if self.model.chooser is not None:  # the CPU's warm-up decodes its row buckets
            num_slots = max(num_slots, max(DECODE_BUCKETS))
        slots = DecodeSlots(
            num_slots,
            pages_needed(self.context_length, self.page_size),
            self.page_size,
            pool.num_pages,
            pool.spare_page_ids[0],
            self.device,
        )
        self.slots = slots  # the graphs read it from their host
        bs = self.cuda_graph_max_bs if self.decodes else 1
        return slots, DecodeGraphs(self, bs, capture=capture)

    def _bytes_by_fraction(self, fraction: float) -> int:
        """The pool's bytes by --mem-fraction-static, after a warm-up forward at the largest
        batch on a temporary pool has shown the activations' peak (CUDA)."""
        activation = 0
        if self.device.type == "cuda":
            tokens = max(1, min(self.warmup_tokens, self.context_length - 2))
            bs = self.cuda_graph_max_bs
            pages = pages_needed(tokens + 1, self.page_size) + 1
            self.pool = KVPool(self.layout, pages, self.device, spare_pages=1)
            saved_slots = self.max_decode_slots
            self.max_decode_slots = max(bs, 1)
            self.slots, self.graphs = self._decode_state(self.pool, capture=False)
            self.max_decode_slots = saved_slots
            torch.cuda.synchronize(self.device)
            base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            ids = self.pool.allocator.allocate(pages)
            self.extend([ExtendRequest([0] * tokens, 0, ids[:-1])])
            if self.decodes:
                self.decode([0] * bs, [1] * bs, [[ids[-1]]] * bs)  # every row on one page
            torch.cuda.synchronize(self.device)
            activation = torch.cuda.max_memory_allocated(self.device) - base
            del self.pool, self.slots, self.graphs
            torch.cuda.empty_cache()
        memory = device_memory(self.device)
        chosen = kv_pool_bytes(memory, fraction, activation)
        logger.info(
            "--mem-fraction-static %.2f: %.1f of %.1f GiB in use, forward peak %.2f "
            "GiB; KV pool %.2f GiB",
            fraction,
            memory.in_use / (1 << 30),
            memory.total / (1 << 30),
            activation / (1 << 30),
            chosen / (1 << 30),
        )
        return chosen

    @staticmethod
    def from_path(model_path: str | None, *, progress: bool = True, **kwargs) -> ModelRunner:
        model_dir = resolve_model_dir(model_path)
        spec = load_spec(model_dir)
        weights = load_state_dict(model_dir, torch_dtype(kwargs.get("dtype", "float32")), progress)
        return ModelRunner(spec, weights, **kwargs)

    def warmup(self, num_tokens: int = 64) -> None:
        """One small extend and decode step, so a node's first request does not pay torch's
        first-call costs (a process's first prefill takes about three times as long); on
        the CPU, first the product kernels are chosen for every row bucket and fixed
        (`choose_kernels`), so a node's numerics never change once it serves."""
        self.choose_kernels()
        n = max(
            1, min(num_tokens, self.context_length - 2, (self.pool.num_pages - 1) * self.page_size)
        )
        pages = self.pool.allocator.allocate(pages_needed(n + 1, self.page_size))
        try:
            self.extend([ExtendRequest([0] * n, 0, pages)])
            self.decode([0], [n + 1], [pages])
        finally:
            self.pool.allocator.free(pages)
        if self.graphs is not None:
            self.graphs.capture()

    def choose_kernels(self, *, keep_all_copies: bool = False) -> None:
        """The CPU's product kernels, chosen once (common.model.cpu.gemm): decode's row buckets
        and the short prefill ones in forward passes, where the products meet the caches as
        the attention and the fused steps leave them (timed alone, the weights' streaming
        is not what a forward sees, and the order of the kernels differs); the rest by
        timing the products alone (LlamaModel.choose_kernels), which then fixes every
        bucket. The passes' KV goes to pages freed after. With `kernel_cache_dir`, a
        choice kept there for this machine and model is taken instead, and a new one is
        kept."""
        model = self.model
        if model.chooser is None or model.head_chooser is None or model.chooser.is_frozen:
            return
        cached = None
        if self.kernel_cache_dir:
            key = choice_cache.choice_key(self.spec, model.dtype, model.chooser.kernels)
            cached = choice_cache.path_for(self.kernel_cache_dir, key)
            saved = choice_cache.load(cached)
            if saved is not None and model.adopt_kernels(*saved):
                logger.info("CPU kernels: the choice kept in %s", cached)
                return
        self._measure_kernels(keep_all_copies)
        if cached is not None:
            choice_cache.store(cached, model.chooser.choices(), model.head_chooser.choices())

    def _measure_kernels(self, keep_all_copies: bool) -> None:
        model = self.model
        assert model.chooser is not None and model.head_chooser is not None
        choosers = (model.chooser, model.head_chooser)
        ps = self.page_size
        page = self.pool.allocator.allocate(1)  # every sequence of a pass reads this page
        try:
            for rows in DECODE_BUCKETS:
                for _ in range(MAX_CHOOSING_PASSES):
                    if all(bucket_of(rows) in c.choices() for c in choosers):
                        break
                    self.decode([0] * rows, [ps] * rows, [page] * rows)
        finally:
            self.pool.allocator.free(page)
        for rows in PREFILL_BUCKETS:
            num_pages = pages_needed(rows, ps)
            if rows >= SUBSET_FROM_ROWS or rows > self.context_length:
                break
            if num_pages > self.pool.allocator.num_free_pages:
                break  # a small pool: product timing decides
            pages = self.pool.allocator.allocate(num_pages)
            try:
                for _ in range(MAX_CHOOSING_PASSES):
                    if rows in model.chooser.choices():
                        break
                    self.extend([ExtendRequest([0] * rows, 0, pages)])
            finally:
                self.pool.allocator.free(pages)
        model.choose_kernels(keep_all_copies=keep_all_copies)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def _host_rows(self, pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The pool rows of the pages' layer-0 K, on the host."""
        return torch.as_tensor(pages, dtype=torch.long) * self.layer_stride

    def _rows(self, pages: Sequence[int] | torch.Tensor) -> torch.Tensor:
        return self._host_rows(pages).to(self.device)

    def _to_device(self, *columns: list[int]) -> list[torch.Tensor]:
        """Integer lists as device tensors through one copy (pinned and non-blocking on
        CUDA, where four small copies each waited for the device). Each column starts on a
        16-byte boundary, so a kernel's compile never depends on a column's length
        (common.model.triton_launch: alignment is specialised)."""
        padded = [-(-len(c) // 2) * 2 for c in columns]
        flat = torch.zeros(sum(padded), dtype=torch.long)
        at = 0
        for c, size in zip(columns, padded):
            flat[at : at + len(c)] = torch.tensor(c, dtype=torch.long)
            at += size
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        elif self.device.type != "cpu":
            flat = flat.to(self.device)
        parts = flat.split(padded)
        return [p[: len(c)] for p, c in zip(parts, columns)]

    def _write_slots(self, page_ids: Sequence[int], start: int, stop: int) -> list[int]:
        """Slots in the pool's token view of layer 0's K for positions start..stop-1."""
        ps, stride = self.page_size, self.layer_stride * self.page_size
        return [page_ids[p // ps] * stride + p % ps for p in range(start, stop)]

    def _check_span(self, prefix_len: int, num_new: int, page_ids: Sequence[int]) -> None:
        """The span fits the context (so the RoPE table) and its pages, and every page it uses
        is in the pool: the CPU kernels index both unchecked, so a bad span is refused here."""
        total = prefix_len + num_new
        if prefix_len < 0:
            raise ValueError(f"a span cannot start at {prefix_len}")
        if total > self.context_length:
            raise ValueError(f"{total} tokens exceed the context length {self.context_length}")
        used = pages_needed(total, self.page_size)
        if len(page_ids) < used:
            raise ValueError(f"{len(page_ids)} pages cannot hold {total} tokens")
        if used and (min(page_ids[:used]) < 0 or max(page_ids[:used]) >= self.pool.num_pages):
            raise ValueError(f"a page id is outside the pool of {self.pool.num_pages} pages")

    @torch.inference_mode()
    def extend(self, reqs: Sequence[ExtendRequest]) -> ExtendResult:
        """Prefill new tokens of each request (a whole prompt or one chunk of it)."""
        tokens: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        spans, read_rows, last_rows = [], [], []
        for r in reqs:
            n = len(r.token_ids)
            if n == 0:
                raise ValueError("an extend request needs at least one new token")
            self._check_span(r.prefix_len, n, r.page_ids)
            total = r.prefix_len + n
            spans.append((len(tokens), n, total, r.prefix_len))
            # host tensors: each backend moves what it reads to the device once (prepare)
            read_rows.append(self._host_rows(r.page_ids[: pages_needed(total, self.page_size)]))
            tokens.extend(r.token_ids)
            positions.extend(range(r.prefix_len, total))
            write_slots.extend(self._write_slots(r.page_ids, r.prefix_len, total))
            last_rows.append(len(tokens) - 1)
        token_t, position_t, slot_t, last_t = self._to_device(
            tokens, positions, write_slots, last_rows
        )
        batch = AttentionBatch(write_slots=slot_t, read_rows=read_rows, spans=spans)
        need_all = any(r.logprob_targets is not None or r.top_logprobs for r in reqs)
        hidden = self.model.forward(
            token_t, position_t, self.pool, batch, None if need_all else last_t
        )
        done = record_work_done(self.device)  # the KV writes are queued before this point
        if not need_all:
            return ExtendResult(logits=self.model.logits(hidden), done=done)
        result = ExtendResult(logits=self.model.logits(hidden[last_rows]), done=done)
        for r, (start, n, _, _) in zip(reqs, spans):
            if r.logprob_targets is None and not r.top_logprobs:
                result.target_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            targets, top = self._position_logprobs(
                hidden[start : start + n], list(r.logprob_targets or [])[:n], r.top_logprobs
            )
            result.target_logprobs.append(targets)
            result.top_logprobs.append(top)
        return result

    def _position_logprobs(
        self, hidden: torch.Tensor, targets: list[int], k: int
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """Each target's logprob at its position (the first len(targets) rows) and the
        top ``k`` of every row, LOGPROB_ROWS rows of logits at a time (a chunk's whole
        [rows, vocab] would be gigabytes: 8192 x 128k in float32 is 4 GiB)."""
        picked, values, indices = [], [], []
        for lo in range(0, hidden.shape[0], LOGPROB_ROWS):
            logp = torch.log_softmax(self.model.logits(hidden[lo : lo + LOGPROB_ROWS]), dim=-1)
            mine = targets[lo : lo + logp.shape[0]]
            if mine:
                idx = torch.tensor(mine, dtype=torch.long, device=logp.device)
                picked.append(logp[torch.arange(len(mine), device=logp.device), idx])
            if k:
                top = logp.topk(k, dim=-1)
                values.append(top.values)
                indices.append(top.indices)
        return (
            torch.cat(picked) if picked else None,
            (torch.cat(values), torch.cat(indices)) if k else None,
        )

    @torch.inference_mode()
    def decode(
        self,
        token_ids: Sequence[int],
        seq_lens: Sequence[int],
        page_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """One step for many requests given whole: token i sits at position seq_lens[i] - 1
        (its KV is written there) and page_tables[i] covers seq_lens[i] tokens. Returns
        [B, vocab] float32 logits (a view of a graph's buffer: read it before the next step).
        Takes free decode slots for the step (a decode node keeps its requests in slots
        across steps instead: `decode_slots`)."""
        ps = self.page_size
        if self.slots.num_free_slots < len(token_ids):
            raise ValueError(
                f"{len(token_ids)} sequences need decode slots; {self.slots.num_free_slots} free"
            )
        taken: list[int] = []
        try:
            for token, n, pages in zip(token_ids, seq_lens, page_tables):
                slot = self.slots.acquire()
                taken.append(slot)
                self.slots.set_pages(slot, list(pages[: pages_needed(max(n, 1), ps)]))
                self.slots.set_token(slot, int(token))
            return self.decode_slots(taken, seq_lens)
        finally:
            for slot in taken:
                self.slots.release(slot)

    @torch.inference_mode()
    def decode_slots(self, slots: Sequence[int], seq_lens: Sequence[int]) -> torch.Tensor:
        """One step of the requests in decode `slots` (common.model.decode_slots: their pages
        and next tokens set there), each at seq_lens[i] tokens: [B, vocab] float32 logits (a
        view of a graph's buffer when one ran: read it before the next step)."""
        self.graphs.capture()  # once; a no-op without graphs
        return self.graphs.run(slots, seq_lens)

    def feed_tokens(self, token_ids: torch.Tensor) -> None:
        """The last `decode_slots` step's sampled tokens ([B] long, on the device) become
        its rows' next inputs in their slots, without the host reading them."""
        self.graphs.feed_tokens(token_ids)


def use_device(device: str | torch.device) -> torch.device:
    """`device` as a torch device with its index; a CUDA one becomes this process's current
    device (torch.cuda.set_device), so every launch that names no device (Triton kernels,
    CUDA graphs, events, streams, NIXL's registration) goes to it, not to device 0."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device {device} was given but torch sees no CUDA device")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise RuntimeError(
            f"--device {device}: torch sees {torch.cuda.device_count()} CUDA device(s)"
        )
    torch.cuda.set_device(dev)
    return dev
