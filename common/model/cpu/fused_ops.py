"""The forward pass's small per-layer steps, one C call each: csrc/fused_ops.c.

Per layer the torch path runs about twenty ops besides the four products and attention:
casts, a residual add and an RMSNorm twice, RoPE (a cat, two products, an add), two KV
index copies, silu and a product. At decode's row counts each costs its dispatch and often
a thread wake-up more than its arithmetic; these three calls replace them. Built with the
other CPU kernels (common.model.cpu.library); without them the model runs the torch ops.
"""

from __future__ import annotations

import ctypes

import torch

from common.model.cpu.library import load_library

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _strides(t: torch.Tensor) -> tuple[int, int]:
    """A 2-D tensor's row and column strides in elements (a transposed view is fine)."""
    assert t.dim() == 2
    return t.stride(0), t.stride(1)


def _checked_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A caller's output buffer, as the kernels write it: contiguous, this shape and dtype."""
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"output buffer {tuple(out.shape)} {out.dtype} does not fit "
            f"{tuple(shape)} {dtype} contiguous"
        )
    return out


def _check(rc: int) -> None:
    if rc != 0:
        raise MemoryError(f"fused op failed ({rc})")


class FusedOps:
    """One dtype's fused steps. Every tensor is on the CPU in that dtype (positions and
    slots int64); outputs are new tensors, contiguous unless said otherwise."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        suffix = _SUFFIX[dtype]
        self._add_rms_norm = getattr(lib, f"add_rms_norm_{suffix}")
        self._add_rms_norm.argtypes = [_P, _P, _I64, _I64, _P, _P, _I64, _I64, _F32, _I32]
        self._add_rms_norm.restype = None
        self._rope_store = getattr(lib, f"rope_store_{suffix}")
        self._rope_store.argtypes = [
            _P,
            _I64,
            _I64,
            _P,
            _P,
            _P,
            _P,
            _P,
            _P,
            _I64,
            _I64,
            _I64,
            _I32,
            _I32,
            _I32,
            _I32,
        ]
        self._rope_store.restype = _I32
        self._silu_mul = getattr(lib, f"silu_mul_{suffix}")
        self._silu_mul.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _I32]
        self._silu_mul.restype = _I32

    def add_rms_norm(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x += y (in place; x contiguous [rows, hidden], y any 2-D view or None), then
        weight * rms_norm(x): transformers' LlamaRMSNorm of the residual stream, into
        `out` (contiguous, x's shape) if given."""
        assert x.is_contiguous() and weight.is_contiguous()
        rows, hidden = x.shape
        h = torch.empty_like(x) if out is None else _checked_out(out, x.shape, x.dtype)
        y_rs, y_cs = _strides(y) if y is not None else (0, 0)
        self._add_rms_norm(
            x.data_ptr(),
            _ptr(y),
            y_rs,
            y_cs,
            weight.data_ptr(),
            h.data_ptr(),
            rows,
            hidden,
            eps,
            torch.get_num_threads(),
        )
        return h

    def rope_store(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin_rot: torch.Tensor,
        pool_tokens: torch.Tensor,
        slots: torch.Tensor,
        k_offset: int,
        v_offset: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """qkv [rows, (heads + 2 kv_heads) * head_dim] (any 2-D view): returns q and k rotated,
        [rows, heads + kv_heads, head_dim] (in `out`, contiguous, if given); writes k
        (rotated) to pool_tokens rows slots + k_offset and v to rows slots + k_offset +
        v_offset (KVPool.tokens)."""
        assert positions.is_contiguous() and slots.is_contiguous() and pool_tokens.is_contiguous()
        assert cos.is_contiguous() and sin_rot.is_contiguous()
        rows = qkv.shape[0]
        shape = (rows, heads + kv_heads, head_dim)
        qk = (
            torch.empty(shape, dtype=qkv.dtype)
            if out is None
            else _checked_out(out, shape, qkv.dtype)
        )
        rs, cs = _strides(qkv)
        _check(
            self._rope_store(
                qkv.data_ptr(),
                rs,
                cs,
                positions.data_ptr(),
                cos.data_ptr(),
                sin_rot.data_ptr(),
                qk.data_ptr(),
                pool_tokens.data_ptr(),
                slots.data_ptr(),
                k_offset,
                v_offset,
                rows,
                heads,
                kv_heads,
                head_dim,
                torch.get_num_threads(),
            )
        )
        return qk

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up [rows, 2 * inter] (any 2-D view): silu(gate) * up, [rows, inter]; a
        transposed view when gate_up is one (as the C kernel writes it). `out`
        (contiguous [rows, inter]) is used unless gate_up is transposed."""
        rows, width = gate_up.shape
        rs, cs = _strides(gate_up)
        if rs == 1 and cs != 1:
            out = torch.empty(width // 2, rows, dtype=gate_up.dtype).t()
        elif out is None:
            out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        else:
            out = _checked_out(out, (rows, width // 2), gate_up.dtype)
        _check(
            self._silu_mul(
                gate_up.data_ptr(),
                rs,
                cs,
                out.data_ptr(),
                rows,
                width // 2,
                torch.get_num_threads(),
            )
        )
        return out


def fused_ops(device: torch.device, dtype: torch.dtype) -> FusedOps | None:
    """The fused steps for this model, or None (not the CPU, another dtype, no build)."""
    if device.type != "cpu" or dtype not in _SUFFIX:
        return None
    lib = load_library()
    return FusedOps(lib, dtype) if lib is not None else None
