"""What the benchmarks that start a cluster on loopback share: ports, readiness, percentiles."""

from __future__ import annotations

import socket
import statistics
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, timeout_s: float = 120.0) -> None:
    """Until the gateway's /ready says a prefill and a decode node are registered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise SystemExit(f"the gateway at {url} did not become ready")


def pct(values: list[float], q: int) -> float:
    """The q-th percentile (1-99); the one value, or NaN, for fewer than two."""
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
