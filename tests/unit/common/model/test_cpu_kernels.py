"""The C kernels' build (common.model.cpu_kernels): once per source, flags and CPU, into a
directory only this user can write, and a clean fallback when it cannot be built."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from common.model import cpu_kernels as ck
from common.model.fused_ops import fused_ops
from common.model.paged_attention import paged_decode_attention

CPU = torch.device("cpu")


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """An empty cache directory and nothing loaded yet."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(ck, "_loaded", {})
    monkeypatch.setattr(ck.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    return tmp_path


def test_built_once_into_the_cache_directory(fresh_build):
    lib = ck.load_library()
    assert lib is not None
    built = list((fresh_build / "cache" / "kernels").glob("pdserve-kernels-*.so"))
    assert len(built) == 1 and built[0].name == ck.library_name(ck._compiler() or "")
    stamp = built[0].stat().st_mtime_ns
    ck._loaded.clear()  # a new process: found in the cache, not built again
    assert ck.load_library() is not None and built[0].stat().st_mtime_ns == stamp
    assert not list((fresh_build / "cache" / "kernels").glob("*.tmp"))


def test_an_unwritable_cache_falls_back_to_a_temp_directory(fresh_build, monkeypatch):
    blocked = fresh_build / "not-a-directory"
    blocked.write_text("")  # (root writes through permissions; a file in the way stops anyone)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(blocked))
    assert ck.load_library() is not None
    assert list((fresh_build / "tmp").glob("pdserve-kernels-*/pdserve-kernels-*.so"))


def test_the_key_covers_sources_flags_and_compiler(monkeypatch):
    name = ck.library_name("gcc")
    assert ck.library_name("clang") != name
    monkeypatch.setattr(ck, "CFLAGS", ck.CFLAGS + ("-g",))
    assert ck.library_name("gcc") != name
    monkeypatch.undo()
    assert ck.library_name("gcc") == name
    monkeypatch.setattr(ck, "SOURCES", (("paged_attention.c", ()), ("fused_ops.c", ())))
    assert ck.library_name("gcc") != name  # one source's own flags


def test_another_march_replaces_native_and_names_its_own_library(monkeypatch):
    monkeypatch.setattr(ck, "CFLAGS", ck.CFLAGS)  # restored after the test
    name = ck.library_name("gcc")
    ck.use_march("haswell")
    assert "-march=haswell" in ck.CFLAGS and "-march=native" not in ck.CFLAGS
    assert ck.CFLAGS.count("-march=haswell") == 1 and "-O3" in ck.CFLAGS
    assert ck.library_name("gcc") != name


def test_no_compiler_or_a_failed_build_leaves_the_model_on_torch_ops(fresh_build, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger=ck.__name__)
    monkeypatch.setattr(ck, "_compiler", lambda: None)
    assert ck.load_library() is None
    assert paged_decode_attention(CPU, torch.float32, 9, 3, 64) is None
    assert fused_ops(CPU, torch.float32) is None
    assert "no C compiler" in caplog.text
    monkeypatch.setattr(ck, "_compiler", lambda: "false")  # a compiler that fails every build
    assert ck.load_library() is None
    assert "not built" in caplog.text
    assert not list(fresh_build.rglob("*.so")) and not list(fresh_build.rglob("*.o"))


def test_a_directory_other_users_can_write_is_not_trusted(fresh_build, monkeypatch):
    shared = fresh_build / "cache" / "kernels"
    shared.mkdir(parents=True)
    os.chmod(shared, 0o777)
    assert ck.load_library() is not None  # built in the private temp directory instead
    assert not list(shared.glob("*.so"))
    assert list((fresh_build / "tmp").glob("pdserve-kernels-*/pdserve-kernels-*.so"))


def test_processes_starting_together_build_once(fresh_build):
    """Four processes load at once into an empty cache: one compiles, the others wait on the
    directory's lock and load its library. The compiler, a wrapper, logs each run."""
    import shutil
    import subprocess
    import sys

    log = fresh_build / "cc.log"
    wrapper = fresh_build / "cc"
    wrapper.write_text(f"#!/bin/sh\necho run >> {log}\nexec {shutil.which('gcc') or 'cc'} \"$@\"\n")
    wrapper.chmod(0o755)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import common.model.cpu_kernels as ck; "
            "import tempfile; tempfile.gettempdir = lambda: sys.argv[2]; "
            "print(ck.load_library() is not None)")
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(fresh_build / "cache"), "CC": str(wrapper)}
    root = str(ck.CSRC.parents[2])
    procs = [subprocess.Popen([sys.executable, "-c", code, root, str(fresh_build / "tmp")],
                              env=env, stdout=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert outs == ["True"] * 4
    # one build: each source compiled once, one link
    assert log.read_text().split() == ["run"] * (len(ck.SOURCES) + 1)
    built = list((fresh_build / "cache" / "kernels").iterdir())
    assert [p.name for p in built if p.suffix == ".so"] == [ck.library_name(str(wrapper))]
    assert not [p for p in built if p.is_dir()]  # no build directory left behind


def test_the_key_covers_the_shared_header(monkeypatch, tmp_path):
    """A change to cpu_math.h (included by both sources) makes a new library."""
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(ck.CSRC, copy)
    monkeypatch.setattr(ck, "CSRC", copy)
    name = ck.library_name("gcc")
    (copy / "cpu_math.h").write_text((copy / "cpu_math.h").read_text() + "\n/* changed */\n")
    assert ck.library_name("gcc") != name
