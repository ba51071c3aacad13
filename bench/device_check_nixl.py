"""Phase d: NIXL page writes between two processes on one device, every byte checked.

A writer and a reader process (spawned), each a transfer.nixl_backend.NixlBackend with a
KVPool of SmolLM2's bfloat16 layout (16-token pages) on the device: VRAM to VRAM over
UCX's cuda_ipc on a GPU (UCX_TLS=tcp,self,sm,cuda_copy,cuda_ipc), DRAM over cma/sm on the
CPU (UCX_TLS=tcp,self,sm). The writer fills its pool with seeded random bytes and writes
all its pages into the reader's pool, `reps` times, each with a notification. A write's
time runs from posting it to the later of the writer's poll seeing DONE and the reader
seeing its notification (one system-wide monotonic clock). The reader regenerates the same
bytes on its device and compares every byte after the first write, zeroes its pool, and
compares again after the last. GB/s counts each byte once, as does the device-to-device
`copy_` of the same pool the writer measures as the yardstick. Target: >= 50% of it.
"""

from __future__ import annotations

import importlib.util
import inspect
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from device_check_common import Deadline, Mode, Sink, log, time_ms

SEED = 20261204
GPU_CONFIGS: list[tuple[str, str, bool]] = []  # no model runner, no Triton kernel
GPU_PAGES, CPU_PAGES = 2048, 128
GPU_REPS, CPU_REPS = 5, 3
WAIT_S = 20.0
TARGET = 0.5
CUDA_TLS = "tcp,self,sm,cuda_copy,cuda_ipc"
CPU_TLS = "tcp,self,sm"


def _layout() -> Any:
    from common.kv_pool import KVLayout

    return KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16, dtype="bfloat16")


def _backend(name: str, device: str) -> Any:
    from transfer.nixl_backend import NixlBackend

    if "device" in inspect.signature(NixlBackend.__init__).parameters:
        return NixlBackend(name, device=device)  # type: ignore[call-arg]
    return NixlBackend(name)


