"""A KVManager in its own process, driven over a pipe: peer of the transfer integration tests."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Any

SMOLLM2_LAYOUT = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype="float32")


@dataclass
class NodeSpec:
    role: str
    backend: str = "nixl"
    layout: dict | None = None
    num_pages: int = 64
    lease_s: float = 1.0
    bootstrap_timeout_s: float = 5.0
    waiting_timeout_s: float = 5.0
    auth_token: str | None = None
    seed: int | None = None  # fill the pool with random values from this seed


def _serve(spec: NodeSpec, conn: Any) -> None:
    import torch

    from common.kv_pool import KVLayout, KVPool
    from transfer.backends import make_backend
    from transfer.kv_manager import KVManager
    from transfer.kv_sender import AuxData

    layout = KVLayout(**(spec.layout or SMOLLM2_LAYOUT))
    pool = KVPool(layout, spec.num_pages)
    name = f"{spec.role}-{os.getpid()}"
    manager = KVManager(
        name,
        spec.role,
        make_backend(spec.backend, name),
        pool,
        backend_kind=spec.backend,
        auth_token=spec.auth_token,
        lease_s=spec.lease_s,
        bootstrap_timeout_s=spec.bootstrap_timeout_s,
        waiting_timeout_s=spec.waiting_timeout_s,
    )
    if spec.seed is not None:
        gen = torch.Generator().manual_seed(spec.seed)
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    rooms: dict[int, Any] = {}

    def state(room: int) -> tuple[str, str | None, bool, str | None]:
        r = rooms[room]
        safe = r.is_release_safe() if hasattr(r, "is_release_safe") else True
        return r.poll().name, r.status.reason, safe, r.failure_reason

    handlers = {
        "endpoint": lambda: manager.control_endpoint,
        "create_sender": lambda room, n: rooms.__setitem__(room, manager.create_sender(room, n)),
        "create_receiver": lambda room, ep: rooms.__setitem__(
            room, manager.create_receiver(room, ep)
        ),
        "send_metadata": lambda room, pages: rooms[room].send_metadata(pages),
        "send": lambda room, pages, n, aux: rooms[room].send(
            pages, n, AuxData(**aux) if aux is not None else None
        ),
        "abort": lambda room: rooms[room].abort(),
        "state": state,
        "aux": lambda room: (rooms[room].aux.first_token_id, rooms[room].aux.top_logprobs),
        "pages": lambda pages: pool.buffer[pages].numpy().tobytes(),
        "nonzero_pages": lambda: [
            int(p)
            for p in torch.nonzero(
                pool.buffer[: pool.num_pages].reshape(pool.num_pages, -1).abs().sum(1)
            ).flatten()
        ],
        "dropped": lambda: dict(manager.metrics.num_dropped),
    }
    while True:
        manager.poll()
        if conn.poll(0):
            cmd, args = conn.recv()
            if cmd == "stop":
                manager.close()
                conn.send(None)
                return
            try:
                conn.send(("ok", handlers[cmd](*args)))
            except Exception as exc:  # report to the test, keep serving
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
        else:
            time.sleep(0.0002)


class NodeProcess:
    """Handle on a node process: `call("create_sender", room, n)` etc., `kill()` to crash it."""

    def __init__(self, spec: NodeSpec) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(spec, child), daemon=True)
        self.proc.start()
        self.endpoint = self.call("endpoint", timeout=60)

    def call(self, cmd: str, *args: Any, timeout: float = 10.0) -> Any:
        self.conn.send((cmd, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{cmd} got no answer in {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def wait_state(self, room: int, states: tuple[str, ...], timeout: float = 10.0) -> tuple:
        deadline = time.monotonic() + timeout
        while True:
            st = self.call("state", room)
            if st[0] in states:
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"room {room} stuck in {st} (wanted {states})")
            time.sleep(0.005)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", ()))
                self.conn.poll(5)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
