"""NIXL (UCX) transfer backend: one-sided page writes into a peer's registered KV pool."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack  # type: ignore[import-untyped]
import numpy as np
import torch

from common.kv_pool import KVPool
from transfer.backend import BackendError, TransferBackend, XferState
from transfer.nixl_wheel import bundled_ucx_module_dir

if TYPE_CHECKING:
    from nixl._api import (  # type: ignore[import-untyped]
        nixl_agent,
        nixl_prepped_dlist_handle,
        nixl_xfer_handle,
    )

# Loopback TCP carries UCX's active messages (notifications); shared memory/cma moves
# the data. An operator's UCX_TLS (e.g. with rc for RDMA) wins over this default (see
# ucx_env_for: a GPU pool still gets the CUDA transports added).
DEFAULT_UCX_TLS = "tcp,self,sm"
# What a pool in GPU memory needs on top: without them UCX takes VRAM for host memory and
# NIXL refuses to register it (NIXL issue 1628). Two processes on one GPU use cuda_ipc.
CUDA_UCX_TLS = ("cuda_copy", "cuda_ipc")

_LOCAL_SIDE = "NIXL_INIT_AGENT"

logger = logging.getLogger(__name__)


def _is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def ucx_env_for(
    device: str, environ: Mapping[str, str], module_dir: str | None = None
) -> dict[str, str]:
    """The UCX variables to set before NIXL starts, for a KV pool on `device`.

    UCX_TLS: the default (plus the CUDA transports on a GPU) when `environ` has none; an
    operator's list is kept, except that a GPU pool adds the CUDA transports it lacks (a list
    of what to exclude, `^...`, `all` or empty already has them). UCX_MODULE_DIR:
    `module_dir` (the NIXL wheel's own UCX plugins) unless the operator set one; otherwise UCX
    also loads plugins from its build-time folder, which may hold another UCX's.
    """
    is_cuda = _is_cuda(device)
    env: dict[str, str] = {}
    given = environ.get("UCX_TLS")
    if given is None:
        env["UCX_TLS"] = ",".join([DEFAULT_UCX_TLS, *CUDA_UCX_TLS]) if is_cuda else DEFAULT_UCX_TLS
    elif is_cuda:
        names = [t.strip() for t in given.split(",") if t.strip()]
        plain = {n.lstrip("\\") for n in names}  # a leading backslash: UCX's exact-name form
        if names and not names[0].startswith("^") and not plain & {"all", "cuda"}:
            missing = [t for t in CUDA_UCX_TLS if t not in plain]
            if missing:
                env["UCX_TLS"] = ",".join(names + missing)
    if module_dir is not None and "UCX_MODULE_DIR" not in environ:
        env["UCX_MODULE_DIR"] = module_dir
    return env


@dataclass(frozen=True)
class _Peer:
    """A remote pool this backend can write into, with its prepared per-page descriptors."""

    name: str
    num_pages: int
    dlist: nixl_prepped_dlist_handle


@dataclass
class NixlXfer:
    """Handle returned by `NixlBackend.write`; `request` is absent for notification-only sends."""

    peer: str
    request: nixl_xfer_handle | None
    state: XferState


def _error(what: str, exc: BaseException) -> BackendError:
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return BackendError(f"{what}: {first_line}")


def _page_rows(base: int, num_pages: int, bytes_per_page: int, device_id: int) -> np.ndarray:
    """One [address, length, device] row per page, as prep_xfer_dlist takes them."""
    rows = np.empty((num_pages, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(num_pages, dtype=np.uint64) * np.uint64(bytes_per_page)
    rows[:, 1] = bytes_per_page
    rows[:, 2] = device_id
    return rows


class NixlBackend(TransferBackend):
    """Writes pages with NIXL's UCX backend, no progress thread.

    Both sides prepare one descriptor per page once (local at `register_pool`, remote
    at `add_peer`); a write selects rows by page id. NIXL merges rows that are
    contiguous on both sides into one descriptor when it builds the request, so a
    run of n pages travels as one UCX operation (building per-run descriptors per
    write with `initialize_xfer` moves data no faster and takes longer to set up).
    Nothing moves unless `poll` or `get_notifications` is called,
    on either side: a target nobody polls cannot even accept the first connection.
    A write to a dead peer raises BackendError (or polls ERROR) within milliseconds.
    """

    carries_notifications = True

    def __init__(self, name: str, *, device: str = "cpu", ucx_error_handling: str = "peer") -> None:
        # The UCX context is made with the agent, before the pool exists: the transports
        # follow the device the pool will be on, which register_pool then holds it to.
        env = ucx_env_for(device, os.environ, bundled_ucx_module_dir(torch.version.cuda))
        if "UCX_TLS" in env and "UCX_TLS" in os.environ:
            logger.warning(
                "%s: UCX_TLS=%s lacks UCX's CUDA transports, which a KV pool on "
                "%s needs; using UCX_TLS=%s",
                name,
                os.environ["UCX_TLS"],
                device,
                env["UCX_TLS"],
            )
        os.environ.update(env)
        try:
            # Imported here so UCX's variables are set before the library is first loaded.
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise BackendError(f"NIXL is not installed: {exc}") from exc
        try:
            config = nixl_agent_config(enable_prog_thread=False, backends=[])
            self._agent: nixl_agent = nixl_agent(name, config)
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_handling})
        except Exception as exc:
            raise _error(f"cannot start NIXL agent {name!r}", exc) from exc
        self._name = name
        self._device = device
        self._pool: KVPool | None = None
        self._reg_descs: Any = None
        self._local_dlist: nixl_prepped_dlist_handle | None = None
        self._mem_type = "DRAM"
        self._device_id = 0
        self._peers: dict[str, _Peer] = {}
        self._is_closed = False

    @property
    def name(self) -> str:
        return self._name

    def register_pool(self, pool: KVPool) -> None:
        """Fault in, register and describe the whole pool; its contents are kept."""
        self._check_open()
        if self._pool is not None:
            raise BackendError(f"{self._name}: a pool is already registered")
        buffer = pool.buffer
        if not buffer.is_contiguous():
            raise BackendError(f"{self._name}: the pool buffer must be contiguous")
        if buffer.is_cuda and not _is_cuda(self._device):
            raise BackendError(
                f"{self._name}: the KV pool is on {buffer.device}, but this backend was made "
                f"for device={self._device!r}: UCX runs without its CUDA transports and cannot "
                "register GPU memory; make the backend with device='cuda'"
            )
        self._mem_type = "VRAM" if buffer.is_cuda else "DRAM"
        self._device_id = (buffer.device.index or 0) if buffer.is_cuda else 0
        if not buffer.is_cuda:
            # Memory never written (torch.empty, lazily zeroed mmap) is unmapped: write every
            # byte once, keeping the values, so no transfer pays for page faults.
            buffer.view(-1).view(torch.uint8).bitwise_or_(0)
        nbytes = pool.nbytes
        try:
            self._reg_descs = self._agent.register_memory(
                [(buffer.data_ptr(), nbytes, self._device_id, "")], self._mem_type
            )
            rows = _page_rows(
                buffer.data_ptr(), pool.num_pages, pool.layout.bytes_per_page, self._device_id
            )
            self._local_dlist = self._agent.prep_xfer_dlist(_LOCAL_SIDE, rows, self._mem_type)
        except Exception as exc:
            raise _error(f"{self._name}: cannot register the KV pool", exc) from exc
        self._pool = pool

    def local_metadata(self) -> bytes:
        pool = self._require_pool()
        packed: bytes = msgpack.packb(
            {
                "agent_metadata": self._agent.get_agent_metadata(),
                "name": self._name,
                "base_address": pool.data_ptr(),
                "num_pages": pool.num_pages,
                "bytes_per_page": pool.layout.bytes_per_page,
                "mem_type": self._mem_type,
                "device_id": self._device_id,
            }
        )
        return packed

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer; a peer already known under the same name is replaced."""
        pool = self._require_pool()
        try:
            md = msgpack.unpackb(metadata)
            name, bytes_per_page = str(md["name"]), int(md["bytes_per_page"])
            num_pages, base = int(md["num_pages"]), int(md["base_address"])
            mem_type, device_id = str(md["mem_type"]), int(md["device_id"])
            agent_metadata = bytes(md["agent_metadata"])
        except Exception as exc:
            raise _error(f"{self._name}: malformed peer metadata", exc) from exc
        if bytes_per_page != pool.layout.bytes_per_page:
            raise BackendError(
                f"{self._name}: peer {name!r} has {bytes_per_page}-byte pages, "
                f"this pool has {pool.layout.bytes_per_page}"
            )
        if name in self._peers:
            self.remove_peer(name)
        try:
            loaded = self._agent.add_remote_agent(agent_metadata)
            loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded_name != name:
                raise BackendError(f"metadata names agent {loaded_name!r}, expected {name!r}")
            rows = _page_rows(base, num_pages, bytes_per_page, device_id)
            dlist = self._agent.prep_xfer_dlist(name, rows, mem_type)
        except Exception as exc:
            raise _error(f"{self._name}: cannot add peer {name!r}", exc) from exc
        self._peers[name] = _Peer(name, num_pages, dlist)
        return name

    def remove_peer(self, peer: str) -> None:
        self._check_open()
        known = self._peers.pop(peer, None)
        if known is None:
            return
        try:
            self._agent.release_dlist_handle(known.dlist)
            self._agent.remove_remote_agent(peer)
        except Exception as exc:
            raise _error(f"{self._name}: cannot remove peer {peer!r}", exc) from exc

    def write(
        self, peer: str, pairs: Sequence[tuple[int, int]], notification: bytes = b""
    ) -> NixlXfer:
        pool = self._require_pool()
        target = self._peers.get(peer)
        if target is None:
            raise BackendError(f"{self._name}: unknown peer {peer!r}")
        if not pairs:
            if notification:
                try:
                    self._agent.send_notif(peer, notification)
                except Exception as exc:
                    raise _error(f"{self._name}: notification to {peer!r} failed", exc) from exc
            return NixlXfer(peer, None, XferState.DONE)
        local = [src for src, _ in pairs]
        remote = [dst for _, dst in pairs]
        _check_pages(local, pool.num_pages, "local")
        _check_pages(remote, target.num_pages, f"peer {peer!r}")
        assert self._local_dlist is not None
        try:
            request = self._agent.make_prepped_xfer(
                "WRITE", self._local_dlist, local, target.dlist, remote, notification
            )
        except Exception as exc:
            raise _error(f"{self._name}: write to {peer!r} failed", exc) from exc
        try:
            posted = self._agent.transfer(request)
        except Exception as exc:
            _release_quietly(request)
            raise _error(f"{self._name}: write to {peer!r} failed", exc) from exc
        return NixlXfer(peer, request, _STATES.get(posted, XferState.ERROR))

    def poll(self, handle: object) -> XferState:
        xfer = _as_xfer(handle)
        if xfer.state is not XferState.PENDING or xfer.request is None:
            return xfer.state
        try:
            xfer.state = _STATES.get(self._agent.check_xfer_state(xfer.request), XferState.ERROR)
        except Exception:  # noqa: BLE001 - poll reports any failure as ERROR
            xfer.state = XferState.ERROR
        return xfer.state

    def release(self, handle: object) -> None:
        xfer = _as_xfer(handle)
        if xfer.request is None:
            return
        request, xfer.request = xfer.request, None
        try:
            self._agent.release_xfer_handle(request)
        except Exception as exc:
            raise _error(f"{self._name}: cannot release a transfer to {xfer.peer!r}", exc) from exc

    def get_notifications(self) -> list[tuple[str, bytes]]:
        self._check_open()
        try:
            arrived = self._agent.get_new_notifs()
        except Exception as exc:
            raise _error(f"{self._name}: reading notifications failed", exc) from exc
        return [
            (peer.decode() if isinstance(peer, bytes) else str(peer), bytes(msg))
            for peer, msgs in arrived.items()
            for msg in msgs
        ]

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        try:
            for known in self._peers.values():
                self._agent.release_dlist_handle(known.dlist)
            self._peers.clear()
            if self._local_dlist is not None:
                self._agent.release_dlist_handle(self._local_dlist)
                self._local_dlist = None
            if self._reg_descs is not None:
                self._agent.deregister_memory(self._reg_descs)
                self._reg_descs = None
        except Exception as exc:
            raise _error(f"{self._name}: close failed", exc) from exc

    def _check_open(self) -> None:
        if self._is_closed:
            raise BackendError(f"{self._name}: backend is closed")

    def _require_pool(self) -> KVPool:
        self._check_open()
        if self._pool is None:
            raise BackendError(f"{self._name}: register_pool must come first")
        return self._pool


_STATES = {"DONE": XferState.DONE, "PROC": XferState.PENDING, "ERR": XferState.ERROR}


def _check_pages(pages: list[int], num_pages: int, side: str) -> None:
    if min(pages) < 0 or max(pages) >= num_pages:
        raise BackendError(f"page ids out of range for {side} pool of {num_pages} pages")


def _release_quietly(request: nixl_xfer_handle) -> None:
    # The caller is already reporting a failure; a second one from cleanup adds nothing.
    try:
        request.release()
    except Exception:  # noqa: BLE001, S110
        pass


def _as_xfer(handle: object) -> NixlXfer:
    if not isinstance(handle, NixlXfer):
        raise TypeError(f"not a NIXL transfer handle: {handle!r}")
    return handle
