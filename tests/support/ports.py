"""Free loopback ports for test and bench processes, never the same one twice in a run.

A port from bind(0) lies in the kernel's ephemeral range, where, in the seconds before the
process it is meant for binds it, any socket may be handed it: an outgoing connection's
local port (UCX over TCP opens many), another process's port-0 bind. A fault-test cluster
once failed to start on "address already in use" that way (19 tests errored at setup).
Ports are drawn at random below that range instead, where the kernel hands out nothing by
itself, checked free by binding them, and remembered: binding port 0 and closing it can
also give the same port to two flags (a bootstrap once got --port and
--disaggregation-bootstrap-port both 48373).
"""

from __future__ import annotations

import random
import socket

_GIVEN: set[int] = set()
_RNG = random.SystemRandom()  # not the tests' seeded random: two runs draw apart
_LOWEST = 10000


def ephemeral_low() -> int:
    """Where the kernel's ephemeral port range starts (Linux; 32768 where unreadable)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    high = ephemeral_low()
    for _ in range(1000):
        # Below the ephemeral range when it leaves room; else the kernel's choice.
        port = _RNG.randrange(_LOWEST, high) if high - _LOWEST >= 1000 else 0
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # someone listens there (or a connection holds it)
                continue
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port on {host} after 1000 tries")
