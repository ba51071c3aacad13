"""A real Prometheus scrapes a real `pdserve launch`, runs the chart's dashboard queries and rules.

Prometheus (Debian's `prometheus` package) scrapes the bootstrap service and every node on
loopback, with the namespace and pod labels a Kubernetes scrape would add, and loads the
chart's rules file. After a few requests every dashboard query must succeed, the panels an
operator reads first must have data, every rule must evaluate without error, and the KV-leak
alert's expression must be empty once the system is idle. Skipped when prometheus is not
installed or `pdserve launch` cannot start here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import helm_tools as ht
from tests.support.launched import Launch, free_port, get_json, stop
from tests.support.waits import wait_for

pytestmark = pytest.mark.slow

NUM_REQUESTS = 4
NAMESPACE = "e2e"
# Panels that must show data after a few requests (title/refId of the dashboard queries).
MUST_HAVE_DATA = (
    "Time to first token/A",
    "Time to first token/B",
    "Inter-token latency/B",
    "End-to-end latency/B",
    "Time to first token by stage/A",
    "Requests by outcome/A",
    "Tokens per second/A",
    "Tokens per second/C",
    "Queue length per role and queue/A",
    "KV pages used per node/A",
    "KV pages used per node/B",
    "KV pages held per node/A",
    "Waiting-queue sort time/B",
    "Replicas per role/A",
    "Replicas per role/B",
)


class Prometheus:
    def __init__(self, workdir: Path, targets: list[tuple[str, str]]) -> None:
        self.port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ht.FILES_DIR / "prometheus-rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": "pdserve",
                    "static_configs": [
                        {"targets": [t], "labels": {"namespace": NAMESPACE, "pod": pod}}
                        for t, pod in targets
                    ],
                }
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc = subprocess.Popen(
            [
                shutil.which("prometheus") or "prometheus",
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "prometheus did not start: "
                        f"{self.proc.stderr.read() if self.proc.stderr else ''}"
                    )
                time.sleep(0.2)

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        try:
            body = get_json(url)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{expr}: {exc.read().decode()}") from None
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def wait_for(self, expr: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while not (result := self.query(expr)) and time.monotonic() < deadline:
            time.sleep(0.5)
        return result


def _chat(api_port: int, text: str, stream: bool) -> None:
    body = json.dumps(
        {
            "model": "default",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 12,
            "stream": stream,
        }
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{api_port}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    # 503 means no healthy pair right now (e.g. a heartbeat late on a busy machine): retry.
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                resp.read()
                assert resp.status == 200
                return
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise AssertionError(
                    f"chat request failed: {exc.code} {exc.read()[:300]!r}"
                ) from None
            time.sleep(0.2)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[Launch, Prometheus]]:
    if shutil.which("prometheus") is None:
        pytest.skip(
            "prometheus not found: install Debian's prometheus package (apt-get install prometheus)"
        )
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-prom-"))
    launch = Launch(workdir)
    prometheus = None
    try:
        launch.wait_up()
        prometheus = Prometheus(workdir, launch.targets())
        # One request creates the latency series; Prometheus sees them before the rest come,
        # so rates over the test's window have increments to show.
        _chat(launch.api_port, "Hello!", stream=False)
        prometheus.wait_for("pdserve_time_to_first_token_seconds_count")
        for i in range(NUM_REQUESTS):
            _chat(launch.api_port, f"Name {i + 1} colours of the rainbow.", stream=i % 2 == 1)
        yield launch, prometheus
    finally:
        if prometheus is not None:
            stop(prometheus.proc)
        stop(launch.proc)
        shutil.rmtree(workdir, ignore_errors=True)


def test_every_dashboard_query_runs_and_the_main_panels_have_data(
    stack: tuple[Launch, Prometheus],
) -> None:
    _, prom = stack
    finished = prom.wait_for(
        f'sum(pdserve_requests_total{{role="bootstrap",outcome="finished"}}) > {NUM_REQUESTS}'
    )
    assert finished, "Prometheus never saw the requests finish"
    empty = []
    for key, expr in ht.dashboard_exprs(ht.dashboard()).items():
        runnable = expr.replace("$__rate_interval", "1m").replace("$namespace", NAMESPACE)
        if key in MUST_HAVE_DATA:
            if not prom.wait_for(runnable, timeout_s=15):
                empty.append(key)
        else:
            prom.query(runnable)  # must run; may be empty (no failures, no retractions)
    assert empty == []


def test_every_rule_evaluates_and_nothing_leaks_when_idle(stack: tuple[Launch, Prometheus]) -> None:
    _, prom = stack
    rules_file = ht.alert_rules()
    expected = sum(len(g["rules"]) for g in rules_file["groups"])
    deadline = time.monotonic() + 30
    while True:
        groups = get_json(f"http://127.0.0.1:{prom.port}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if len(rules) == expected and all(r["health"] != "unknown" for r in rules):
            break  # every rule has been evaluated at least once
        assert time.monotonic() < deadline, "rules were not evaluated"
        time.sleep(0.5)
    assert {r["name"]: r["health"] for r in rules if r["health"] != "ok"} == {}
    # Requests are over: no node holds pages for live requests, so the leak alert's expression
    # (its `for: 10m` aside) selects nothing.
    leak = next(
        r["expr"]
        for g in rules_file["groups"]
        for r in g["rules"]
        if r.get("alert") == "PdserveKVPagesHeldWhileIdle"
    )

    # Prometheus scrapes every second: wait for scrapes that see the nodes hold no page, then
    # the leak alert's expression must select nothing.
    def nothing_held() -> bool:
        held = prom.query("max(pdserve_kv_pages_held)")
        return bool(held) and held[0]["value"][1] == "0"

    wait_for(nothing_held, 30, "scrapes of idle nodes holding no page")
    assert prom.query(leak) == []
