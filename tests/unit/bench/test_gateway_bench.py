"""bench/serving.py against a live gateway on fake nodes: every request completes, JSON summary."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from common.tokenizer import Tokenizer
from tests.support import gateway as harness
from tests.support.gateway import Gateway, reply_ids, stream_tokens

# The harness's fixtures, used here by name.
gateway_factory = harness.gateway_factory
tokenizer = harness.tokenizer

BENCH = Path(__file__).resolve().parents[3] / "bench" / "serving.py"


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serving", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_bench_reports_latencies_and_goodput(gateway_factory, tokenizer: Tokenizer) -> None:  # type: ignore[no-untyped-def]
    gw: Gateway = gateway_factory()
    gw.node("prefill")
    gw.node("decode", stream_tokens(reply_ids(tokenizer), delay_s=0.002))
    bench = load_bench()
    args = bench.build_parser().parse_args(
        [
            "--url",
            gw.api_url,
            "--request-rate",
            "50",
            "--num-prompts",
            "8",
            "--max-tokens",
            "6",
            "--slo-ttft-ms",
            "5000",
            "--slo-tpot-ms",
            "1000",
            "--shared-prefix-words",
            "40",
        ]
    )
    summary = asyncio.run(bench.run_bench(args))
    assert (summary["completed"], summary["failed"]) == (8, 0), summary["errors"]
    assert summary["goodput_rps"] == summary["request_throughput_rps"] > 0
    assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p99_ms"] <= summary["e2e_p99_ms"]
    assert summary["itl_p50_ms"] > 0 and summary["tpot_mean_ms"] > 0
    assert summary["output_tokens_per_s"] > 0
    # Every prompt shares its leading pages: one prefill node took them all (affinity, no load).
    assert len(gw.nodes[0].wait_generates(8)) == 8


def test_bench_refuses_remote_urls() -> None:
    bench = load_bench()
    assert bench.is_loopback("http://127.0.0.1:8000") and bench.is_loopback("http://localhost:1")
    assert bench.main(["--url", "http://192.0.2.1:8000", "--num-prompts", "1"]) == 2
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
