"""NIXL backend between two real processes: bytes land, notifications arrive, dead peers fail."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from common.kv_pool import KVLayout, KVPool
from transfer.backend import BackendError, XferState
from transfer.backends import make_backend
from transfer.nixl_backend import NixlBackend

pytest.importorskip("nixl._api", reason="NIXL is not importable (import nixl._api failed)")

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float32")
# SmolLM2-135M in float32: 46,080 B of KV per token, a 16-token page is 737,280 B.
SMOLLM2 = KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype="float32")
NUM_PAGES = 64
SEED = 20240611
REPLY_TIMEOUT_S = 20.0  # covers a child's start (torch + NIXL import) on two busy cores
WAIT_S = 5.0


def _source_bytes(layout: KVLayout, num_pages: int) -> torch.Tensor:
    """The writer's pool contents: seeded random bytes, [num_pages, bytes_per_page]."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.randint(
        0, 256, (num_pages, layout.bytes_per_page), dtype=torch.uint8, generator=gen
    )


def _page_bytes(pool: KVPool) -> torch.Tensor:
    return pool.buffer.view(pool.num_pages, -1).view(torch.uint8)


def _device(layout: dict[str, Any]) -> str:
    """The pools' device, carried beside the layout ("cpu" unless a test asks for cuda)."""
    return str(layout.get("device", "cpu"))


def _target_main(conn: Connection, name: str, layout: dict[str, Any]) -> None:
    """Target: register a zero pool, hand out metadata, then serve 'wait'/'dump' commands."""
    backend = NixlBackend(name, device=_device(layout))
    pool = KVPool(KVLayout.from_dict(layout), NUM_PAGES, _device(layout))
    backend.register_pool(pool)
    conn.send(backend.local_metadata())
    while True:
        cmd = conn.recv()
        if cmd[0] == "wait":
            expected: list[bytes] = cmd[1]
            got: list[tuple[str, bytes]] = []
            deadline = time.monotonic() + WAIT_S
            while len(got) < len(expected) and time.monotonic() < deadline:
                got += backend.get_notifications()
                os.sched_yield()
            conn.send(got)
        elif cmd[0] == "dump":
            conn.send(_page_bytes(pool).cpu().numpy().tobytes())
        else:
            backend.close()
            conn.send("closed")
            return


def _writer_main(conn: Connection, name: str, layout: dict[str, Any]) -> None:
    """Writer: fill a pool with seeded bytes, add the peer it is sent, serve 'write' commands."""
    kv_layout = KVLayout.from_dict(layout)
    backend = NixlBackend(name, device=_device(layout))
    pool = KVPool(kv_layout, NUM_PAGES, _device(layout))
    backend.register_pool(pool)
    _page_bytes(pool).copy_(_source_bytes(kv_layout, NUM_PAGES))
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    peer = backend.add_peer(conn.recv())
    conn.send(peer)
    while True:
        cmd = conn.recv()
        if cmd[0] != "write":
            backend.close()
            conn.send("closed")
            return
        outcomes: list[str] = []
        try:
            handles = [backend.write(peer, pairs, notif) for pairs, notif in cmd[1]]
            deadline = time.monotonic() + WAIT_S
            for handle in handles:
                state = backend.poll(handle)
                while state is XferState.PENDING and time.monotonic() < deadline:
                    os.sched_yield()
                    state = backend.poll(handle)
                outcomes.append(state.value)
                if state is not XferState.PENDING:
                    backend.release(handle)
        except BackendError as exc:
            outcomes.append(f"raised: {exc}")
        conn.send(outcomes)


class _Child:
    """A spawned process and our end of its pipe; every reply is awaited with a deadline."""

    def __init__(
        self, target: Callable[..., None], name: str, layout: KVLayout, device: str = "cpu"
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=target, args=(child_conn, name, {**layout.to_dict(), "device": device})
        )
        self.process.start()
        child_conn.close()

    def ask(self, *cmd: Any, timeout: float = REPLY_TIMEOUT_S) -> Any:
        if cmd:
            self.conn.send(cmd)
        return self.reply(timeout)

    def reply(self, timeout: float = REPLY_TIMEOUT_S) -> Any:
        if not self.conn.poll(timeout):
            raise AssertionError(f"no reply from {self.process.name} within {timeout} s")
        return self.conn.recv()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)


