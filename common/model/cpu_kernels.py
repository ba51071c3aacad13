"""The C kernels of common/model/csrc, compiled on first use for the CPU that runs them.

torch on the CPU lacks five things the model needs: attention that reads the KV pages in
place (csrc/paged_attention.c for decode, csrc/prefill_attention.c for prefill's spans in
float32), the per-layer small steps fused into one call each (csrc/fused_ops.c),
bfloat16 products at few rows that keep up with memory on AMX (csrc/amx_gemm.c), and
float32 products on AVX-512 or AVX2 that fetch their next weights while they multiply
(csrc/f32_gemm.c). All are
plain C (no Python or torch headers) built into one library
with the machine's C compiler (-O3 -march=native -fopenmp, about 2 s) into a cache
directory, keyed by the sources, the flags, the compiler and the CPU, and loaded with
ctypes; their OpenMP calls resolve to the runtime torch has loaded. No compiler, or a
failed build, leaves the model on its torch path (logged once).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
CFLAGS: tuple[str, ...] = ("-O3", "-march=native", "-fopenmp", "-fPIC")
# Per source, flags of its own: the fused ops round where torch rounds, so no multiply and
# add may become one fused multiply-add there; and GCC vectorizes their loops 256 bits wide
# on AVX-512 CPUs unless told otherwise (512 bits: bit-equal, 1.2-1.3x in bfloat16 and
# 1.0-1.1x in float32 at 32-1024 rows on an AMX Xeon; a no-op without AVX-512).
SOURCES = (("paged_attention.c", ()), ("prefill_attention.c", ()),
           ("fused_ops.c", ("-ffp-contract=off", "-mprefer-vector-width=512")),
           ("amx_gemm.c", ()), ("f32_gemm.c", ()))

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def use_march(march: str) -> None:
    """Build for another CPU target than this one from now on (`haswell`: AVX2 and FMA
    without AVX-512), into a library of its own name (the flags are in its key): the AVX2
    code's tests and the bench's AVX2 emulation on an AVX-512 machine. Libraries already
    loaded stay as they are."""
    global CFLAGS
    CFLAGS = tuple(f"-march={march}" if f.startswith("-march=") else f for f in CFLAGS)


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
    parts = [" ".join(CFLAGS).encode(), compiler.encode(), _cpu_signature().encode()]
    for name, flags in SOURCES:
        parts += [name.encode(), " ".join(flags).encode(), (CSRC / name).read_bytes()]
    for header in sorted(CSRC.glob("*.h")):  # what the sources include
        parts += [header.name.encode(), header.read_bytes()]
    for part in parts:
        key.update(part)
        key.update(b"\0")
    return f"pdserve-kernels-{key.hexdigest()[:16]}.so"


def _check_private(directory: Path) -> None:
    """A library is loaded only from a directory no other user could have written it into:
    owned by this user or root, not writable by group or others (the temp one is shared)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = directory.stat()
    if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o022:
        raise OSError(f"{directory} is writable by other users or owned by uid {st.st_uid}")


def _run(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)


def _build(compiler: str, target: Path) -> None:
    """Each source to an object with its flags (compiled side by side, one per core),
    linked to a temporary name, then renamed: processes building at once each get a whole
    file."""
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = [str(Path(work) / (name + ".o")) for name, _ in SOURCES]
        commands = [[compiler, *CFLAGS, *flags, "-c", "-o", obj, str(CSRC / name)]
                    for (name, flags), obj in zip(SOURCES, objects)]
        with ThreadPoolExecutor(max_workers=min(len(commands), os.cpu_count() or 1)) as pool:
            list(pool.map(_run, commands))  # the first failure raises here
        linked = str(Path(work) / target.name)
        _run([compiler, "-shared", "-fopenmp", "-o", linked, *objects, "-lm"])
        os.replace(linked, target)


def _build_once(compiler: str, target: Path) -> None:
    """Build unless another process did while this one waited: nodes started together
    (a pod's containers, a test cluster) take a lock on the directory and build once."""
    with open(target.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            _build(compiler, target)


def load_library() -> ctypes.CDLL | None:
    """The built kernel library, building it if no cache directory has it; None if it cannot be."""
    compiler = _compiler()
    if compiler is None:
        with _lock:
            if "none" not in _loaded:
                logger.warning("no C compiler (gcc/cc, or $CC): the model runs on torch's ops "
                               "only (decode gathers KV pages)")
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
                    _build_once(compiler, path)
                lib = ctypes.CDLL(str(path))
                break
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", None) or e
                errors.append(f"{directory}: {detail}")
        if lib is None:
            logger.warning("CPU kernels not built, the model runs on torch's ops only: %s",
                           "; ".join(str(e) for e in errors))
        _loaded[name] = lib
        return lib
