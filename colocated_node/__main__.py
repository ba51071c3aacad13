"""`python -m colocated_node` (or `pdserve colocated`): prefill and decode in one process.

Both on one KV pool.

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
from common.config import ConfigError, DecodeConfig, PrefillConfig
from common.flags import add_colocated_args
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
from prefill_node.kv_events import KVEventPublisher
from prefill_node.prefill_cache import cache_pages
from prefill_node.scheduler import PrefillScheduler
from transfer.kv_manager import KVManager
from transfer.node_setup import build_kv_manager

COLOCATED_LEASE_S = 3600.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve colocated", description=__doc__.splitlines()[0])
    add_colocated_args(parser)
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
    node = start_node(
        "colocated",
        pconfig.node,
        pconfig.host,
        pconfig.port,
        pconfig.transfer.auth_token,
        metrics_role="decode",
    )
    prefill_id, decode_id = f"{node.node_id}.prefill", f"{node.node_id}.decode"
    runner = build_runner(pconfig.model, max_running_requests=dconfig.max_running_requests)
    tokenizer = Tokenizer.from_pretrained(resolve_model_dir(pconfig.model.model_path))
    tag = uuid.uuid4().hex[:8]  # loopback backends are named per process

    def manager(node_id: str, role: str, control_endpoint: str) -> KVManager:
        # The two halves share one process, so neither can outlive the other: the leases
        # that keep a dead peer's pages from being reused guard nothing here. They are long,
        # so a prefill step longer than the cluster's lease (the decode half grants only
        # between steps of the one loop) does not fail the rooms it delays.
        return build_kv_manager(
            node_id,
            role,
            pconfig.transfer,
            runner.pool,
            control_endpoint=control_endpoint,
            instance_id=node.instance_id,
            backend_kind="loopback",
            backend_name=f"{node_id}-{tag}",
            lease_s=max(pconfig.transfer.lease_s, COLOCATED_LEASE_S),
        )

    pkv = manager(prefill_id, "prefill", node.endpoint(node.control_port))
    dkv = manager(decode_id, "decode", node.endpoint(0))
    psock, pendpoint = bind_request_socket(node)
    dsock, dendpoint = bind_request_socket(dataclasses.replace(node, request_port=0))
    events = (
        None
        if pconfig.disable_radix_cache
        else KVEventPublisher(
            prefill_id,
            node.instance_id,
            cache_pages(pconfig, runner.pool),
            node.endpoint(pconfig.kv_events_port),
        )
    )
    # One compiler and cache for both halves: a grammar compiles once per process.
    grammar = build_grammar(pconfig.node, pconfig.model, runner.spec.vocab_size, tokenizer)
    prefill = PrefillScheduler(
        pconfig,
        runner,
        kv=pkv,
        request_socket=psock,
        events=events,
        grammar=grammar,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    if prefill.tree is not None:  # the decode side may take the cache's unused pages
        runner.pool.allocator = ReclaimingAllocator(prefill.allocator, prefill.tree)  # type: ignore[assignment]
    decode = DecodeScheduler(
        dconfig,
        runner,
        dkv,
        dsock,
        tokenizer,
        lambda node_id: pkv.control_endpoint if node_id == prefill_id else None,
        prefill_endpoints=lambda: [pkv.control_endpoint],
        grammar=grammar,
        shares_pool_with_prefill=True,
    )

    def step() -> bool:
        did_prefill = prefill.step()
        did_decode = decode.step()
        return did_prefill or did_decode

    def health() -> dict:
        return {
            "kv_pages_held": prefill.stats.num_held_pages() + decode.stats.num_held_pages(),
            "free_pages": runner.pool.allocator.num_free_pages,
        }

    def fail_all() -> None:
        for side in (prefill, decode):
            side.fail_all(503, "the colocated node is shutting down (drain timeout)")

    process = NodeProcess(node, step, health)
    # Both halves name the prefill half's control endpoint (the one the process announces).
    halves = [
        ServedNode(
            prefill_id,
            "prefill",
            pendpoint,
            pkv.control_endpoint,
            pconfig.max_running_requests or 0,
            lambda: {"free_pages": runner.pool.allocator.num_free_pages},
            prefill.gateway_watch,
            kv_events_endpoint=events.endpoint if events is not None else "",
            num_cache_pages=cache_pages(pconfig, runner.pool),
            colocated_with=decode_id,
        ),
        ServedNode(
            decode_id,
            "decode",
            dendpoint,
            pkv.control_endpoint,
            decode.max_running_requests,
            decode.load,
            decode.gateway_watch,
            colocated_with=prefill_id,
        ),
    ]
    process.serve(
        runner,
        halves,
        backend="loopback",
        auth_token=pconfig.transfer.auth_token,
        drain=lambda: not prefill.states and decode.is_idle(),
        on_drain_timeout=fail_all,
        close=[pkv.close, dkv.close, *([events.close] if events is not None else [])],
        decode_request_endpoint=dendpoint,
        prefill_node_id=prefill_id,
        decode_node_id=decode_id,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