Spawn = Callable[..., _Child]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Starts children and kills whichever are still alive when the test ends."""
    children: list[_Child] = []

    def start(
        target: Callable[..., None], name: str, layout: KVLayout, device: str = "cpu"
    ) -> _Child:
        children.append(_Child(target, name, layout, device))
        return children[-1]

    yield start
    for child in children:
        child.kill()


def _connect(
    spawn: Spawn, layout: KVLayout, tag: str, device: str = "cpu"
) -> tuple[_Child, _Child]:
    target = spawn(_target_main, f"target-{tag}", layout, device)
    writer = spawn(_writer_main, f"writer-{tag}", layout, device)
    writer.conn.send(target.reply())  # the target's metadata
    assert writer.reply() == f"target-{tag}"  # the writer has added the peer
    return target, writer


# Contiguous runs, pages consecutive on one side only, and lone pages, in several writes.
WRITES: list[tuple[list[tuple[int, int]], bytes]] = [
    ([(p, 10 + p) for p in range(8)], b"req-1"),
    ([(20, 3), (5, 40), (33, 41), (34, 42), (35, 43), (63, 0), (36, 45)], b"req-2"),
    ([(9, 63)], b"req-3"),
]


@pytest.mark.parametrize("layout", [SMALL, SMOLLM2], ids=["small", "smollm2"])
def test_writes_land_byte_for_byte_with_their_notifications(spawn, layout, device):
    """DRAM to DRAM, and where torch sees a GPU VRAM to VRAM (the CUDA transports)."""
    tag = f"{layout.num_layers}-{device.type}"
    target, writer = _connect(spawn, layout, tag, device.type)
    writer_name = f"writer-{tag}"
    for pairs, notif in WRITES:
        # The target polls (as a decode loop does) while the writer writes: without a
        # progress thread, a side that nobody polls cannot answer UCX's connection setup.
        target.conn.send(("wait", [notif]))
        assert writer.ask("write", [(pairs, notif)]) == ["done"]
        assert target.reply() == [(writer_name, notif)]
    # Several writes in flight at once, one with no notification, then a notification alone.
    batch = [([(50, 50), (51, 51)], b"req-4"), ([(52, 30)], b""), ([], b"only-notif")]
    target.conn.send(("wait", [b"req-4", b"only-notif"]))
    assert writer.ask("write", batch) == ["done", "done", "done"]
    got = target.reply()
    assert sorted(got) == [(writer_name, b"only-notif"), (writer_name, b"req-4")]

    dst = torch.frombuffer(bytearray(target.ask("dump")), dtype=torch.uint8)
    dst = dst.view(NUM_PAGES, layout.bytes_per_page)
    src = _source_bytes(layout, NUM_PAGES)
    all_pairs = [pair for pairs, _ in WRITES + batch for pair in pairs]
    for s, d in all_pairs:
        assert torch.equal(dst[d], src[s]), f"page {s} -> {d} differs"
    untouched = sorted(set(range(NUM_PAGES)) - {d for _, d in all_pairs})
    assert len(untouched) == NUM_PAGES - len(all_pairs)
    assert not dst[untouched].any()
    assert target.ask("close") == "closed" and writer.ask("close") == "closed"


@pytest.mark.parametrize("is_connected", [True, False], ids=["after-a-write", "before-any-write"])
def test_write_to_killed_peer_fails_within_seconds(spawn, is_connected):
    tag = f"dead-{is_connected}"
    target, writer = _connect(spawn, SMALL, tag)
    if is_connected:
        target.conn.send(("wait", [b"before"]))
        assert writer.ask("write", [([(0, 0)], b"before")]) == ["done"]
        assert target.reply() == [(f"writer-{tag}", b"before")]
    target.kill()
    started = time.monotonic()
    outcomes = writer.ask("write", [([(1, 1), (2, 2)], b"after")], timeout=WAIT_S + 5)
    assert time.monotonic() - started < WAIT_S + 1
    assert len(outcomes) == 1
    assert outcomes[0] == "error" or outcomes[0].startswith("raised: "), outcomes
    assert writer.ask("close") == "closed"


def _wait_done(
    writer: NixlBackend, target: NixlBackend, handle: object
) -> tuple[XferState, list[tuple[str, bytes]]]:
    """Poll both in-process agents (each progresses only when polled) until the write ends."""
    deadline = time.monotonic() + WAIT_S
    notifications: list[tuple[str, bytes]] = []
    state = writer.poll(handle)
    while state is XferState.PENDING and time.monotonic() < deadline:
        notifications += target.get_notifications()
        state = writer.poll(handle)
    writer.release(handle)
    while not notifications and time.monotonic() < deadline:
        notifications += target.get_notifications()
    return state, notifications


def test_misuse_raises_backend_error_and_a_removed_peer_can_be_added_again():
    writer, target = NixlBackend("w-local"), NixlBackend("t-local")
    other = make_backend("nixl", "o-local")
    assert isinstance(other, NixlBackend) and other.carries_notifications
    src, dst = KVPool(SMALL, 8), KVPool(SMALL, 8)
    with pytest.raises(BackendError, match="register_pool must come first"):
        writer.local_metadata()
    writer.register_pool(src)
    target.register_pool(dst)
    other.register_pool(KVPool(SMOLLM2, 2))
    with pytest.raises(BackendError, match="already registered"):
        writer.register_pool(src)
    with pytest.raises(BackendError, match="byte pages"):
        writer.add_peer(other.local_metadata())
    with pytest.raises(BackendError, match="malformed"):
        writer.add_peer(b"\x93junk")
    with pytest.raises(BackendError, match="unknown peer"):
        writer.write("t-local", [(0, 0)])

    _page_bytes(src).copy_(_source_bytes(SMALL, 8))
    peer = writer.add_peer(target.local_metadata())
    with pytest.raises(BackendError, match="out of range"):
        writer.write(peer, [(0, 8)])
    writer.remove_peer(peer)
    with pytest.raises(BackendError, match="unknown peer"):
        writer.write(peer, [(0, 0)])
    assert writer.add_peer(target.local_metadata()) == peer
    state, notifications = _wait_done(writer, target, writer.write(peer, [(3, 5), (4, 6)], b"n"))
    assert state is XferState.DONE and notifications == [("w-local", b"n")]
    assert torch.equal(_page_bytes(dst)[5:7], _page_bytes(src)[3:5])
    assert not _page_bytes(dst)[:5].any() and not _page_bytes(dst)[7:].any()

    writer.close()
    with pytest.raises(BackendError, match="closed"):
        writer.write(peer, [(0, 0)])
    target.close()
    other.close()


def _cuda_configured_main(conn: Connection, name: str, layout: dict[str, Any]) -> None:
    """Two backends made for a GPU, on this CPU-only machine: report UCX_TLS and a write."""
    for key in ("UCX_TLS", "UCX_MODULE_DIR"):  # as a fresh node process starts
        os.environ.pop(key, None)
    kv_layout = KVLayout.from_dict(layout)
    writer = NixlBackend(f"{name}-w", device="cuda")
    target = NixlBackend(f"{name}-t", device="cuda")
    src, dst = KVPool(kv_layout, 4), KVPool(kv_layout, 4)
    writer.register_pool(src)
    target.register_pool(dst)
    _page_bytes(src).copy_(_source_bytes(kv_layout, 4))
    peer = writer.add_peer(target.local_metadata())
    state, notifications = _wait_done(writer, target, writer.write(peer, [(1, 2)], b"gpu"))
    conn.send(
        {
            "ucx_tls": os.environ.get("UCX_TLS"),
            "ucx_module_dir": os.environ.get("UCX_MODULE_DIR"),
            "state": state.value,
            "notifications": notifications,
            "landed": torch.equal(_page_bytes(dst)[2], _page_bytes(src)[1]),
        }
    )
    writer.close()
    target.close()


def test_a_backend_made_for_cuda_starts_with_the_cuda_transports_even_without_a_gpu(spawn):
    # UCX warns that cuda_copy/cuda_ipc are unavailable here and runs on the rest: a node
    # started for a GPU gets the transports it needs there, and nothing breaks where the
    # CUDA modules cannot load (no libcuda).
    from transfer.nixl_wheel import bundled_ucx_module_dir

    got = spawn(_cuda_configured_main, "cuda-cfg", SMALL).reply()
    assert got["ucx_tls"] == "tcp,self,sm,cuda_copy,cuda_ipc"
    assert got["ucx_module_dir"] == bundled_ucx_module_dir(torch.version.cuda)
    assert got["state"] == XferState.DONE.value and got["landed"]
    assert got["notifications"] == [("cuda-cfg-w", b"gpu")]
