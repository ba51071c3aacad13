"""Fault tests share one cluster (bootstrap, prefill-0, prefill-1, decode-0), healed before each."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.faults.harness import CHUNK, Cluster


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[Cluster]:
    pytest.importorskip("nixl._api", reason="NIXL is not installed")
    # decode-0 keeps a prefix cache: every decode case runs with it (one case needs it).
    cluster = Cluster(
        num_prefill=2,
        prefill_args=["--chunked-prefill-size", str(CHUNK)],
        decode_args=["--disaggregation-decode-enable-radix-cache"],
    )
    try:
        yield cluster.start()
    finally:
        cluster.close()


@pytest.fixture
def cluster(shared_cluster: Cluster) -> Cluster:
    """The shared cluster, whole again: what an earlier case killed or paused is back."""
    shared_cluster.heal()
    return shared_cluster


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The fault matrix: per case, the client's outcome and the seconds after the fault."""
    from tests.faults import report

    rows = report.lines()
    if len(rows) > 1:
        terminalreporter.section("fault matrix (seconds after the fault)")
        for row in rows:
            terminalreporter.write_line(row)
    path = os.environ.get("PDSERVE_FAULT_REPORT")
    if path:
        report.write_json(path)
