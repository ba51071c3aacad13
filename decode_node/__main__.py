"""`python -m decode_node` (or `pdserve decode`): one decode node process."""

from __future__ import annotations

import argparse
import sys

from common.config import ConfigError, DecodeConfig
from common.flags import add_decode_args
from common.model.loader import resolve_model_dir
from common.node.process import (
    NodeProcess,
    ServedNode,
    bind_request_socket,
    build_grammar,
    build_runner,
    start_node,
)
from common.tokenizer import Tokenizer
from decode_node.scheduler import DecodeScheduler
from transfer.node_setup import build_kv_manager


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve decode", description=__doc__)
    add_decode_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        config = DecodeConfig.from_args(ns)
    except ConfigError as exc:
        print(f"pdserve decode: error: {exc}", file=sys.stderr)
        return 2
    node = start_node("decode", config.node, config.host, config.port, config.transfer.auth_token)
    runner = build_runner(config.model, max_running_requests=config.max_running_requests)
    tokenizer = Tokenizer.from_pretrained(resolve_model_dir(config.model.model_path))
    kv = build_kv_manager(
        node.node_id,
        "decode",
        config.transfer,
        runner.pool,
        control_endpoint=node.endpoint(node.control_port),
        instance_id=node.instance_id,
        device=config.model.device,
    )
    request_socket, request_endpoint = bind_request_socket(node)
    static = config.static_prefill_endpoints
    processes: list[NodeProcess] = []  # the process, once made: the registry's peer table

    def peers() -> dict[str, dict]:
        registry = processes[0].registry if processes else None
        return registry.peers() if registry is not None else {}

    def prefill_endpoint_for(node_id: str) -> str | None:
        if node_id in static:
            return static[node_id]
        registry = processes[0].registry if processes else None
        peer = registry.peer(node_id) if registry is not None else None
        return peer.get("control_endpoint") if peer else None

    def prefill_endpoints() -> list[str]:
        return [
            *static.values(),
            *(
                p["control_endpoint"]
                for p in peers().values()
                if p.get("role") == "prefill" and p.get("control_endpoint")
            ),
        ]

    # The registry's table reaches us a heartbeat (lease/3) after the gateway's: a request
    # naming a prefill node not known here yet asks for the table at once (registry_client).
    scheduler = DecodeScheduler(
        config,
        runner,
        kv,
        request_socket,
        tokenizer,
        prefill_endpoint_for,
        prefill_lookup_timeout_s=max(2.0, config.transfer.lease_s),
        prefill_endpoints=prefill_endpoints,
        grammar=build_grammar(config.node, config.model, runner.spec.vocab_size, tokenizer),
    )
    load = scheduler.load
    process = NodeProcess(node, scheduler.step, lambda: {**load()}, check=scheduler.check_integrity)
    processes.append(process)
    served = ServedNode(
        node.node_id,
        "decode",
        request_endpoint,
        kv.control_endpoint,
        scheduler.max_running_requests,
        load,
        scheduler.gateway_watch,
        caches_prefixes=config.disaggregation_decode_enable_radix_cache,
    )
    process.serve(
        runner,
        [served],
        backend=config.transfer.backend,
        auth_token=config.transfer.auth_token,
        drain=scheduler.is_idle,
        on_drain_timeout=lambda: scheduler.fail_all(
            503, "the decode node is shutting down (drain timeout)"
        ),
        close=[kv.close],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
