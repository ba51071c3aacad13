"""Every flag of every role lands in a config field that the role reads; one lease flag.

Parsed by common/flags.py into common/config.py's configs.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
from pathlib import Path

import pytest

from common import config
from common.flags import (
    parse_bootstrap_config,
    parse_colocated_config,
    parse_decode_config,
    parse_prefill_config,
)

ROOT = Path(__file__).resolve().parents[3]
ENTRY_MODULES = {
    "prefill": "prefill_node.__main__",
    "decode": "decode_node.__main__",
    "colocated": "colocated_node.__main__",
    "bootstrap": "bootstrap.__main__",
}
CONFIGS: dict[str, tuple[type, ...]] = {
    "prefill": (config.PrefillConfig,),
    "decode": (config.DecodeConfig,),
    "colocated": (config.PrefillConfig, config.DecodeConfig),
    "bootstrap": (config.BootstrapConfig,),
}
# The packages whose code runs in each role's process.
PACKAGES = {
    "prefill": ("common", "transfer", "prefill_node"),
    "decode": ("common", "transfer", "decode_node"),
    "colocated": ("common", "transfer", "prefill_node", "decode_node", "colocated_node"),
    "bootstrap": ("common", "bootstrap"),
}


def _parser(role: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = importlib.import_module(ENTRY_MODULES[role]).build_parser()
    return parser


def _flags(role: str) -> dict[str, str]:
    """Each flag's first name -> its dest."""
    return {
        a.option_strings[0]: a.dest
        for a in _parser(role)._actions
        if a.option_strings and a.dest != "help"
    }


def _fields(classes: tuple[type, ...]) -> dict[str, type]:
    """Every field name of the configs, nested configs' fields included -> its class."""
    out: dict[str, type] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.name in config.NESTED_CONFIGS:
                out.update(_fields((type(getattr(cls(), f.name)),)))
            else:
                out.setdefault(f.name, cls)
    return out


