"""bench/nixl_trim.py and device_prepare.sh's size check: what the GPU machine's one call carries.

The trim runs on the venv's installed nixl-cu12 (the same layout as nixl-cu13's wheel); the
trimmed copy, installed as bench/device_check.sh installs it, moves real bytes over DRAM.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import nixl_trim

ROOT = Path(__file__).resolve().parents[3]
MIB = 1024 * 1024
# Measured 11.4 MiB for nixl-cu12 1.5.1 (cp311) and nixl-cu13 1.5.1 (cp312); 234 MiB installed.
TRIMMED_BUDGET = 14 * MIB
# Linked by nothing the UCX path loads: other NIXL plugins and what only they need.
UNRELATED = (
    "libaws-cpp-sdk-s3-",
    "libazure-storage-blobs-",
    "libibverbs-",
    "libmlx5-",
    "libplugin_GDS.so",
    "libplugin_OBJ.so",
    "libplugin_LIBFABRIC.so",
    "libplugin_GPUNETIO.so",
    "libucx_perftest_cuda.so",
    "libuct_ib.so",
    "nixl_ep_cpp_",
)
# What it must keep: the linked closure of libnixl (gRPC and etcd among it), the UCX plugin,
# UCX itself and its shared-memory and CUDA modules.
NEEDED = (
    "libnixl.so",
    "libgrpc-",
    "libetcd-cpp-api-core-",
    "libplugin_UCX.so",
    "libucp-",
    "libuct_cma.so",
    "libuct_cuda.so",
    "libucm_cuda.so",
)

# Two NixlBackends in one process, pages written across, bytes compared; then every NIXL
# and UCX library mapped into the process, to prove none came from outside the trimmed copy.
CHILD = """
import json, os, sys, time
import torch
from common.kv_pool import KVLayout, KVPool
from transfer.nixl_backend import NixlBackend
import nixl_cu12

layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
writer, target = NixlBackend("writer"), NixlBackend("target")
src, dst = KVPool(layout, 8, "cpu"), KVPool(layout, 8, "cpu")
writer.register_pool(src)
target.register_pool(dst)
src_bytes = src.buffer.view(8, -1).view(torch.uint8)
src_bytes.copy_(torch.randint(0, 256, src_bytes.shape, dtype=torch.uint8))
peer = writer.add_peer(target.local_metadata())
xfer = writer.write(peer, [(i, 7 - i) for i in range(8)], b"done")
notes, deadline = [], time.monotonic() + 20
while not notes and time.monotonic() < deadline:
    writer.poll(xfer)
    notes += target.get_notifications()
