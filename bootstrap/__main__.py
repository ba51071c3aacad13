"""`python -m bootstrap` (or `pdserve bootstrap`): the gateway process.

The registry, the router and the OpenAI API, in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bootstrap.api_keys import ApiKeyError
from common import gc_policy, metrics, socket_auth
from common.config import BootstrapConfig, ConfigError
from common.flags import add_bootstrap_args
from common.ready import READY_PREFIX, ready_line  # noqa: F401  (READY_PREFIX: for tests)

if TYPE_CHECKING:  # the service pulls in transformers and torch: import it after the flags check
    from bootstrap.service import BootstrapService, GatewaySettings


try:
    import uvloop
except ImportError:  # optional: the standard loop serves the same, slower
    uvloop = None  # type: ignore[assignment]

logger = logging.getLogger("bootstrap")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bootstrap", description=__doc__)
    add_bootstrap_args(parser)
    return parser


def _settings(config: BootstrapConfig) -> GatewaySettings:
    from bootstrap.service import GatewaySettings

    advertise = config.advertise_host
    if advertise is None and config.host in ("0.0.0.0", "::", ""):
        advertise = socket.gethostbyname(socket.gethostname())
    return GatewaySettings(
        lease_s=config.lease_s,
        affinity_tokens=config.prefix_affinity_tokens,
        epsilon=config.load_balance_epsilon,
        reply_host=config.host or "127.0.0.1",
        reply_port=config.reply_port,
        advertise_host=advertise,
    )


def _model_name(model_path: str | None) -> str:
    if model_path is None:
        from common.model.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    path = Path(model_path.rstrip("/"))
    return path.stem if path.suffix == ".gguf" else path.name


def build_service(config: BootstrapConfig, settings: GatewaySettings) -> BootstrapService:
    """Load the tokenizer of the model and compose the service."""
    from bootstrap.service import BootstrapService
    from common.model.loader import resolve_model_dir
    from common.model.spec import ModelSpec
    from common.tokenizer import Tokenizer

    model_dir = resolve_model_dir(config.model_path)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    context_length = config.context_length or ModelSpec.from_dir(model_dir).context_length
    return BootstrapService(
        config,
        tokenizer,
        settings=settings,
        context_length=context_length,
        model_name=config.served_model_name or _model_name(config.model_path),
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        config = BootstrapConfig.from_args(ns)
    except ConfigError as exc:
        print(f"pdserve bootstrap: error: {exc}", file=sys.stderr)
        return 2
    from bootstrap.server import BootstrapServer

    settings = _settings(config)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # kill -USR1: stacks
    logging.basicConfig(
        level=getattr(logging, config.log_level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s bootstrap %(levelname)s %(name)s: %(message)s",
    )
    metrics.set_role("bootstrap")
    socket_auth.configure(config.auth_token)  # before any socket: every zmq socket is CURVE
    try:
        service = build_service(config, settings)
    except ApiKeyError as exc:
        print(f"pdserve bootstrap: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"pdserve bootstrap: error: cannot load the tokenizer: {exc}", file=sys.stderr)
        return 2
    gc_policy.settle(config.gc_gen0_threshold)  # start-up is built: freeze it
    server = BootstrapServer(
        service,
        config.host,
        config.port,
        config.bootstrap_port,
        log_level="warning" if config.log_level.upper() != "DEBUG" else "debug",
    )

    def announce(info: dict[str, object]) -> None:
        logger.info("API on %s, registry on %s", info["api_url"], info["registry_url"])
        sys.stdout.write(ready_line(info))
        sys.stdout.flush()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.request_stop)
        await server.run(on_ready=announce)

    try:
        # uvloop's event loop (libuv): bench/gateway.py measured it with httptools, which
        # uvicorn picks up by itself, at 1.1-1.3x the streamed tokens per gateway CPU-second.
        with asyncio.Runner(loop_factory=uvloop.new_event_loop if uvloop else None) as runner:
            runner.run(run())
    except RuntimeError as exc:
        print(f"pdserve bootstrap: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
