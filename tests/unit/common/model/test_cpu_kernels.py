"""The C kernels' libraries (common.model.cpu.build, .library): one per instruction set,
built at install time, the best this CPU runs loaded, and a clear fallback without them."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from common import metrics
from common.model.cpu import build, library
from common.model.cpu.fused_ops import fused_ops
from common.model.cpu.paged_attention import paged_decode_attention

CPU = torch.device("cpu")
AVX2_ONLY = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "xsave"})


@pytest.fixture
def fresh(monkeypatch):
    """Nothing loaded yet, no variant forced."""
    monkeypatch.setattr(library, "_loaded", {})
    monkeypatch.setattr(library, "_forced", None)


def _info(variant: str) -> float | None:
    return metrics.REGISTRY.get_sample_value(
        "pdserve_cpu_kernels_info", {"role": metrics.ROLE, "variant": variant}
    )


def test_variants_by_cpu_flags_best_first():
    everything = frozenset().union(*(v.needs for v in build.VARIANTS))
    assert [v.name for v in library.supported(everything)] == ["amx", "avx512", "avx2", "portable"]
    assert [v.name for v in library.supported(AVX2_ONLY)] == ["avx2", "portable"]
    assert [v.name for v in library.supported(frozenset())] == ["portable"]  # aarch64 too


def test_the_portable_variant_has_no_target_flag_and_builds_on_any_arch():
    portable = build.BY_NAME["portable"]
    flags = [f for name, own in build.SOURCES for f in portable.source_flags(name, own)]
    assert not [f for f in flags if f.startswith(("-march", "-mprefer", "-mavx", "-mamx"))]
    assert build.buildable("aarch64") == (portable,)
    assert [v.name for v in build.buildable("x86_64")] == ["amx", "avx512", "avx2", "portable"]


def test_a_built_portable_library_loads_and_runs(fresh, tmp_path, monkeypatch):
    build.build_all(tmp_path, variants=(build.BY_NAME["portable"],))
    assert [p.name for p in tmp_path.iterdir()] == ["libpdserve_cpu_portable.so"]  # no leftovers
    monkeypatch.setattr(library, "LIB_DIR", tmp_path)
    variant, lib = library.load()  # the better variants are not there: the next one loads
    assert variant == "portable" and lib is not None
    assert lib.f32_gemm_ready() == 0 and lib.amx_gemm_ready() == 0  # x86 products: stubs
    ops = fused_ops(CPU, torch.float32)
    assert ops is not None
    x, w = torch.randn(3, 64), torch.randn(64)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ops.add_rms_norm(x.clone(), None, w, 1e-6), ref)


def test_a_forced_variant_loads_that_library_only(fresh):
    library.use_variant("portable")
    assert library.loaded_variant() == "portable"
    with pytest.raises(ValueError):
        library.use_variant("avx9000")


def test_without_libraries_the_model_runs_torch_ops_logged_and_counted(
    fresh, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING, logger=library.__name__)
    monkeypatch.setattr(library, "LIB_DIR", tmp_path / "not-built")
    assert library.load_library() is None
    assert library.load_library() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "torch's ops only" in warnings[0].getMessage()
    assert "portable" in warnings[0].getMessage() and "not built" in warnings[0].getMessage()
    assert paged_decode_attention(CPU, torch.float32, 9, 3, 64) is None
    assert fused_ops(CPU, torch.float32) is None
    assert library.report_variant() == "none" and _info("none") == 1


def test_a_library_that_does_not_load_falls_to_the_next(fresh, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger=library.__name__)
    best = library.supported()[0]
    shutil.copy(library.LIB_DIR / "libpdserve_cpu_portable.so", tmp_path)
    (tmp_path / best.filename).write_bytes(b"not an ELF file")
    monkeypatch.setattr(library, "LIB_DIR", tmp_path)
    assert library.loaded_variant() == "portable"
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_the_runner_reports_its_variant(fresh):
    assert library.report_variant() == library.supported()[0].name
    assert _info(library.supported()[0].name) == 1
    assert library.report_variant(is_enabled=False) == "none" and _info("none") == 1
