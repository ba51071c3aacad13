"""UCX's transports follow the KV pool's device: CUDA ones for a GPU pool, operators' lists kept."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from transfer.backend import BackendError
from transfer.backends import make_backend
from transfer.nixl_backend import DEFAULT_UCX_TLS, ucx_env_for

CUDA_TLS = "tcp,self,sm,cuda_copy,cuda_ipc"


def test_cpu_gets_the_default_transports_and_cuda_adds_its_own() -> None:
    assert DEFAULT_UCX_TLS == "tcp,self,sm"
    assert ucx_env_for("cpu", {}) == {"UCX_TLS": "tcp,self,sm"}
    assert ucx_env_for("cuda", {}) == {"UCX_TLS": CUDA_TLS}
    assert ucx_env_for("cuda:1", {}) == {"UCX_TLS": CUDA_TLS}


@pytest.mark.parametrize(
    ("device", "operator", "expected"),
    [
        # On a CPU pool the operator's list wins as it is.
        ("cpu", "rc,tcp,self,sm", None),
        ("cpu", "tcp,self,cma", None),
        # On a GPU pool the CUDA transports are added, after the operator's own.
        ("cuda", "rc,tcp,self,sm", "rc,tcp,self,sm,cuda_copy,cuda_ipc"),
        ("cuda:0", "tcp,cuda_copy", "tcp,cuda_copy,cuda_ipc"),
        ("cuda", " rc , tcp ", "rc,tcp,cuda_copy,cuda_ipc"),
        # Lists that already carry them, or that name no transport to add to, are kept.
        ("cuda", "rc,tcp,cuda_copy,cuda_ipc", None),
        ("cuda", "tcp,cuda", None),  # UCX's alias for every CUDA transport
        ("cuda", "all", None),
        ("cuda", "^ib,rc", None),  # every transport but these
        ("cuda", "", None),  # empty: UCX's own default, all of them
    ],
)
def test_an_operators_list_is_kept_and_extended_only_for_a_gpu_pool(
    device: str, operator: str, expected: str | None
) -> None:
    env = ucx_env_for(device, {"UCX_TLS": operator})
    if expected is None:
        assert "UCX_TLS" not in env
    else:
        assert env["UCX_TLS"] == expected


def test_the_bundled_module_dir_is_set_unless_the_operator_set_one() -> None:
    assert ucx_env_for("cpu", {}, module_dir="/w/ucx") == {
        "UCX_TLS": "tcp,self,sm",
        "UCX_MODULE_DIR": "/w/ucx",
    }
    assert ucx_env_for("cuda", {"UCX_MODULE_DIR": "/opt/ucx/lib/ucx"}, module_dir="/w/ucx") == {
        "UCX_TLS": CUDA_TLS
    }
    assert "UCX_MODULE_DIR" not in ucx_env_for("cuda", {}, module_dir=None)


def test_the_installed_wheels_ucx_modules_are_found() -> None:
    pytest.importorskip("nixl._api", reason="NIXL is not importable")
    from transfer.nixl_wheel import bundled_ucx_module_dir

    found = bundled_ucx_module_dir(torch.version.cuda)
    assert found is not None
    path = Path(found)
    assert path.name == "ucx" and path.parent.name.startswith("nixl_cu")
    assert any(p.name.startswith("libuct_cuda.so") for p in path.iterdir())


class _RecordingAgent:
    """Stands in for nixl_agent: records the UCX environment it was created in."""

    seen: list[dict[str, str | None]] = []

    def __init__(self, name: str, config: Any) -> None:
        _RecordingAgent.seen.append(
            {key: os.environ.get(key) for key in ("UCX_TLS", "UCX_MODULE_DIR")}
        )

    def create_backend(self, kind: str, params: dict[str, str]) -> None:
        assert kind == "UCX"


@pytest.fixture
def recording_agent(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, str | None]]:
    api = pytest.importorskip("nixl._api", reason="NIXL is not importable")
    # Whatever the backend sets is undone after the test.
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_MODULE_DIR", raising=False)
    monkeypatch.setattr(api, "nixl_agent", _RecordingAgent)
    _RecordingAgent.seen = []
    return _RecordingAgent.seen


def test_a_cuda_backend_creates_its_agent_with_the_cuda_transports(
    recording_agent: list[dict[str, str | None]],
) -> None:
    make_backend("nixl", "gpu-node", device="cuda")
    [env] = recording_agent
    assert env["UCX_TLS"] == CUDA_TLS
    from transfer.nixl_wheel import bundled_ucx_module_dir

    assert env["UCX_MODULE_DIR"] == bundled_ucx_module_dir(torch.version.cuda)


def test_a_cpu_backend_keeps_the_cpu_transports(
    recording_agent: list[dict[str, str | None]],
) -> None:
    make_backend("nixl", "cpu-node")
    assert recording_agent[0]["UCX_TLS"] == DEFAULT_UCX_TLS


def test_an_operators_list_without_cuda_is_extended_with_a_warning(
    recording_agent: list[dict[str, str | None]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("UCX_TLS", "rc,tcp")
    with caplog.at_level(logging.WARNING):
        make_backend("nixl", "gpu-node", device="cuda")
    assert recording_agent[0]["UCX_TLS"] == "rc,tcp,cuda_copy,cuda_ipc"
    assert "cuda_copy" in caplog.text and "rc,tcp" in caplog.text


class _CudaBuffer:
    is_cuda = True
    device = torch.device("cuda", 0)

    def is_contiguous(self) -> bool:
        return True


class _CudaPool:
    buffer = _CudaBuffer()


def test_a_cpu_backend_refuses_a_gpu_pool(recording_agent: list[dict[str, str | None]]) -> None:
    backend = make_backend("nixl", "cpu-node")
    with pytest.raises(BackendError, match="cuda.*device='cuda'"):
        backend.register_pool(_CudaPool())  # type: ignore[arg-type]
