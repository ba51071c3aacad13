"""Llama-family transformer whose attention reads and writes the paged KV pool.

The family: Llama, Mistral, Qwen2.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from common.kv_pool import KVPool
from common.model.attention import AttentionBatch, make_attention_backend
from common.model.cpu.amx_gemm import amx_gemm
from common.model.cpu.f32_gemm import f32_gemm
from common.model.cpu.fused_ops import FusedOps, fused_ops
from common.model.cpu.gemm import (
    AMX,
    HEAD_MEASURED_ROWS,
    PACKED,
    PANELS,
    PREFILL_LAYERS,
    ROW_MAJOR,
    WEIGHT_MAJOR,
    KernelChooser,
    LinearWeight,
    linear,
    measure,
    packs,
    time_products,
)
from common.model.spec import ModelSpec, rope_inv_freq
from common.model.workspace import WORKSPACE_ROWS, Workspace

if TYPE_CHECKING:
    from common.model.triton_fused import TritonFusedOps


@dataclass
class LayerWeights:
    qkv: LinearWeight  # [(heads + 2 * kv_heads) * head_dim, hidden]: q, k, v fused (+ bias)
    o: LinearWeight
    gate_up: LinearWeight  # [2 * intermediate, hidden]: gate, up fused
    down: LinearWeight
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in float32, scaled in the model's dtype: transformers' LlamaRMSNorm.

    F.rms_norm computes x * rsqrt(mean(x^2) + eps) as one op, bit-equal to the four it
    replaces; given bfloat16 it computes in float32 and rounds once, bit-equal to casting
    around it as transformers does (tests/unit/common/model/test_rms_norm.py), two copies fewer
    per norm.
    """
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_rot: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos [T, head_dim]; sin_rot: sin with its first half negated.

    The rotate-half convention, x * cos + cat(-x2, x1) * sin, with the sign folded into
    sin_rot: cat(x2, x1) * sin_rot is bit-equal (negation is exact) and one op shorter.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + swapped * sin_rot[:, None, :]


