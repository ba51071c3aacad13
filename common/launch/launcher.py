"""`pdserve launch`: bootstrap + N prefill + M decode processes on this machine, supervised.

Flags of its own: --host, --port (API, 8000), --num-prefill (1), --num-decode (1),
--num-bootstrap (1), --model-path, --gpus, --startup-timeout, --no-restart. With N bootstrap
replicas, replica i serves the API on --port + i and its registry on the registry port
+ i (and its reply socket on --reply-port + i when one is given); every node registers
with all of them. Every other flag goes to each role whose
own parser knows it (so `--schedule-policy lpm` reaches prefill only, `--auth-token` all
three, `--api-key` the bootstrap service).

The cluster is always closed: without --auth-token (or $PDSERVE_AUTH_TOKEN) launch makes
a random cluster token, hands it to its children in the environment (never argv, which
`ps` shows) and prints none of it. A process that exits after start-up is started again
after a back-off (1 s, doubling to 30 s; back to 1 s once it ran 60 s), logged, while the
others serve on; a restarted node re-registers under its node id once its old lease is
gone. A process that dies during start-up stops everything (a bad flag, a missing model:
restarting would not help).

`--gpus 0,1,...` gives each node process one GPU of the list, in order (prefill nodes
first, then decode; colocated processes one each) and runs it on `--device cuda`; the
bootstrap service gets none.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.launch.role_args import (
    colocated_args,
    role_flags_help,
    split_extra_args,
    value,
    without,
)
from common.launch.roles import ROLE_MODULES
from common.ready import parse_ready

TOKEN_ENV = "PDSERVE_AUTH_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve launch",
        description=__doc__.splitlines()[0],
        epilog=role_flags_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the OpenAI API port")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument(
        "--colocated",
        action="store_true",
        help="run --num-prefill colocated processes (prefill and decode in one "
        "process on one KV pool, the non-disaggregated baseline; the right "
        "choice for one small machine) instead of separate prefill and "
        "decode nodes",
    )
    p.add_argument(
        "--num-bootstrap",
        type=int,
        default=1,
        help="bootstrap replicas (gateway + registry); each node registers with "
        "every one, a client may use any (API ports --port, --port+1, ...)",
    )
    p.add_argument("--model-path", default=None, help="HF directory or .gguf (default: built-in)")
    p.add_argument(
        "--gpus",
        default=None,
        metavar="0,1,...",
        help="one GPU per node process, in order: prefill nodes first, then decode "
        "(CUDA indices or UUIDs, as CUDA_VISIBLE_DEVICES takes them); each node "
        "runs on --device cuda and sees only its own GPU",
    )
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="stop the whole cluster when one process exits (default: restart it)",
    )
    return p


def child_env(token: str | None = None) -> dict[str, str]:
    """Several torch processes share this machine's cores: OpenMP threads that spin while
    waiting starve the other processes (two decode loops side by side ran 30x slower);
    passive waiting costs a lone process ~40% but keeps a shared machine usable."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if token is not None:
        env[TOKEN_ENV] = token
    return env


class LaunchError(Exception):
    """A launch that cannot start as asked; main reports it and exits 2."""


@dataclass(frozen=True)
class GpuPlacement:
    """What one node process gets from --gpus: environment variables and extra flags."""

    env: dict[str, str]
    args: tuple[str, ...]


# With --gpus the bootstrap service sees no GPU: it has no model to run, and a CUDA context
# it made by accident would take memory on a node's GPU.
BOOTSTRAP_GPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}


