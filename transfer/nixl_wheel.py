"""Which NIXL wheel matches the installed torch, and where that wheel keeps its UCX modules.

`python -m transfer.nixl_wheel` prints the pip requirement (`nixl-cu12==1.5.1` or
`nixl-cu13==1.5.1`) for the torch in the running interpreter; the Makefile and the Dockerfile
install what it prints. The `nixl` meta-package imports `nixl_cu{N}` for torch's CUDA major N
and refuses to load when that wheel is missing, so the pairing is not a choice. A CPU build of
torch gets nixl-cu12, as it always has (the meta-package takes whichever wheel is installed
when no CUDA is in sight).

This module runs before pdserve is installed (from the repo root, with only torch present): it
imports the standard library alone, and torch only in `main`.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

NIXL_VERSION = "1.5.1"
# CUDA majors with a nixl-cu{N} wheel of NIXL_VERSION on PyPI.
CUDA_MAJORS = (12, 13)
CPU_CUDA_MAJOR = 12


def _cuda_major(cuda: str) -> int:
    match = re.fullmatch(r"(\d+)\.\d+(?:\.\d+)?", cuda.strip())
    if match is None:
        raise ValueError(f"cannot read a CUDA version from {cuda!r} (expected e.g. '12.8')")
    return int(match.group(1))


def wheel_module(cuda: str | None) -> str:
    """The import name of the NIXL wheel for torch's CUDA version (None: a CPU build)."""
    major = CPU_CUDA_MAJOR if cuda is None else _cuda_major(cuda)
    if major not in CUDA_MAJORS:
        wheels = ", ".join(f"nixl-cu{m}" for m in CUDA_MAJORS)
        majors = " or ".join(map(str, CUDA_MAJORS))
        raise ValueError(
            f"no NIXL {NIXL_VERSION} wheel for CUDA {cuda}: there are {wheels} only; "
            f"use a torch built for CUDA {majors}"
        )
    return f"nixl_cu{major}"


def nixl_requirement(cuda: str | None, version: str = NIXL_VERSION) -> str:
    """The pip requirement of the NIXL wheel for torch's CUDA version (None: a CPU build)."""
    return wheel_module(cuda).replace("_", "-") + f"=={version}"


def bundled_ucx_module_dir(cuda: str | None) -> str | None:
    """The UCX plugin folder inside the installed NIXL wheel (`site-packages/nixl_cuN.libs/ucx`).

    The wheel the `nixl` meta-package loads: `nixl_cu{torch's CUDA major}`, or on a CPU build
    the first installed of cu13, cu12 (its own order). None when no such folder exists.
    """
    if cuda is not None:
        try:
            candidates = [wheel_module(cuda)]
        except ValueError:
            return None
    else:
        candidates = [f"nixl_cu{m}" for m in sorted(CUDA_MAJORS, reverse=True)]
    for name in candidates:
        # find_spec locates the package without running it (no library is loaded yet).
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        folder = Path(spec.origin).parent.parent / f"{name}.libs" / "ucx"
        if folder.is_dir():
            return str(folder)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m transfer.nixl_wheel", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--cuda",
        default=None,
        help="a CUDA version such as 13.0 (default: the installed torch's; none for a CPU build)",
    )
    parser.add_argument(
        "--nixl-version",
        default=NIXL_VERSION,
        help=f"the NIXL release to pin (default: {NIXL_VERSION})",
    )
    args = parser.parse_args(argv)
    if args.cuda is not None:
        cuda: str | None = None if args.cuda == "none" else args.cuda
    else:
        import torch

        cuda = torch.version.cuda
    try:
        print(nixl_requirement(cuda, args.nixl_version))
    except ValueError as exc:
        print(f"transfer.nixl_wheel: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