def _attributes(tree: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def _attributes_read(packages: tuple[str, ...]) -> set[str]:
    """Every `x.name` in the packages' code (docstrings and comments aside) but config.py's
    own, where only the methods the packages call count (`effective_...`, not validation)."""
    config_path = ROOT / "common" / "config.py"
    names: set[str] = set()
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            if path != config_path:
                names |= _attributes(ast.parse(path.read_text()))
    for cls in ast.parse(config_path.read_text()).body:
        for fn in cls.body if isinstance(cls, ast.ClassDef) else ():
            if isinstance(fn, ast.FunctionDef) and fn.name in names:
                names |= _attributes(fn)
    return names


@pytest.mark.parametrize("role", sorted(ENTRY_MODULES))
def test_every_flag_lands_in_a_config_field(role: str) -> None:
    fields = _fields(CONFIGS[role])
    strays = {flag: dest for flag, dest in _flags(role).items() if dest not in fields}
    assert not strays, f"pdserve {role} parses flags no config holds: {strays}"


@pytest.mark.parametrize("role", sorted(ENTRY_MODULES))
def test_every_flag_is_read_by_its_role(role: str) -> None:
    read = _attributes_read(PACKAGES[role])
    unread = {flag: dest for flag, dest in _flags(role).items() if dest not in read}
    assert not unread, f"pdserve {role} parses flags that nothing reads: {unread}"


@pytest.mark.parametrize("role", sorted(ENTRY_MODULES))
def test_the_role_parser_builds_the_default_config(role: str) -> None:
    ns = _parser(role).parse_args([])
    built = tuple(cls.from_args(ns) for cls in CONFIGS[role])  # type: ignore[attr-defined]
    # A colocated process serves its HTTP side on the prefill node's default port.
    assert built == tuple(
        cls(port=30000) if role == "colocated" else cls() for cls in CONFIGS[role]
    ), "a parser default differs"


@pytest.mark.parametrize("role", sorted(ENTRY_MODULES))
def test_the_lease_has_one_name(role: str) -> None:
    flags = _flags(role)
    assert [f for f in flags if "lease" in f] == ["--lease-timeout"]
    assert flags["--lease-timeout"] == "lease_s"


def test_the_lease_defaults_agree_with_the_registry_and_router() -> None:
    from bootstrap.registry import DEFAULT_LEASE_S
    from bootstrap.router import DEFAULT_AFFINITY_TOKENS, DEFAULT_EPSILON

    boot = config.BootstrapConfig()
    assert config.DEFAULT_LEASE_S == DEFAULT_LEASE_S == boot.lease_s
    assert config.TransferConfig().lease_s == DEFAULT_LEASE_S
    assert (boot.prefix_affinity_tokens, boot.load_balance_epsilon) == (
        DEFAULT_AFFINITY_TOKENS,
        DEFAULT_EPSILON,
    )


def test_one_lease_flag_sets_both_the_nodes_and_the_registrys() -> None:
    assert parse_prefill_config(["--lease-timeout=3"]).transfer.lease_s == 3.0
    assert parse_decode_config(["--lease-timeout=3"]).transfer.lease_s == 3.0
    assert parse_bootstrap_config(["--lease-timeout=3"]).lease_s == 3.0


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_nodes_find_the_registry_by_url_only(role: str) -> None:
    # The registry's port is the bootstrap process's --disaggregation-bootstrap-port; a node
    # reaches it through --bootstrap-url, which carries the port.
    assert "--disaggregation-bootstrap-port" not in _flags(role)
    assert "--disaggregation-bootstrap-port" in _flags("bootstrap")


def test_colocated_takes_no_transfer_backend_nor_static_prefill_endpoints() -> None:
    flags = _flags("colocated")
    assert "--disaggregation-transfer-backend" not in flags  # its halves hand over in memory
    assert "--prefill-endpoint" not in flags  # its prefill half is its own
    prefill, decode = parse_colocated_config(
        ["--kv-events-port=5", "--retraction-policy", "length"]
    )
    assert (prefill.port, prefill.kv_events_port, decode.retraction_policy) == (30000, 5, "length")


def test_node_process_flags_reach_the_node_config() -> None:
    cfg = parse_decode_config(
        [
            "--node-id=d0",
            "--bootstrap-url",
            "http://a:1,http://b:2",
            "--bootstrap-url=http://c:3",
            "--advertise-host=10.0.0.1",
            "--request-port=7",
            "--control-port=8",
            "--drain-timeout=1.5",
            "--log-level=DEBUG",
            "--prefill-endpoint",
            "p0=tcp://h:9",
        ]
    )
    assert cfg.node == config.NodeConfig(
        "d0", ("http://a:1", "http://b:2", "http://c:3"), "10.0.0.1", 7, 8, 1.5, "DEBUG"
    )
    assert cfg.static_prefill_endpoints == {"p0": "tcp://h:9"}
    with pytest.raises(config.ConfigError, match="ID=ENDPOINT"):
        parse_decode_config(["--prefill-endpoint", "tcp://h:9"])


def test_bootstrap_process_flags_reach_its_config() -> None:
    cfg = parse_bootstrap_config(
        [
            "--lease-timeout=15",
            "--advertise-host=10.0.0.2",
            "--reply-port=9",
            "--log-level=debug",
            "--prefix-affinity-tokens=64",
            "--load-balance-epsilon=0.5",
            "--served-model-name=m",
        ]
    )
    assert (cfg.lease_s, cfg.advertise_host, cfg.reply_port, cfg.log_level) == (
        15.0,
        "10.0.0.2",
        9,
        "debug",
    )
    assert (cfg.prefix_affinity_tokens, cfg.load_balance_epsilon, cfg.served_model_name) == (
        64,
        0.5,
        "m",
    )
    for argv, fragment in (
        (["--lease-timeout=0"], "--lease-timeout"),
        (["--prefix-affinity-tokens=0"], "--prefix-affinity-tokens"),
        (["--load-balance-epsilon=0"], "--load-balance-epsilon"),
    ):
        with pytest.raises(config.ConfigError, match=fragment):
            parse_bootstrap_config(argv)