def place_on_gpus(gpus: str, nodes: Sequence[str], device: str | None) -> dict[str, GpuPlacement]:
    """Node name -> its GPU, one each in the order of `nodes`; `device` is the --device passed.

    Each node is placed with CUDA_VISIBLE_DEVICES=<its GPU> and runs on `cuda` (its GPU is
    its cuda:0), not with --device cuda:N over every GPU: a process that sees every GPU makes
    a CUDA context on GPU 0 whenever some code uses the current device before the node's own
    (torch's default, a library's first call, a thread that never set a device), which costs
    a few hundred MiB of another node's memory per process and shrinks the KV pool that
    --mem-fraction-static sizes there. Hiding the other GPUs leaves no GPU 0 but its own.
    NIXL's cuda_ipc between two nodes is kept: UCX maps a peer's memory handle even when
    CUDA_VISIBLE_DEVICES hides the peer's GPU (it tries cuIpcOpenMemHandle instead of asking
    for peer access by device index, UCX PR 4137), and each side's descriptors name its own
    view of its device (0), which is all the peer needs.
    """
    names = [g.strip() for g in gpus.split(",")]
    if not gpus.strip() or any(not g for g in names):
        raise LaunchError(f"--gpus {gpus!r} has an empty entry; give e.g. --gpus 0,1")
    twice = next((g for i, g in enumerate(names) if g in names[:i]), None)
    if twice is not None:
        raise LaunchError(
            f"--gpus lists GPU {twice} twice; each node needs its own "
            "(to share one GPU, leave out --gpus and pass --device cuda)"
        )
    if len(names) < len(nodes):
        raise LaunchError(
            f"--gpus names {len(names)} GPU{'s' if len(names) != 1 else ''} for "
            f"{len(nodes)} nodes ({', '.join(nodes)}); give one per node"
        )
    if device is not None and device not in ("cuda", "cuda:0"):
        raise LaunchError(
            f"--gpus runs every node on its own GPU, but --device {device} was "
            "given; leave --device out (or pass cuda: each node sees only its "
            "own GPU, as cuda:0)"
        )
    extra = ("--device", "cuda") if device is None else ()
    return {
        node: GpuPlacement({"CUDA_VISIBLE_DEVICES": gpu}, extra)
        for node, gpu in zip(nodes, names, strict=False)
    }


class Backoff:
    """Delay before restarting a process: doubles per quick exit, resets after a stable run."""

    def __init__(self, first_s: float = 1.0, max_s: float = 30.0, stable_s: float = 60.0) -> None:
        self.first_s, self.max_s, self.stable_s = first_s, max_s, stable_s
        self.num_quick_exits = 0

    def delay_after_exit(self, ran_s: float) -> float:
        """Seconds to wait before the next start of a process that ran ``ran_s``."""
        if ran_s >= self.stable_s:
            self.num_quick_exits = 0
        delay = min(self.max_s, self.first_s * 2**self.num_quick_exits)
        self.num_quick_exits += 1
        return delay