def _expected(nbytes: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(SEED)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def _pool(num_pages: int, device: str) -> tuple[Any, torch.Tensor]:
    from common.kv_pool import KVPool

    pool = KVPool(_layout(), num_pages, device)
    return pool, pool.buffer.view(-1).view(torch.uint8)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reader_main(conn: Connection, num_pages: int, device: str) -> None:
    try:
        backend = _backend("devcheck-reader", device)
        pool, raw = _pool(num_pages, device)
        backend.register_pool(pool)
        conn.send(("ok", backend.local_metadata()))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    while True:
        cmd = conn.recv()
        if cmd[0] == "wait":
            deadline = time.monotonic() + WAIT_S
            seen: float | None = None
            while seen is None and time.monotonic() < deadline:
                for _, note in backend.get_notifications():
                    if note == cmd[1]:
                        seen = time.monotonic()
                os.sched_yield()
            conn.send(seen)
        elif cmd[0] == "verify":
            expect = _expected(raw.numel(), raw.device)
            _sync(raw.device)
            equal = bool(torch.equal(raw, expect))
            bad_pages = int((raw != expect).view(num_pages, -1).any(1).sum())
            conn.send((equal, bad_pages))
            del expect
        elif cmd[0] == "zero":
            raw.zero_()
            _sync(raw.device)
            conn.send(bool(raw.count_nonzero() == 0))
        else:
            backend.close()
            conn.send("closed")
            return


def _writer_main(conn: Connection, num_pages: int, device: str) -> None:
    from transfer.backend import XferState

    try:
        backend = _backend("devcheck-writer", device)
        pool, raw = _pool(num_pages, device)
        raw.copy_(_expected(raw.numel(), raw.device))
        _sync(raw.device)  # the bytes are written before any transfer is posted
        backend.register_pool(pool)
        peer = backend.add_peer(conn.recv())
        conn.send(("ok", peer))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    pairs = [(p, p) for p in range(num_pages)]
    while True:
        cmd = conn.recv()
        if cmd[0] == "write":
            t0 = time.monotonic()
            try:
                handle = backend.write(peer, pairs, cmd[1])
                state = backend.poll(handle)
                deadline = t0 + WAIT_S
                while state is XferState.PENDING and time.monotonic() < deadline:
                    os.sched_yield()
                    state = backend.poll(handle)
                done = time.monotonic()
                if state is not XferState.PENDING:
                    backend.release(handle)
                conn.send((state.value, t0, done))
            except Exception as exc:  # noqa: BLE001
                conn.send((f"raised: {exc}", t0, time.monotonic()))
        elif cmd[0] == "copy":
            dst = torch.empty_like(raw)
            ms = min(
                time_ms(lambda: dst.copy_(raw), raw.device, warmup=1, iters=1) for _ in range(5)
            )
            del dst
            conn.send(ms)
        else:
            backend.close()
            conn.send("closed")
            return


def _ask(conn: Connection, *cmd: Any, timeout: float = WAIT_S + 10) -> Any:
    if cmd:
        conn.send(cmd)
    if not conn.poll(timeout):
        raise TimeoutError(f"no reply to {cmd[:1]} within {timeout:g} s")
    return conn.recv()


def run(mode: Mode, sink: Sink, work: Path, deadline: Deadline) -> None:
    device = "cpu" if mode.is_cpu else "cuda:0"
    num_pages = CPU_PAGES if mode.is_cpu else GPU_PAGES
    reps = CPU_REPS if mode.is_cpu else GPU_REPS
    tls = CPU_TLS if mode.is_cpu else CUDA_TLS
    os.environ["UCX_TLS"] = tls  # the children inherit it; the parent never loads NIXL
    if importlib.util.find_spec("nixl") is None:
        sink.emit(kind="nixl", ok=False, error="NIXL is not installed (carry .device/nixl)")
        return
    from transfer.nixl_backend import NixlBackend

    has_device = "device" in inspect.signature(NixlBackend.__init__).parameters
    nbytes = num_pages * _layout().bytes_per_page
    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for target in (_reader_main, _writer_main):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(child, num_pages, device), daemon=True)
        proc.start()
        child.close()
        conns.append(parent)
        procs.append(proc)
    reader, writer = conns
    base = dict(
        kind="nixl",
        device=device,
        ucx_tls=tls,
        backend_device_kw=has_device,
        num_pages=num_pages,
        bytes=nbytes,
    )
    try:
        start_s = max(5.0, min(60.0, deadline.left() - 5))  # torch, CUDA and NIXL start-up
        status, md = _ask(reader, timeout=start_s)
        if status != "ok":
            sink.emit(**base, ok=False, error=f"reader: {md}")
            return
        writer.send(md)
        status, peer = _ask(writer, timeout=start_s)
        if status != "ok":
            sink.emit(**base, ok=False, error=f"writer: {peer}")
            return
        seconds: list[float] = []
        checks: list[tuple[bool, int]] = []
        for rep in range(reps):
            if deadline.left() < 8:
                break
            tag = f"rep-{rep}".encode()
            reader.send(("wait", tag))  # the reader polls while the writer writes
            state, t0, done = _ask(writer, "write", tag)
            seen = _ask(reader)
            if state != "done" or seen is None:
                sink.emit(
                    **base, ok=False, rep=rep, state=state, notification_seen=seen is not None
                )
                return
            seconds.append(max(done, seen) - t0)
            if rep == 0 or rep == reps - 1:
                checks.append(_ask(reader, "verify", timeout=60))
                if rep == 0:
                    assert _ask(reader, "zero", timeout=60), "the reader's pool did not zero"
        copy_ms = _ask(writer, "copy", timeout=60)
        copy_gbps = nbytes / (copy_ms * 1e-3) / 1e9
        best = min(seconds)
        gbps = nbytes / best / 1e9
        log(f"nixl: {nbytes / 1e6:.0f} MB in {best * 1e3:.2f} ms best")
        all_equal = all(eq for eq, _ in checks)
        fields: dict[str, Any] = dict(
            **base,
            num_writes=len(seconds),
            first_write_ms=round(seconds[0] * 1e3, 3),
            best_write_ms=round(best * 1e3, 3),
            median_write_ms=round(sorted(seconds)[len(seconds) // 2] * 1e3, 3),
            gbps=round(gbps, 2),
            copy_gbps=round(copy_gbps, 2),
            fraction_of_copy=round(gbps / copy_gbps, 3),
            bytes_equal=all_equal,
            bad_pages=[bad for _, bad in checks],
            num_verified=len(checks),
            ok=all_equal and len(checks) == min(2, reps) and len(seconds) >= 2,
        )
        if not mode.is_cpu:
            fields.update(target=f">= {TARGET:.0%} of copy", target_met=gbps / copy_gbps >= TARGET)
        sink.emit(**fields)
        _ask(reader, "close")
        _ask(writer, "close")
    except Exception as exc:  # noqa: BLE001 - a hang or a crash is a result too
        sink.emit(
            **base,
            ok=False,
            error=f"{type(exc).__name__}: {exc}",
            alive=[p.is_alive() for p in procs],
            exitcodes=[p.exitcode for p in procs],
        )
    finally:
        for conn in conns:  # a child blocked on its pipe sees EOF and ends
            conn.close()
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
