"""Tests for common/config.py: defaults, env defaults, validation messages and fallbacks."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import pytest

from common.config import (
    SCHEDULE_POLICIES,
    BootstrapConfig,
    ConfigError,
    DecodeConfig,
    ModelConfig,
    PrefillConfig,
    TransferConfig,
)
from common.flags import (
    add_model_args,
    add_transfer_args,
    parse_bootstrap_config,
    parse_decode_config,
    parse_prefill_config,
)

ENV_VARS = (
    "PDSERVE_AUTH_TOKEN",
    "IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD",
    "IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def config_error(
    argv: list[str], parse: Callable[[list[str]], object] = parse_prefill_config
) -> str:
    with pytest.raises(ConfigError) as info:
        parse(argv)
    message = str(info.value)
    assert "\n" not in message
    assert message
    return message


def test_prefill_defaults_match_sglang() -> None:
    cfg = parse_prefill_config([])
    assert cfg == PrefillConfig()
    assert cfg.model == ModelConfig(
        model_path=None,
        dtype="auto",
        device="cpu",
        context_length=None,
        page_size=16,
        max_total_tokens=None,
        kv_cache_memory_gb=None,
    )
    assert cfg.transfer == TransferConfig(
        backend="nixl",
        bootstrap_timeout_s=300.0,
        waiting_timeout_s=300.0,
        lease_s=10.0,
        auth_token=None,
    )
    assert (cfg.host, cfg.port) == ("127.0.0.1", 30000)
    assert cfg.schedule_policy == "fcfs"
    assert cfg.max_prefill_tokens == 16384
    assert cfg.chunked_prefill_size == 8192
    assert cfg.effective_chunked_prefill_size == 8192
    assert cfg.prefill_max_requests is None
    assert cfg.max_running_requests is None
    assert cfg.max_queued_requests is None
    assert cfg.enable_priority_scheduling is False
    assert cfg.schedule_low_priority_values_first is False
    assert cfg.abort_on_priority_when_disabled is False
    assert cfg.disable_radix_cache is False
    # SGLang's HiCache defaults: off; twice the device pool; write_through
    assert (cfg.enable_hierarchical_cache, cfg.hicache_ratio, cfg.hicache_size) == (False, 2.0, 0)
    assert cfg.hicache_write_policy == "write_through"
    assert cfg.in_batch_prefix_caching_check_threshold == 32
    assert cfg.in_batch_prefix_caching_deprioritize_threshold == 32
    assert cfg.cache_aware_fallback_threshold is None
    assert cfg.effective_schedule_policy == "fcfs"


def test_decode_defaults() -> None:
    cfg = parse_decode_config([])
    assert cfg == DecodeConfig()
    assert (cfg.host, cfg.port) == ("127.0.0.1", 30001)
    assert cfg.max_running_requests is None
    assert cfg.max_queued_requests is None
    assert cfg.enable_priority_scheduling is False
    assert cfg.schedule_low_priority_values_first is False
    assert cfg.retraction_policy == "length"
    assert cfg.num_reserved_decode_tokens == 512
    assert cfg.model == ModelConfig()
    assert cfg.transfer == TransferConfig(auth_token=None)


def test_bootstrap_defaults() -> None:
    cfg = parse_bootstrap_config([])
    assert cfg == BootstrapConfig(
        host="127.0.0.1",
        port=8000,
        bootstrap_port=8998,
        auth_token=None,
        max_queued_requests=None,
        request_timeout_s=600.0,
        model_path=None,
        context_length=None,
    )
    assert cfg.gc_gen0_threshold == 50_000
    assert parse_bootstrap_config(["--gc-gen0-threshold=0"]).gc_gen0_threshold == 0


def test_prefill_flags_reach_every_field() -> None:
    cfg = parse_prefill_config(
        [
            "--model-path=/m",
            "--dtype=float16",
            "--device=cuda:1",
            "--context-length=4096",
            "--page-size=32",
            "--max-total-tokens=65536",
            "--disaggregation-transfer-backend=fake",
            "--lease-timeout=4",
            "--disaggregation-bootstrap-timeout=5",
            "--disaggregation-waiting-timeout=7.5",
            "--auth-token=secret",
            "--host=0.0.0.0",
            "--port=31000",
            "--schedule-policy=lpm",
            "--max-prefill-tokens=4096",
            "--chunked-prefill-size=1024",
            "--prefill-max-requests=8",
            "--max-running-requests=64",
            "--max-queued-requests=128",
            "--enable-priority-scheduling",
            "--schedule-low-priority-values-first",
            "--in-batch-prefix-caching-check-threshold=4",
            "--in-batch-prefix-caching-deprioritize-threshold=5",
            "--cache-aware-fallback-threshold=100",
            "--enable-hierarchical-cache",
            "--hicache-ratio=3.5",
            "--hicache-size=1.5",
            "--hicache-write-policy=write_back",
            "--no-packed-weights",
            "--no-cpu-kernels",
        ]
    )
    assert cfg.model == ModelConfig("/m", "float16", "cuda:1", 4096, 32, 65536, None, False, False)
    defaults = parse_prefill_config([]).model
    assert defaults.pack_weights and defaults.cpu_kernels  # both on by default
    assert cfg.transfer == TransferConfig("fake", 5.0, 7.5, 4.0, "secret")
    assert (cfg.host, cfg.port, cfg.schedule_policy) == ("0.0.0.0", 31000, "lpm")
    assert (cfg.max_prefill_tokens, cfg.chunked_prefill_size) == (4096, 1024)
    assert (cfg.prefill_max_requests, cfg.max_running_requests) == (8, 64)
    assert cfg.max_queued_requests == 128
    assert cfg.enable_priority_scheduling
    assert cfg.schedule_low_priority_values_first
    assert cfg.in_batch_prefix_caching_check_threshold == 4
    assert cfg.in_batch_prefix_caching_deprioritize_threshold == 5
    assert cfg.cache_aware_fallback_threshold == 100
    assert cfg.enable_hierarchical_cache
    assert (cfg.hicache_ratio, cfg.hicache_size, cfg.hicache_write_policy) == (
        3.5,
        1.5,
        "write_back",
    )


def test_decode_and_bootstrap_flags() -> None:
    decode = parse_decode_config(
        [
            "--enable-priority-scheduling",
            "--retraction-policy=priority",
            "--num-reserved-decode-tokens=0",
            "--max-running-requests=16",
            "--kv-cache-memory-gb=2.5",
            "--schedule-conservativeness=1.3",
        ]
    )
    assert decode.schedule_conservativeness == 1.3
    assert decode.retraction_policy == "priority"
    assert decode.num_reserved_decode_tokens == 0
    assert decode.max_running_requests == 16
    assert decode.model.kv_cache_memory_gb == 2.5
    boot = parse_bootstrap_config(
        [
            "--port=8080",
            "--disaggregation-bootstrap-port=9999",
            "--request-timeout=30",
            "--model-path=/tok",
            "--context-length=2048",
            "--max-queued-requests=10",
        ]
    )
    assert (boot.port, boot.bootstrap_port, boot.request_timeout_s) == (8080, 9999, 30.0)
    assert (boot.model_path, boot.context_length, boot.max_queued_requests) == ("/tok", 2048, 10)


def test_bootstrap_parser_has_no_model_or_node_flags() -> None:
    with pytest.raises(SystemExit):
        parse_bootstrap_config(["--device=cuda"])
    with pytest.raises(SystemExit):
        parse_bootstrap_config(["--schedule-policy=lpm"])


def test_model_and_transfer_parsers_stand_alone() -> None:
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    add_transfer_args(parser)
    ns = parser.parse_args(["--page-size=64", "--auth-token=t"])
    assert ModelConfig.from_args(ns) == ModelConfig(page_size=64)
    assert TransferConfig.from_args(ns) == TransferConfig(auth_token="t")


@pytest.mark.parametrize(
    ("dtype", "device", "resolved"),
    [
        ("auto", "cuda", "bfloat16"),
        ("auto", "cuda:3", "bfloat16"),
        ("float16", "cpu", "float16"),
        ("float32", "cuda", "float32"),
        ("bfloat16", "cpu", "bfloat16"),
    ],
)
def test_resolved_dtype(dtype: str, device: str, resolved: str) -> None:
    assert ModelConfig(dtype=dtype, device=device).resolved_dtype() == resolved


@pytest.mark.parametrize(
    ("flags", "resolved"),
    [
        ({"avx2", "avx512f"}, "float32"),
        ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx2", "amx_bf16", "amx_tile"}, "bfloat16"),
        (set(), "float32"),
    ],
)
def test_auto_dtype_on_cpu_follows_native_bf16(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], resolved: str
) -> None:
    import common.cpu_features as cpu_features

    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset(flags))
    assert ModelConfig(dtype="auto", device="cpu").resolved_dtype() == resolved
    assert ModelConfig(dtype="float32", device="cpu").resolved_dtype() == "float32"


@pytest.mark.parametrize("page_size", [1, 2, 16, 64, 256])
def test_power_of_two_page_sizes_parse(page_size: int) -> None:
    cfg = parse_prefill_config([f"--page-size={page_size}", "--chunked-prefill-size=512"])
    assert cfg.model.page_size == page_size


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--page-size=0"], "--page-size 0"),
        (["--page-size=12"], "power of two"),
        (["--page-size=512"], "[1, 256]"),
        (["--max-total-tokens=8"], "--max-total-tokens 8"),
        (["--kv-cache-memory-gb=0"], "--kv-cache-memory-gb"),
        (["--max-total-tokens=4096", "--kv-cache-memory-gb=1"], "pass only one"),
        (["--context-length=0"], "--context-length"),
        (["--dtype=float64"], "float32, bfloat16, float16"),
        (["--device=tpu"], "cpu, cuda or cuda:N"),
        (["--device=cuda:x"], "--device"),
        (["--disaggregation-transfer-backend=mooncake"], "nixl, fake"),
        (["--lease-timeout=0"], "--lease-timeout"),
        (["--kv-events-port=70000"], "--kv-events-port"),
        (["--request-port=-1"], "--request-port"),
        (["--drain-timeout=-1"], "--drain-timeout"),
        (["--disaggregation-bootstrap-timeout=0"], "--disaggregation-bootstrap-timeout"),
        (["--disaggregation-waiting-timeout=-1"], "--disaggregation-waiting-timeout"),
        (["--auth-token="], "--auth-token"),
        (["--port=-1"], "--port"),
        (["--max-prefill-tokens=0"], "--max-prefill-tokens"),
        (["--page-size=32", "--max-prefill-tokens=16"], "--max-prefill-tokens 16"),
        (["--chunked-prefill-size=0"], "--chunked-prefill-size 0"),
        (["--chunked-prefill-size=-2"], "--chunked-prefill-size -2"),
        (["--chunked-prefill-size=100"], "multiple of --page-size 16"),
        (["--page-size=32", "--chunked-prefill-size=16"], "--chunked-prefill-size 16"),
        (["--prefill-max-requests=0"], "--prefill-max-requests"),
        (["--max-running-requests=0"], "--max-running-requests"),
        (["--max-queued-requests=-3"], "--max-queued-requests"),
        (["--cache-aware-fallback-threshold=-1"], "--cache-aware-fallback-threshold"),
        (
            ["--schedule-policy=shortest-prefill-first", "--disable-radix-cache"],
            "drop --disable-radix-cache",
        ),
        (["--abort-on-priority-when-disabled", "--enable-priority-scheduling"], "contradicts"),
        (
            ["--enable-hierarchical-cache", "--disable-radix-cache"],
            "drop --disable-radix-cache",
        ),
        (["--hicache-ratio=0"], "--hicache-ratio 0.0 must be > 0"),
        (["--hicache-size=-1"], "--hicache-size -1.0 >= 0"),
    ],
)
def test_invalid_prefill_flags_raise_one_line_error(argv: list[str], fragment: str) -> None:
    assert fragment in config_error(argv)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--retraction-policy=priority"], "needs --enable-priority-scheduling"),
        (["--retraction-policy=oldest"], "length, priority"),
        (["--num-reserved-decode-tokens=-1"], "--num-reserved-decode-tokens"),
        (["--max-running-requests=0"], "--max-running-requests"),
        (["--page-size=3"], "--page-size 3"),
        (["--schedule-conservativeness=-0.1"], "--schedule-conservativeness"),
    ],
)
def test_invalid_decode_flags_raise_one_line_error(argv: list[str], fragment: str) -> None:
    assert fragment in config_error(argv, parse_decode_config)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--port=8998"], "both 8998"),
        (["--request-timeout=0"], "--request-timeout"),
        (["--max-queued-requests=0"], "--max-queued-requests"),
        (["--context-length=-5"], "--context-length"),
        (["--port=65536"], "--port 65536"),
    ],
)
def test_invalid_bootstrap_flags_raise_one_line_error(argv: list[str], fragment: str) -> None:
    assert fragment in config_error(argv, parse_bootstrap_config)


def test_unknown_policy_message_lists_allowed_names() -> None:
    message = config_error(["--schedule-policy=sjf"])
    assert "'sjf'" in message
    for name in SCHEDULE_POLICIES:
        assert name in message
    assert len(SCHEDULE_POLICIES) == 8


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError):
        ModelConfig(page_size=24)
    with pytest.raises(ConfigError):
        TransferConfig(backend="tcp")
    with pytest.raises(ConfigError):
        PrefillConfig(model=ModelConfig(page_size=64), chunked_prefill_size=96)
    with pytest.raises(ConfigError):
        DecodeConfig(retraction_policy="priority")
    with pytest.raises(ConfigError):
        BootstrapConfig(port=9000, bootstrap_port=9000)
    with pytest.raises(ConfigError, match="--gc-gen0-threshold"):
        BootstrapConfig(gc_gen0_threshold=-1)


def test_port_zero_means_any_free_port() -> None:
    assert BootstrapConfig(port=0, bootstrap_port=0).port == 0
    assert PrefillConfig(port=0).port == 0


def test_chunked_prefill_can_be_disabled() -> None:
    cfg = parse_prefill_config(["--chunked-prefill-size=-1"])
    assert cfg.chunked_prefill_size == -1
    assert cfg.effective_chunked_prefill_size is None


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "hrrn"])
def test_cache_aware_policies_fall_back_to_fcfs_without_radix_cache(policy: str) -> None:
    cfg = parse_prefill_config([f"--schedule-policy={policy}", "--disable-radix-cache"])
    assert cfg.schedule_policy == policy
    assert cfg.effective_schedule_policy == "fcfs"
    assert parse_prefill_config([f"--schedule-policy={policy}"]).effective_schedule_policy == policy


@pytest.mark.parametrize("policy", ["fcfs", "lof", "random", "routing-key"])
def test_cache_blind_policies_unchanged_without_radix_cache(policy: str) -> None:
    cfg = parse_prefill_config([f"--schedule-policy={policy}", "--disable-radix-cache"])
    assert cfg.effective_schedule_policy == policy


def test_shortest_prefill_first_runs_with_radix_cache() -> None:
    cfg = parse_prefill_config(["--schedule-policy=shortest-prefill-first"])
    assert cfg.effective_schedule_policy == "shortest-prefill-first"


def test_priority_flags_without_priority_scheduling_are_accepted() -> None:
    cfg = parse_prefill_config(["--schedule-low-priority-values-first"])
    assert cfg.enable_priority_scheduling is False
    assert cfg.schedule_low_priority_values_first is True
    assert parse_prefill_config(
        ["--abort-on-priority-when-disabled"]
    ).abort_on_priority_when_disabled


def test_in_batch_thresholds_default_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD", "7")
    monkeypatch.setenv("IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD", "9")
    cfg = parse_prefill_config([])
    assert cfg.in_batch_prefix_caching_check_threshold == 7
    assert cfg.in_batch_prefix_caching_deprioritize_threshold == 9
    assert PrefillConfig().in_batch_prefix_caching_check_threshold == 7
    flagged = parse_prefill_config(["--in-batch-prefix-caching-check-threshold=1"])
    assert flagged.in_batch_prefix_caching_check_threshold == 1
    assert flagged.in_batch_prefix_caching_deprioritize_threshold == 9


def test_bad_in_batch_env_value_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD", "lots")
    assert "IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD" in config_error([])


def test_auth_token_defaults_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_AUTH_TOKEN", "s3cret")
    assert parse_prefill_config([]).transfer.auth_token == "s3cret"
    assert parse_decode_config([]).transfer.auth_token == "s3cret"
    assert parse_bootstrap_config([]).auth_token == "s3cret"
    assert TransferConfig().auth_token == "s3cret"
    assert parse_bootstrap_config(["--auth-token=other"]).auth_token == "other"


def test_empty_auth_token_env_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_AUTH_TOKEN", "")
    assert parse_bootstrap_config([]).auth_token is None


@pytest.mark.parametrize(
    "config_class", [ModelConfig, TransferConfig, PrefillConfig, DecodeConfig, BootstrapConfig]
)
def test_configs_are_frozen(config_class: type[ModelConfig]) -> None:
    cfg = config_class()
    for f in dataclasses.fields(cfg):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, f.name, None)


def test_replace_revalidates() -> None:
    cfg = PrefillConfig()
    assert dataclasses.replace(cfg, port=1234).port == 1234
    with pytest.raises(ConfigError):
        dataclasses.replace(cfg, schedule_policy="nope")


@pytest.mark.parametrize(
    "parse", [parse_prefill_config, parse_decode_config, parse_bootstrap_config]
)
def test_help_never_prints_the_auth_token(
    parse: Callable[[list[str]], object],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("PDSERVE_AUTH_TOKEN", "do-not-print")
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = capsys.readouterr().out
    assert "--auth-token" in out
    assert "do-not-print" not in out