class Child:
    """One supervised process: its argv, the running Popen, and when to start it again."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.backoff = Backoff()
        self.num_restarts = 0
        self.restart_at: float | None = None  # set while it waits to be started again
        self.ready: dict[str, Any] | None = None
        self.start()

    def start(self) -> None:
        self.started_at = time.monotonic()
        self.restart_at = None
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=None, text=True, bufsize=1, env=self.env
        )
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            info = parse_ready(line)
            if info is not None:
                if self.ready is None:
                    self.ready = info
            else:
                sys.stdout.write(f"[{self.name}] {line}")

    def supervise(self, now: float) -> None:
        """Notice an exit and schedule the restart; start it again when its back-off is over."""
        if self.restart_at is None:
            code = self.proc.poll()
            if code is None:
                return
            delay = self.backoff.delay_after_exit(now - self.started_at)
            self.restart_at = now + delay
            print(
                f"pdserve launch: {self.name} exited ({_exit_text(code)}) after "
                f"{now - self.started_at:.0f} s; restarting it in {delay:g} s",
                file=sys.stderr,
                flush=True,
            )
        elif now >= self.restart_at:
            self.num_restarts += 1
            print(
                f"pdserve launch: restarting {self.name} (restart {self.num_restarts})",
                file=sys.stderr,
                flush=True,
            )
            self.start()


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _registered(url: str, token: str | None) -> list[dict[str, Any]]:
    req = urllib.request.Request(url + "/nodes")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=2) as resp:
        return json.loads(resp.read())["nodes"]


def main(argv: list[str]) -> int:
    args, extra = build_parser().parse_known_args(argv)
    per_role = split_extra_args(extra)
    per_role["colocated"] = colocated_args(per_role["prefill"], per_role["decode"])
    registry_port = value(per_role["bootstrap"], "--disaggregation-bootstrap-port", "8998")
    token = value(per_role["bootstrap"], "--auth-token", os.environ.get(TOKEN_ENV))
    for role in per_role:  # the children read it from the environment, not from `ps`
        per_role[role] = without(per_role[role], "--auth-token")
    if not token:
        # A cluster of its own: closed with a token nobody else knows.
        token = secrets.token_urlsafe(32)
        print(
            "pdserve launch: no --auth-token given; this cluster uses a random token of its own",
            flush=True,
        )
    env = child_env(token)
    if args.num_bootstrap < 1:
        raise SystemExit("pdserve launch: error: --num-bootstrap must be >= 1")
    roles = (
        (("colocated", args.num_prefill),)
        if args.colocated
        else (("prefill", args.num_prefill), ("decode", args.num_decode))
    )
    nodes = [(role, f"{role}-{i}") for role, count in roles for i in range(count)]
    placements: dict[str, GpuPlacement] = {}
    if args.gpus is not None:
        try:
            placements = place_on_gpus(
                args.gpus,
                [name for _, name in nodes],
                value(per_role[roles[0][0]], "--device", None),
            )
        except LaunchError as exc:
            print(f"pdserve launch: error: {exc}", file=sys.stderr)
            return 2
    boot_env = {**env, **BOOTSTRAP_GPU_ENV} if placements else env
    base_registry = int(registry_port or "8998")
    reply_port = value(per_role["bootstrap"], "--reply-port", None)
    boot_args = without(
        without(per_role["bootstrap"], "--disaggregation-bootstrap-port"), "--reply-port"
    )
    registries = [f"http://{args.host}:{base_registry + i}" for i in range(args.num_bootstrap)]
    model = ["--model-path", args.model_path] if args.model_path else []
    py = sys.executable
    children = []
    for i in range(args.num_bootstrap):
        own = ["--disaggregation-bootstrap-port", str(base_registry + i)]
        if reply_port is not None:
            own += ["--reply-port", str(int(reply_port) + i)]
        name = "bootstrap" if args.num_bootstrap == 1 else f"bootstrap-{i}"
        children.append(
            Child(
                name,
                [
                    py,
                    "-m",
                    "bootstrap",
                    "--host",
                    args.host,
                    "--port",
                    str(args.port + i),
                    *own,
                    *model,
                    *boot_args,
                ],
                boot_env,
            )
        )
    urls = [a for url in registries for a in ("--bootstrap-url", url)]
    for role, name in nodes:
        gpu = placements.get(name, GpuPlacement({}, ()))
        children.append(
            Child(
                name,
                [
                    py,
                    "-m",
                    ROLE_MODULES[role],
                    "--host",
                    args.host,
                    "--port",
                    "0",
                    "--node-id",
                    name,
                    *urls,
                    *model,
                    *per_role[role],
                    *gpu.args,
                ],
                {**env, **gpu.env},
            )
        )
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        if not _wait_healthy(children, registries, token, args, stopping):
            return 1
        apis = ", ".join(
            f"http://{args.host}:{args.port + i}/v1" for i in range(args.num_bootstrap)
        )
        shape = (
            f"{args.num_prefill} colocated"
            if args.colocated
            else f"{args.num_prefill} prefill, {args.num_decode} decode"
        )
        print(f"pdserve is up: OpenAI API at {apis} ({shape}). Ctrl-C stops it.", flush=True)
        while not stopping.is_set():
            if not args.restart:
                dead = [c.name for c in children if c.proc.poll() is not None]
                if dead:
                    print(f"pdserve launch: {', '.join(dead)} exited; stopping", file=sys.stderr)
                    return 1
            else:
                for child in children:
                    child.supervise(time.monotonic())
            stopping.wait(0.2)
        return 0
    finally:
        _stop_all(children)


def _wait_healthy(
    children: list[Child],
    registries: list[str],
    token: str | None,
    args: argparse.Namespace,
    stopping: threading.Event,
) -> bool:
    """Until every process is up and every replica's registry has every node healthy."""
    deadline = time.monotonic() + args.startup_timeout
    # A colocated process registers a prefill and a decode node.
    want = 2 * args.num_prefill if args.colocated else args.num_prefill + args.num_decode
    while not stopping.is_set() and time.monotonic() < deadline:
        dead = [c.name for c in children if c.proc.poll() is not None]
        if dead:
            print(f"pdserve launch: {', '.join(dead)} exited during start-up", file=sys.stderr)
            return False
        if all(c.ready for c in children):
            try:
                if all(
                    sum(1 for n in _registered(url, token) if n.get("healthy")) >= want
                    for url in registries
                ):
                    return True
            except OSError:
                pass
        time.sleep(0.2)
    if not stopping.is_set():
        print("pdserve launch: start-up timed out", file=sys.stderr)
    return False


def _stop_all(children: list[Child], grace_s: float = 20.0) -> None:
    for c in reversed(children):  # nodes first, the bootstrap service last
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)

    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
