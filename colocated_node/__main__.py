"""`python -m colocated_node` (or `pdserve colocated`): prefill and decode in one process, on one KV pool.

The baseline a user would otherwise run (SGLang or vLLM without disaggregation), and the
right choice for one small machine: one model, one KV pool, and the loop alternates one
prefill step (a chunk batch, at most --chunked-prefill-size tokens) with one decode step,
so a long prompt stalls the running batch for one chunk at a time, not for its whole
prefill. It is built from the same PrefillScheduler and DecodeScheduler as the two node
roles and served through the same gateway: the process registers a prefill node
`<id>.prefill` and a decode node `<id>.decode`, each naming the other in
``colocated_with``, and the router always pairs them.

The hand-over between the two is in memory: the loopback backend copies the prompt's
pages within the one pool (index_copy on the pool's buffer; no socket, no serialisation).
It does not hand page ids over: the prompt's whole pages belong to the prefill side's
radix cache (they stay cached for the next request), and a decode request holding cache
pages would need radix-tree locks that the decode side's retraction does not take.
The decode side allocates from the same pool and evicts cached prefixes it needs
(colocated_node/shared_pool.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import uuid

from colocated_node.shared_pool import ReclaimingAllocator
from common import messages as msg
from common import socket_auth
from common.config import (
    ConfigError,
    DecodeConfig,
    PrefillConfig,
    add_decode_args,
    add_prefill_args,
)
from common.model.loader import resolve_model_dir
from common.node.process import (
    NodeArgs,
    NodeProcess,
    add_node_args,
    advertised,
    bind_request_socket,
    build_runner,
    setup_logging,
)
from common.node.registry_set import RegistrySet
from common.tokenizer import Tokenizer
from decode_node.scheduler import DecodeScheduler
from prefill_node.kv_events import KVEventPublisher
from prefill_node.scheduler import PrefillScheduler
from transfer.kv_manager import KVManager
from transfer.loopback_backend import LoopbackBackend


COLOCATED_LEASE_S = 3600.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve colocated", description=__doc__.splitlines()[0],
                                     conflict_handler="resolve")
    add_prefill_args(parser)
    add_decode_args(parser)  # the shared model and transfer flags are the same flags
    add_node_args(parser)
    parser.add_argument("--kv-events-port", type=int, default=0,
                        help="zmq PUB port of the prefill side's KV cache events (0: any)")
    parser.set_defaults(port=30000)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        pconfig = PrefillConfig.from_args(ns)
        dconfig = DecodeConfig.from_args(ns)
    except ConfigError as exc:
        print(f"pdserve colocated: error: {exc}", file=sys.stderr)
        return 2
    # Its metrics carry role="prefill" or "decode" by the half that counts them; what is
    # counted for the whole process (requests, messages) goes under "decode".
    setup_logging(ns.log_level, "decode")
    socket_auth.configure(pconfig.transfer.auth_token)
    node = NodeArgs.from_args("colocated", ns, pconfig.host, pconfig.port)
    prefill_id, decode_id = f"{node.node_id}.prefill", f"{node.node_id}.decode"
    runner = build_runner(pconfig.model)
    tokenizer = Tokenizer.from_pretrained(resolve_model_dir(pconfig.model.model_path))
    transfer = pconfig.transfer
    tag = uuid.uuid4().hex[:8]  # loopback backends are named per process
    # The two halves share one process, so neither can outlive the other: the leases that
    # keep a dead peer's pages from being reused guard nothing here. They are long, so a
    # prefill step longer than the cluster's lease (the decode half grants only between
    # steps of the one loop) does not fail the rooms it delays.
    lease_s = max(transfer.lease_s, COLOCATED_LEASE_S)

    def manager(node_id: str, role: str, control_endpoint: str) -> KVManager:
        return KVManager(node_id, role, LoopbackBackend(f"{node_id}-{tag}"), runner.pool,
                         backend_kind="loopback", control_endpoint=control_endpoint,
                         auth_token=transfer.auth_token,
                         bootstrap_timeout_s=transfer.bootstrap_timeout_s,
                         waiting_timeout_s=transfer.waiting_timeout_s, lease_s=lease_s,
                         instance_id=node.instance_id)

    pkv = manager(prefill_id, "prefill", node.endpoint(node.control_port))
    dkv = manager(decode_id, "decode", node.endpoint(0))
    psock, pendpoint = bind_request_socket(node)
    dsock, dendpoint = bind_request_socket(dataclasses.replace(node, request_port=0))
    events = None if pconfig.disable_radix_cache else KVEventPublisher(
        prefill_id, node.instance_id, runner.pool.num_pages, node.endpoint(ns.kv_events_port))
    prefill = PrefillScheduler(pconfig, runner, kv=pkv, request_socket=psock, events=events)
    if prefill.tree is not None:  # the decode side may take the cache's unused pages
        runner.pool.allocator = ReclaimingAllocator(prefill.allocator, prefill.tree)  # type: ignore[assignment]
    decode = DecodeScheduler(dconfig, runner, dkv, dsock, tokenizer,
                             lambda node_id: pkv.control_endpoint if node_id == prefill_id else None,
                             prefill_endpoints=lambda: [pkv.control_endpoint])

    def step() -> bool:
        did_prefill = prefill.step()
        did_decode = decode.step()
        return did_prefill or did_decode

    def health() -> dict:
        return {"kv_pages_held": prefill.stats.num_held_pages() + decode.stats.num_held_pages(),
                "free_pages": runner.pool.allocator.num_free_pages}

    process = NodeProcess(node, step, health)
    control = advertised(pkv.control_endpoint, node)

    def registration(node_id: str, role: str, endpoint: str, partner: str,
                     max_running: int, kv_events: str = "") -> msg.RegisterNode:
        return msg.RegisterNode(
            node_id=node_id, role=role, request_endpoint=endpoint, control_endpoint=control,
            http_url=process.http_url, backend="loopback", backend_metadata=b"",
            kv_layout=runner.layout.to_dict(), num_pages=runner.pool.num_pages,
            max_running_requests=max_running, protocol_version=msg.PROTOCOL_VERSION,
            auth_token=transfer.auth_token, instance_id=node.instance_id,
            kv_events_endpoint=kv_events, colocated_with=partner)

    kv_events = advertised(events.endpoint, node) if events is not None else ""
    process.register(registration(prefill_id, "prefill", pendpoint, decode_id,
                                  pconfig.max_running_requests or 0, kv_events),
                     lambda: {"free_pages": runner.pool.allocator.num_free_pages})
    decode_registry = (RegistrySet(node.bootstrap_urls, registration(
        decode_id, "decode", dendpoint, prefill_id, decode.max_running_requests),
        decode.load).start() if node.bootstrap_urls else None)

    def gateway_alive(gateway_id: str, now: float) -> bool:
        return process.is_gateway_alive(gateway_id, now) or (
            decode_registry is not None and decode_registry.is_gateway_alive(gateway_id, now))

    prefill.gateway_watch.is_alive = decode.gateway_watch.is_alive = gateway_alive
    process.announce(request_endpoint=pendpoint, decode_request_endpoint=dendpoint,
                     control_endpoint=control, prefill_node_id=prefill_id,
                     decode_node_id=decode_id)
    def fail_all() -> None:
        for side in (prefill, decode):
            side.fail_all(503, "the colocated node is shutting down (drain timeout)")

    try:
        process.run(drain=lambda: not prefill.states and decode.is_idle(),
                    on_drain_timeout=fail_all)
    finally:
        if decode_registry is not None:
            decode_registry.stop(deregister=True)
        pkv.close()
        dkv.close()
        if events is not None:
            events.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