class LlamaModel:
    """Weights plus the forward pass; KV lives in the KVPool passed to `forward`."""

    def __init__(
        self,
        spec: ModelSpec,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        *,
        pack: bool = False,
        cpu_kernels: bool = False,
        attention_backend: str = "auto",
    ) -> None:
        """`pack`: keep a oneDNN-packed copy of each matrix (twice the weight memory) for the
        kernel choice of common.model.cpu.gemm (three times in float32 with AVX-512 or AVX2 and
        `cpu_kernels`: the panel copy too; warm-up's choice drops the copies no row count
        chose); on CUDA every product is F.linear.
        `cpu_kernels`: the C kernels of common.model.cpu.library where they load (the CPU):
        attention over the pages in place (decode; prefill in float32, and in bfloat16 on a
        CPU without AMX, common.model.cpu.paged_attention), the fused per-layer steps and, in
        bfloat16 on a CPU with AMX, the AMX product in place of oneDNN's packed one
        (common.model.cpu.amx_gemm; the weights' second copy is in its layout), and in
        float32 on AVX-512 or AVX2 the panel product beside oneDNN's
        (common.model.cpu.f32_gemm); otherwise torch's ops.
        `attention_backend`: common.model.attention's choice (auto: Triton on CUDA, with the
        per-layer steps as Triton kernels too; the C kernels on the CPU)."""
        self.spec = spec
        self.dtype = dtype
        self.device = device
        # CPU products are timed (they run synchronously) to choose their kernel per row count;
        # the layers' four products and the LM head each get their own choice.
        amx = panels = None
        if pack and cpu_kernels and device.type == "cpu" and dtype == torch.bfloat16:
            amx = amx_gemm()
        if pack and cpu_kernels and device.type == "cpu" and dtype == torch.float32:
            panels = f32_gemm()
        pack = pack and packs(device, dtype) and amx is None
        kernels = [ROW_MAJOR, WEIGHT_MAJOR]
        if amx is not None:
            kernels.append(AMX)
        elif pack:
            kernels.append(PACKED)
        if panels is not None:
            kernels.append(PANELS)
        self.chooser = KernelChooser(tuple(kernels)) if device.type == "cpu" else None
        self.head_chooser = KernelChooser(tuple(kernels)) if device.type == "cpu" else None
        self._gemm_s = 0.0
        self._ws: Workspace | None = None  # during a CPU prefill pass (common.model.workspace)

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"checkpoint is missing {name}")
            t = weights[name].to(device=device, dtype=dtype).contiguous()
            # a view into a loaded file can start anywhere: a kernel's compile assumes its
            # pointers 16-byte aligned (common.model.triton_launch), so a copy that is
            if t.device.type != "meta" and t.data_ptr() % 16:
                t = t.clone()
            return t

        def lw(weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearWeight:
            return LinearWeight.of(weight, bias, pack=pack, amx=amx, panels=panels)

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        has_head = "lm_head.weight" in weights and not spec.tie_word_embeddings
        self.lm_head = lw(w("lm_head.weight") if has_head else self.embed)
        self.layers: list[LayerWeights] = []
        for i in range(spec.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if spec.attention_bias:
                bias = torch.cat([w(a + f"{n}_proj.bias") for n in ("q", "k", "v")])
            self.layers.append(
                LayerWeights(
                    qkv=lw(torch.cat([w(a + f"{n}_proj.weight") for n in ("q", "k", "v")]), bias),
                    o=lw(w(a + "o_proj.weight")),
                    gate_up=lw(
                        torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])
                    ),
                    down=lw(w(p + "mlp.down_proj.weight")),
                    attn_norm=w(p + "input_layernorm.weight"),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                )
            )
        inv_freq = rope_inv_freq(spec)
        pos = torch.arange(spec.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        sin = emb.sin().to(device=device, dtype=dtype)
        half = sin.shape[-1] // 2
        self.sin_rot = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.attention = make_attention_backend(
            attention_backend, spec, dtype, device, cpu_kernels=cpu_kernels
        )
        self.fused: FusedOps | TritonFusedOps | None = None
        if self.attention.name == "triton":
            # RoPE with the KV store, the residual add with RMSNorm, silu with its product:
            # one Triton kernel each (three launches a layer instead of about twenty)
            from common.model.triton_fused import triton_fused_ops

            self.fused = triton_fused_ops(device, dtype, always=device.type != "cuda")
        elif cpu_kernels:
            self.fused = fused_ops(device, dtype)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        pool: KVPool,
        batch: AttentionBatch,
        out_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """Run the layers over all new tokens; return final hidden states of `out_rows` (or all).

        The caller (ModelRunner._check_span) keeps positions within the context length and
        the slots within the pool: the CPU kernels index the RoPE table and the pool unchecked.
        """
        self.attention.prepare(pool, batch)
        x = F.embedding(token_ids, self.embed)
        trig = None if self.fused is not None else (self.cos[positions], self.sin_rot[positions])
        num_tokens = token_ids.shape[0]
        kernel = self.chooser.pick(num_tokens) if self.chooser is not None else ROW_MAJOR
        self._gemm_s = 0.0
        if self.device.type == "cpu" and num_tokens >= WORKSPACE_ROWS:
            self._ws = Workspace(self.device, self.dtype)
        try:
            h = self._layers(x, positions, trig, pool, batch, kernel)
        finally:
            self._ws = None
        if self.chooser is not None:
            self.chooser.record(num_tokens, kernel, self._gemm_s)
        return h if out_rows is None else h[out_rows]

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        trig: tuple[torch.Tensor, torch.Tensor] | None,
        pool: KVPool,
        batch: AttentionBatch,
        kernel: str,
    ) -> torch.Tensor:
        """The layers over the embedded tokens x (the residual stream, updated in place
        where the fused steps run); returns the final norm's output."""
        x, h = self._add_norm(x, None, self.layers[0].attn_norm)
        for idx, layer in enumerate(self.layers):
            qkv = self._linear(h, layer.qkv, kernel, "qkv")
            q, k, v = self._rope_store(qkv, positions, trig, pool, batch, idx)
            attn = self._attention(q, k, v, pool, batch, idx)
            x, h = self._add_norm(x, self._linear(attn, layer.o, kernel, "o"), layer.mlp_norm)
            act = self._silu_mul(self._linear(h, layer.gate_up, kernel, "gate_up"))
            # the residual's last add and the next norm together (the final norm after the last)
            norm = self.layers[idx + 1].attn_norm if idx + 1 < len(self.layers) else self.norm
            x, h = self._add_norm(x, self._linear(act, layer.down, kernel, "down"), norm)
        return h

    def _out(self, role: str, *shape: int) -> torch.Tensor | None:
        """This pass's buffer for `role` (each step's output has its own role), or None
        outside a CPU prefill pass: the step then allocates its output."""
        return self._ws.take(role, *shape) if self._ws is not None else None

    def _add_norm(
        self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x + y (x itself when y is None) and its RMSNorm by `weight`."""
        eps = self.spec.rms_norm_eps
        if self.fused is not None:
            # x updated in place; h in this pass's buffer (read by the next product)
            return x, self.fused.add_rms_norm(x, y, weight, eps, out=self._out("h", *x.shape))
        if y is not None:
            x = x + y
        return x, rms_norm(x, weight, eps)

    def _rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        trig: tuple[torch.Tensor, torch.Tensor] | None,
        pool: KVPool,
        batch: AttentionBatch,
        layer: int,
    ) -> tuple[torch.Tensor, ...]:
        """q and k rotated, k and v written to this layer's pool slots; returns q, k
        [tokens, heads or kv_heads, head_dim] and v [tokens, kv_size] (a view of qkv)."""
        spec = self.spec
        n, heads = qkv.shape[0], spec.num_heads + spec.num_kv_heads
        qk_size = self.q_size + self.kv_size
        k_offset, v_offset = 2 * layer * pool.page_size, pool.page_size
        if self.fused is not None:
            qk = self.fused.rope_store(
                qkv,
                positions,
                self.cos,
                self.sin_rot,
                pool.tokens,
                batch.write_slots,
                k_offset,
                v_offset,
                spec.num_heads,
                spec.num_kv_heads,
                spec.head_dim,
                out=self._out("qk", n, heads, spec.head_dim),
            )
            v = qkv[:, qk_size:]
        else:
            assert trig is not None
            # Row-major from here (decode's weight-major product is a transposed view): SDPA
            # takes its flash kernel only when the head dim is contiguous.
            qkv = qkv.contiguous()
            # q and k rotated together: one set of rope ops per layer instead of two
            qk = apply_rope(qkv[:, :qk_size].reshape(n, heads, spec.head_dim), *trig)
            v = qkv[:, qk_size:]
            k_slots = batch.write_slots + k_offset
            pool.tokens.index_copy_(0, k_slots, qk[:, spec.num_heads :].reshape(n, self.kv_size))
            pool.tokens.index_copy_(0, k_slots + v_offset, v)
        return qk[:, : spec.num_heads], qk[:, spec.num_heads :], v

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            rows, width = gate_up.shape
            return self.fused.silu_mul(gate_up, out=self._out("act", rows, width // 2))
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_chooser is None:
            return linear(hidden, self.lm_head).float()
        rows = hidden.shape[0]
        kernel = self.head_chooser.pick(rows)
        self._gemm_s = 0.0
        out = self._linear(hidden, self.lm_head, kernel)
        self.head_chooser.record(rows, kernel, self._gemm_s)
        return out.float()

    def _linear(
        self, x: torch.Tensor, w: LinearWeight, kernel: str, role: str | None = None
    ) -> torch.Tensor:
        """A product, its seconds added to this pass's total (CPU ops run synchronously);
        row_major's output in this pass's buffer for `role`, if it has one."""
        buf = None
        if role is not None and kernel in (ROW_MAJOR, PANELS):
            buf = self._out(role, x.shape[0], w.weight.shape[0])
        t = time.perf_counter()
        out = linear(x, w, kernel, buf)
        self._gemm_s += time.perf_counter() - t
        return out

    def choose_kernels(self, *, keep_all_copies: bool = False) -> None:
        """Warm-up's product kernel choice (common.model.cpu.gemm.measure): every row bucket
        measured or ruled, then fixed for this model's life, and the weights' copies no
        bucket chose dropped (kept with `keep_all_copies`, for benches). The CPU only."""
        if self.chooser is None or self.head_chooser is None:
            return
        products = self.layer_products()
        per_layer = len(products) // len(self.layers)
        measure(
            self.chooser,
            products,
            self.dtype,
            prefill_products=products[: per_layer * PREFILL_LAYERS],
            keep_all_copies=keep_all_copies,
        )
        chooser = self.chooser

        def layers_pass(rows: int) -> None:
            time_products(products, rows, chooser.pick(rows), self.dtype)

        # The head after the layers' products, each time: timed alone, its weight stays in
        # cache and its order of kernels is not a forward's.
        measure(
            self.head_chooser,
            [(self.lm_head, self.spec.hidden_size)],
            self.dtype,
            max_prefill_rows=HEAD_MEASURED_ROWS,
            keep_all_copies=keep_all_copies,
            before=layers_pass,
        )

    def adopt_kernels(self, layers: dict[int, str], head: dict[int, str]) -> bool:
        """An earlier warm-up's choice instead of measuring (common.model.cpu.choice_cache):
        both choosers frozen on it and the weights' unchosen copies dropped, as after
        `choose_kernels`. False, and nothing changed, if it does not fit this model's
        kernels."""
        if self.chooser is None or self.head_chooser is None:
            return False
        if self.chooser.is_frozen or self.head_chooser.is_frozen:
            return False
        kernels = self.chooser.kernels
        if not all(KernelChooser(kernels).adopt(choice) for choice in (layers, head)):
            return False
        self.chooser.adopt(layers)
        self.head_chooser.adopt(head)
        for weight, _ in self.layer_products():
            weight.keep_only(self.chooser.chosen_kernels())
        self.lm_head.keep_only(self.head_chooser.chosen_kernels())
        return True

    def layer_products(self) -> list[tuple[LinearWeight, int]]:
        """One pass's products in the layers, each with its input width."""
        hidden, inter = self.spec.hidden_size, self.layers[0].down.weight.shape[1]
        return [
            p
            for layer in self.layers
            for p in (
                (layer.qkv, hidden),
                (layer.o, self.q_size),
                (layer.gate_up, hidden),
                (layer.down, inter),
            )
        ]

    def weight_tensors(self) -> list[torch.Tensor]:
        """The matrices and vectors one forward reads (the LM head's once, tied or not)."""
        out = [self.lm_head.weight, self.norm]
        for layer in self.layers:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                out += lin.tensors()
            out += [layer.attn_norm, layer.mlp_norm]
        return out

    def _attention(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        pool: KVPool,
        batch: AttentionBatch,
        layer: int,
    ) -> torch.Tensor:
        """Attention of this layer over the new tokens' k_new [tokens, kv_heads, head_dim] and
        v_new [tokens, kv_size], just written to the pool, and the cached KV."""
        if batch.is_decode:
            return self.attention.decode(q, pool, batch, layer)
        out = self._out("attn", q.shape[0], self.q_size) if self.attention.fills_out else None
        return self.attention.extend(q, k_new, v_new, pool, batch, layer, out)
