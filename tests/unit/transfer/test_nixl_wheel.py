"""The NIXL wheel follows torch's CUDA major: nixl-cu12 for CPU and CUDA 12, nixl-cu13 for 13."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from transfer.nixl_wheel import NIXL_VERSION, nixl_requirement

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("cuda", "requirement"),
    [
        (None, "nixl-cu12==1.5.1"),  # a CPU build of torch: the wheel CI has always used
        ("12.1", "nixl-cu12==1.5.1"),
        ("12.8", "nixl-cu12==1.5.1"),
        ("13.0", "nixl-cu13==1.5.1"),
        ("13.2", "nixl-cu13==1.5.1"),
    ],
)
def test_the_wheel_matches_torchs_cuda_major(cuda: str | None, requirement: str) -> None:
    assert NIXL_VERSION == "1.5.1"
    assert nixl_requirement(cuda) == requirement
    assert nixl_requirement(cuda, "1.6.0") == requirement.replace("1.5.1", "1.6.0")


@pytest.mark.parametrize("cuda", ["11.8", "14.0", "", "twelve", "12"])
def test_other_cuda_versions_are_refused_by_name(cuda: str) -> None:
    with pytest.raises(ValueError, match="CUDA") as info:
        nixl_requirement(cuda)
    if cuda in ("11.8", "14.0"):
        assert "nixl-cu12" in str(info.value) and "nixl-cu13" in str(info.value)


def test_the_module_prints_this_machines_requirement_using_only_torch() -> None:
    # Run as the Makefile runs it: from the repo root, before pdserve is installed.
    probe = (
        "import runpy, sys\n"
        "runpy.run_module('transfer.nixl_wheel', run_name='__main__')\n"
        "ours = ('common', 'prefill_node', 'decode_node', 'colocated_node', 'bootstrap')\n"
        "extra = sorted(m for m in sys.modules if m.split('.')[0] in ours\n"
        "               or (m.startswith('transfer.') and m != 'transfer.nixl_wheel')\n"
        "               or m.split('.')[0] in ('nixl', 'msgpack', 'zmq'))\n"
        "print('imported:', extra, file=sys.stderr)\n"
        "sys.exit(1 if extra else 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    import torch

    assert done.stdout.strip() == nixl_requirement(torch.version.cuda)
    if torch.version.cuda is None:  # CI's CPU install stays what it was
        assert done.stdout.strip() == "nixl-cu12==1.5.1"


def test_the_module_takes_a_cuda_version_and_a_nixl_release() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "transfer.nixl_wheel", "--cuda", "13.0", "--nixl-version", "1.6.0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (0, "nixl-cu13==1.6.0\n"), done.stderr


def test_the_module_fails_loudly_for_an_unknown_cuda() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "transfer.nixl_wheel", "--cuda", "11.8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert re.search(r"CUDA 11\.8", done.stderr)
