"""`python -m prefill_node` (or `pdserve prefill`): one prefill node process."""

from __future__ import annotations

import argparse
import sys

from common import messages as msg
from common import socket_auth
from common.config import ConfigError, PrefillConfig, add_prefill_args
from common.node.process import (
    NodeArgs,
    NodeProcess,
    add_node_args,
    advertised,
    bind_request_socket,
    build_runner,
    setup_logging,
)
from prefill_node.kv_events import KVEventPublisher
from prefill_node.scheduler import PrefillScheduler
from transfer.backends import make_backend
from transfer.kv_manager import KVManager


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve prefill", description=__doc__)
    add_prefill_args(parser)
    add_node_args(parser)
    parser.add_argument("--kv-events-port", type=int, default=0,
                        help="zmq PUB port of the node's KV cache events, which every gateway "
                             "subscribes to for precise prefix routing (0: any free port)")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        config = PrefillConfig.from_args(ns)
    except ConfigError as exc:
        print(f"pdserve prefill: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(ns.log_level, "prefill")
    socket_auth.configure(config.transfer.auth_token)  # before any socket: every zmq socket is CURVE
    node = NodeArgs.from_args("prefill", ns, config.host, config.port)
    runner = build_runner(config.model, decodes=False)
    backend = make_backend(config.transfer.backend, node.node_id, device=config.model.device)
    kv = KVManager(
        node.node_id,
        "prefill",
        backend,
        runner.pool,
        backend_kind=config.transfer.backend,
        control_endpoint=node.endpoint(node.control_port),
        auth_token=config.transfer.auth_token,
        bootstrap_timeout_s=config.transfer.bootstrap_timeout_s,
        waiting_timeout_s=config.transfer.waiting_timeout_s,
        lease_s=config.transfer.lease_s,
        instance_id=node.instance_id,
    )
    request_socket, request_endpoint = bind_request_socket(node)
    events = None if config.disable_radix_cache else KVEventPublisher(
        node.node_id, node.instance_id, runner.pool.num_pages, node.endpoint(ns.kv_events_port))
    scheduler = PrefillScheduler(config, runner, kv, request_socket, events=events)

    def load() -> dict:
        return {
            "waiting": len(scheduler.waiting_queue),
            "bootstrap": len(scheduler.bootstrap_queue),
            "inflight": len(scheduler.inflight_queue),
            "free_pages": runner.pool.allocator.num_free_pages,
            "evictable_pages": scheduler.tree.evictable_size() // runner.page_size
            if scheduler.tree
            else 0,
        }

    process = NodeProcess(
        node, scheduler.step, lambda: {"kv_pages_held": scheduler.stats.num_held_pages(), **load()}
    )
    control_endpoint = advertised(kv.control_endpoint, node)
    process.register(
        msg.RegisterNode(
            node_id=node.node_id,
            role="prefill",
            request_endpoint=request_endpoint,
            control_endpoint=control_endpoint,
            http_url=process.http_url,
            backend=config.transfer.backend,
            backend_metadata=b"",
            kv_layout=runner.layout.to_dict(),
            num_pages=runner.pool.num_pages,
            max_running_requests=config.max_running_requests or 0,
            protocol_version=msg.PROTOCOL_VERSION,
            auth_token=config.transfer.auth_token,
            instance_id=node.instance_id,
            kv_events_endpoint=advertised(events.endpoint, node) if events is not None else "",
        ),
        load,
    )
    scheduler.gateway_watch.is_alive = process.is_gateway_alive
    process.announce(request_endpoint=request_endpoint, control_endpoint=control_endpoint)
    process.run(drain=lambda: not scheduler.states,
                on_drain_timeout=lambda: scheduler.fail_all(503, "the prefill node is shutting "
                                                            "down (drain timeout)"))
    kv.close()
    if events is not None:
        events.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
