"""The package's build step beyond pyproject.toml: the CPU kernels, compiled at install time.

`pip install .` (a wheel) and `pip install -e .` both run `build_cpu_kernels`, which builds
common/model/cpu/csrc into one shared library per instruction set (common/model/cpu/build.py)
under common/model/cpu/lib/: in the wheel, or in place for an editable install. The wheel is
platform-specific; the machine that installs it needs no compiler.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import ClassVar

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = Path("common", "model", "cpu")


def _build_module():
    """common/model/cpu/build.py by path (standard library only; the package's own
    dependencies need not be installed yet)."""
    spec = importlib.util.spec_from_file_location(
        "_pdserve_cpu_build", ROOT / PACKAGE_DIR / "build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildCpuKernels(Command):
    """Compile the CPU kernels' variants into the package's lib/ directory."""

    description = "compile the CPU kernels (one shared library per instruction set)"
    user_options: ClassVar[list] = []

    def initialize_options(self) -> None:
        self.build_lib: str | None = None
        self.editable_mode = False
        self._outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def run(self) -> None:
        base = ROOT if self.editable_mode or self.build_lib is None else Path(self.build_lib)
        built = _build_module().build_all(base / PACKAGE_DIR / "lib")
        self._outputs = [] if self.editable_mode else [str(p) for p in built]

    def get_outputs(self) -> list[str]:
        return self._outputs

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return [str(p.relative_to(ROOT)) for p in sorted((ROOT / PACKAGE_DIR / "csrc").iterdir())]


class BinaryDistribution(Distribution):
    """A wheel with compiled libraries in it: tagged for this platform, not pure Python."""

    def has_ext_modules(self) -> bool:
        return True


build.sub_commands = [*build.sub_commands, ("build_cpu_kernels", None)]
setup(cmdclass={"build_cpu_kernels": BuildCpuKernels}, distclass=BinaryDistribution)
