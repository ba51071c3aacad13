"""`python -m decode_node` (or `pdserve decode`): one decode node process."""

from __future__ import annotations

import argparse
import sys

from common import messages as msg
from common import socket_auth
from common.config import ConfigError, DecodeConfig, add_decode_args
from common.model.loader import resolve_model_dir
from common.node.registry_set import RegistrySet
from common.node.process import (
    NodeArgs,
    NodeProcess,
    add_node_args,
    advertised,
    bind_request_socket,
    build_runner,
    setup_logging,
)
from common.tokenizer import Tokenizer
from decode_node.scheduler import DecodeScheduler
from transfer.backends import make_backend
from transfer.kv_manager import KVManager


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve decode", description=__doc__)
    add_decode_args(parser)
    add_node_args(parser)
    parser.add_argument("--prefill-endpoint", action="append", default=[], metavar="ID=ENDPOINT",
                        help="a prefill node's KV control endpoint, without a registry "
                             "(repeatable; tests and static setups)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        config = DecodeConfig.from_args(ns)
        static = dict(item.split("=", 1) for item in ns.prefill_endpoint)
    except (ConfigError, ValueError) as exc:
        print(f"pdserve decode: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(ns.log_level, "decode")
    socket_auth.configure(config.transfer.auth_token)  # before any socket: every zmq socket is CURVE
    node = NodeArgs.from_args("decode", ns, config.host, config.port)
    runner = build_runner(config.model)
    tokenizer = Tokenizer.from_pretrained(resolve_model_dir(config.model.model_path))
    backend = make_backend(config.transfer.backend, node.node_id, device=config.model.device)
    kv = KVManager(node.node_id, "decode", backend, runner.pool,
                   backend_kind=config.transfer.backend,
                   control_endpoint=node.endpoint(node.control_port),
                   auth_token=config.transfer.auth_token,
                   bootstrap_timeout_s=config.transfer.bootstrap_timeout_s,
                   waiting_timeout_s=config.transfer.waiting_timeout_s,
                   lease_s=config.transfer.lease_s, instance_id=node.instance_id)
    request_socket, request_endpoint = bind_request_socket(node)
    holder: dict[str, NodeProcess] = {}

    def registry() -> RegistrySet | None:
        return holder["process"].registry if "process" in holder else None

    def prefill_endpoint_for(node_id: str) -> str | None:
        if node_id in static:
            return static[node_id]
        client = registry()
        peer = client.peer(node_id) if client is not None else None
        return peer.get("control_endpoint") if peer else None

    def prefill_endpoints() -> list[str]:
        client = registry()
        table = client.peers().values() if client is not None else []
        return [*static.values(), *(p["control_endpoint"] for p in table
                                    if p.get("role") == "prefill" and p.get("control_endpoint"))]

    # The registry's table reaches us a heartbeat (lease/3) after the gateway's: a request
    # naming a prefill node not known here yet asks for the table at once (registry_client).
    scheduler = DecodeScheduler(config, runner, kv, request_socket, tokenizer, prefill_endpoint_for,
                                prefill_lookup_timeout_s=max(2.0, config.transfer.lease_s),
                                prefill_endpoints=prefill_endpoints)
    load = scheduler.load
    process = NodeProcess(node, scheduler.step, lambda: {**load()})
    holder["process"] = process
    control_endpoint = advertised(kv.control_endpoint, node)
    process.register(msg.RegisterNode(
        node_id=node.node_id, role="decode", request_endpoint=request_endpoint,
        control_endpoint=control_endpoint, http_url=process.http_url,
        backend=config.transfer.backend, backend_metadata=b"", kv_layout=runner.layout.to_dict(),
        num_pages=runner.pool.num_pages,
        max_running_requests=scheduler.max_running_requests,
        protocol_version=msg.PROTOCOL_VERSION, auth_token=config.transfer.auth_token,
        instance_id=node.instance_id), load)
    scheduler.gateway_watch.is_alive = process.is_gateway_alive
    process.announce(request_endpoint=request_endpoint, control_endpoint=control_endpoint)
    process.run(drain=scheduler.is_idle,
                on_drain_timeout=lambda: scheduler.fail_all(503, "the decode node is shutting "
                                                            "down (drain timeout)"))
    kv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
