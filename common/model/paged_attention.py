"""Decode attention read from the KV pool's pages in place: csrc/paged_attention.c.

torch on the CPU has no paged attention, so decode used to gather every sequence's pages
into one tensor per layer (index_select) and run SDPA's flash kernel on the copy; at batch
32 the two took 28% of a bfloat16 step. The C kernel scores each key where its page lies.

It is compiled on first use with the machine's C compiler (-O3 -march=native -fopenmp, so
for the CPU that runs it) into a cache directory, keyed by the source, the flags and the
CPU, and loaded with ctypes; its OpenMP calls resolve to the runtime torch has loaded. No
compiler, or a failed build, leaves decode on the gather + SDPA path (logged once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
MAX_GROUPS, MAX_HEADS, MAX_HEAD_DIM = 16, 128, 256  # as in the C source
_SYMBOLS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor() or platform.machine()


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cache_dirs() -> list[Path]:
    """The pdserve cache (PDSERVE_CACHE_DIR, as the converted model) first; a private temp
    directory when that is read-only (the chart's image)."""
    base = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve"))
    return [base / "kernels", Path(tempfile.gettempdir()) / f"pdserve-kernels-{os.getuid()}"]


def library_name(compiler: str) -> str:
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(CFLAGS).encode(), compiler.encode(),
                 _cpu_signature().encode()):
        key.update(part)
        key.update(b"\0")
    return f"paged_attention-{key.hexdigest()[:16]}.so"


def _check_private(directory: Path) -> None:
    """A library is loaded only from a directory no other user could have written it into:
    owned by this user or root, not writable by group or others (the temp one is shared)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.stat()
    if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022:
        raise OSError(f"{directory} is writable by other users or owned by uid {st.st_uid}")


def _build(compiler: str, target: Path) -> None:
    """Compile to a temporary name, then rename: processes building at once each get a whole file."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run([compiler, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library() -> ctypes.CDLL | None:
    """The built kernel library, building it if no cache directory has it; None if it cannot be."""
    compiler = _compiler()
    if compiler is None:
        with _lock:
            if "none" not in _loaded:
                logger.warning("no C compiler (gcc/cc, or $CC): decode attention gathers pages")
                _loaded["none"] = None
        return None
    name = library_name(compiler)
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib, errors = None, []
        for directory in _cache_dirs():
            path = directory / name
            try:
                _check_private(directory)
                if not path.exists():
                    _build(compiler, path)
                lib = ctypes.CDLL(str(path))
                break
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", None) or e
                errors.append(f"{directory}: {detail}")
        if lib is None:
            logger.warning("paged attention kernel not built, decode attention gathers pages: %s",
                           "; ".join(str(e) for e in errors))
        _loaded[name] = lib
        return lib


def splits_for(batch: int, max_pages: int, threads: int) -> int:
    """Into how many page ranges each sequence's keys are cut: enough work items for every
    thread to get about four (few sequences, long contexts), never more ranges than pages."""
    want = -(-4 * threads // batch)
    return max(1, min(want, max_pages))


class PagedDecodeAttention:
    """One dtype's kernel: attention of one query token per sequence over its pages."""

    def __init__(self, lib: ctypes.CDLL, dtype: torch.dtype) -> None:
        self.dtype = dtype
        fn = getattr(lib, _SYMBOLS[dtype])
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        fn.argtypes = [p, i64, p, i64, p, i64, i64, p, i64, p, i32, i32, i32, i32,
                       ctypes.c_float, i32, i32]
        fn.restype = i32
        self._fn = fn

    @staticmethod
    def supports(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                 head_dim: int) -> bool:
        return (device.type == "cpu" and dtype in _SYMBOLS and heads % kv_heads == 0
                and heads // kv_heads <= MAX_GROUPS and heads <= MAX_HEADS
                and head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0)

    def __call__(self, pool_rows: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor,
                 layer: int, q: torch.Tensor, page_size: int, scale: float) -> torch.Tensor:
        """pool_rows: KVPool.rows; rows [B, width] int64, each page's layer-0 K row; lens [B]
        int64 tokens per sequence (at least 1); q [B, heads, head_dim], rows of any stride.
        Returns [B, heads * head_dim] in q's dtype."""
        bsz, heads, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        kv_heads = pool_rows.shape[1] // (page_size * d)
        threads = torch.get_num_threads()
        splits = splits_for(bsz, rows.shape[1], threads)
        out = torch.empty(bsz, heads * d, dtype=q.dtype)
        rc = self._fn(pool_rows.data_ptr(), pool_rows.shape[1], rows.data_ptr(), rows.shape[1],
                      lens.data_ptr(), bsz, layer, q.data_ptr(), q.stride(0), out.data_ptr(),
                      heads, kv_heads, d, page_size, scale, splits, threads)
        if rc != 0:
            raise RuntimeError(f"paged decode attention failed ({rc})")
        return out


def paged_decode_attention(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int,
                           head_dim: int) -> PagedDecodeAttention | None:
    """The kernel for this model, or None (not the CPU, an unsupported shape, no build)."""
    if not PagedDecodeAttention.supports(device, dtype, heads, kv_heads, head_dim):
        return None
    lib = load_library()
    return PagedDecodeAttention(lib, dtype) if lib is not None else None