dst_bytes = dst.buffer.view(8, -1).view(torch.uint8)
maps = sorted({
    line.split()[-1] for line in open("/proc/self/maps")
    if ".so" in line and ("nixl" in line or "/ucx/" in line or "libuc" in line)
})
print(json.dumps({
    "equal": all(torch.equal(dst_bytes[7 - i], src_bytes[i]) for i in range(8)),
    "state": writer.poll(xfer).name,
    "notes": [msg.decode() for _, msg in notes],
    "nixl": nixl_cu12.__file__,
    "ucx_module_dir": os.environ.get("UCX_MODULE_DIR"),
    "maps": maps,
}))
"""


def _installed_site() -> Path | None:
    """The site-packages folder holding nixl_cu12 and the nixl meta-package, found unloaded."""
    spec = importlib.util.find_spec("nixl_cu12")
    if spec is None or spec.origin is None or importlib.util.find_spec("nixl") is None:
        return None
    return Path(spec.origin).parent.parent


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, nixl_trim.TrimResult]:
    site = _installed_site()
    if site is None:
        pytest.skip("nixl-cu12 is not installed")
    out = tmp_path_factory.mktemp("trimmed")
    return {r.wheel.name.split("-")[0]: r for r in nixl_trim.trim([site], out)}


def _names(members: tuple[nixl_trim.Member, ...]) -> list[str]:
    return [m.path.rsplit("/", 1)[-1] for m in members]


def test_trimmed_nixl_is_small_and_keeps_only_the_ucx_path(
    trimmed: dict[str, nixl_trim.TrimResult],
) -> None:
    assert set(trimmed) == {"nixl", "nixl_cu12"}
    backend = trimmed["nixl_cu12"]
    assert backend.trimmed_size < TRIMMED_BUDGET < backend.source_size
    dropped, kept = _names(backend.dropped), _names(backend.kept)
    for prefix in UNRELATED:
        assert any(n.startswith(prefix) for n in dropped), prefix
        assert not any(n.startswith(prefix) for n in kept), prefix
    for prefix in NEEDED:
        assert any(n.startswith(prefix) for n in kept), prefix
    assert {"__init__.py", "_api.py", "nixl_meta_utils.py"} <= set(_names(trimmed["nixl"].kept))


@pytest.mark.slow
def test_trimmed_wheel_records_every_member_and_trims_to_itself(
    trimmed: dict[str, nixl_trim.TrimResult], tmp_path: Path
) -> None:
    wheel = trimmed["nixl_cu12"].wheel
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        record_name = next(n for n in names if n.endswith(".dist-info/RECORD"))
        rows = list(csv.reader(io.StringIO(archive.read(record_name).decode())))
        for path, digest, size in rows:
            if path == record_name:
                assert digest == size == ""
                continue
            data = archive.read(path)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + expected.decode() and int(size) == len(data), path
    assert {r[0] for r in rows} == names
    # Read back as a wheel, the trimmed copy keeps all it has.
    again = nixl_trim.trim([wheel], tmp_path)[0]
    assert {m.path for m in again.kept} == {m.path for m in trimmed["nixl_cu12"].kept}
    assert again.dropped == ()


def test_elf_reader_finds_what_the_bindings_link() -> None:
    site = _installed_site()
    if site is None:
        pytest.skip("nixl-cu12 is not installed")
    bindings = next((site / "nixl_cu12").glob("_bindings*.so"))
    dynamic = nixl_trim.read_dynamic(bindings.read_bytes())
    assert dynamic is not None and "libnixl.so" in dynamic.needed
    assert "$ORIGIN/../.nixl_cu12.mesonpy.libs" in dynamic.search_path
    assert nixl_trim.read_dynamic(b"#!/bin/sh\n" * 10) is None


@pytest.mark.slow
def test_trimmed_copy_moves_bytes_over_dram(
    trimmed: dict[str, nixl_trim.TrimResult], tmp_path: Path
) -> None:
    site = tmp_path / "site"
    wheels = [str(r.wheel) for r in trimmed.values()]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        + ["--target", str(site), *wheels],
        check=True,
        timeout=120,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env.update(UCX_TLS="tcp,self,sm", PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
    done = subprocess.run(
        [sys.executable, "-s", "-c", CHILD],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["equal"] and got["state"] == "DONE" and got["notes"] == ["done"], got
    assert got["nixl"].startswith(str(site))
    assert got["ucx_module_dir"] == str(site / "nixl_cu12.libs" / "ucx")
    assert got["maps"] and all(m.startswith(str(site)) for m in got["maps"]), got["maps"]
    assert str(site / "nixl_cu12.libs" / "ucx" / "libuct_cma.so.0.0.0") in got["maps"]


def _fake_tree(root: Path, nixl_mib: float, serving_mib: float) -> None:
    """A git work tree with a small repo part and sparse wheels of the given sizes."""
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text(".device/\nbuild/\n")
    (root / "tracked.py").write_text("x = 1\n" * 1000)
    (root / "build").mkdir()
    for path, mib in (
        (".device/nixl/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl", nixl_mib),
        (".device/serving/pyzmq-27.3.0-cp312-abi3-manylinux_2_28_x86_64.whl", serving_mib),
        (".device/downloads/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl", 56.0),
        ("build/ignored.bin", 30.0),  # ignored by git: does not travel
    ):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        with open(root / path, "wb") as f:
            f.truncate(int(mib * MIB))  # sparse: the size counts, the disk holds nothing


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "DEVICE_LIMIT_MIB"}
    env["DEVICE_ROOT"] = str(root)
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "device_prepare.sh"), "--check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_size_check_passes_under_60_mib(tmp_path: Path) -> None:
    _fake_tree(tmp_path, nixl_mib=11.5, serving_mib=48.0)  # 59.5 MiB and the repo's 6 KB
    done = _check(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "59.51 MiB of  60.00 MiB" in done.stdout
    assert 'carry [".device/nixl", ".device/serving"]' in done.stdout
    assert "downloads" not in done.stdout and "ignored.bin" not in done.stdout


def test_size_check_fails_over_60_mib(tmp_path: Path) -> None:
    _fake_tree(tmp_path, nixl_mib=11.5, serving_mib=48.6)  # 60.1 MiB
    done = _check(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "DOES NOT FIT" in done.stderr and "60.00 MiB limit" in done.stderr
    assert "carry [" not in done.stdout


@pytest.mark.slow
def test_the_real_carry_fits_one_call(tmp_path: Path) -> None:
    """bench/device_prepare.sh for real on a checkout of this commit: the wheels the GPU
    machine lacks downloaded (PyPI), NIXL trimmed, and what one call carries under 60 MiB."""
    import shutil

    repo = Path(__file__).resolve().parents[3]
    tree = tmp_path / "tree"
    probe = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "-d",
            str(tmp_path / "p"),
            "nixl==1.5.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if probe.returncode != 0:
        pytest.skip(f"PyPI is not reachable: {probe.stderr[-300:]}")
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), "HEAD"],
        check=True,
        capture_output=True,
    )
    try:
        for name in (
            "bench/device_prepare.sh",
            "bench/nixl_trim.py",
        ):  # this tree's, committed or not
            shutil.copy(repo / name, tree / name)
        env = {k: v for k, v in os.environ.items() if k not in ("DEVICE_ROOT", "DEVICE_LIMIT_MIB")}
        done = subprocess.run(
            ["bash", str(tree / "bench" / "device_prepare.sh")],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        assert done.returncode == 0 and "FITS in one call" in done.stdout, done.stdout[-2000:]
        nixl = sum(p.stat().st_size for p in (tree / ".device" / "nixl").glob("*.whl"))
        assert nixl < 14 << 20  # the trimmed cu13 wheel (56 MiB as published)
    finally:
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
            capture_output=True,
            check=False,
        )
