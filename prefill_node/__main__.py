"""`python -m prefill_node` (or `pdserve prefill`): one prefill node process."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from common.config import ConfigError, PrefillConfig
from common.flags import add_prefill_args
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
from prefill_node.kv_events import KVEventPublisher
from prefill_node.prefill_cache import cache_pages
from prefill_node.scheduler import PrefillScheduler
from transfer.node_setup import build_kv_manager


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve prefill", description=__doc__)
    add_prefill_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        config = PrefillConfig.from_args(ns)
    except ConfigError as exc:
        print(f"pdserve prefill: error: {exc}", file=sys.stderr)
        return 2
    node = start_node("prefill", config.node, config.host, config.port, config.transfer.auth_token)
    runner = build_runner(config.model, decodes=False)
    kv = build_kv_manager(
        node.node_id,
        "prefill",
        config.transfer,
        runner.pool,
        control_endpoint=node.endpoint(node.control_port),
        instance_id=node.instance_id,
        device=config.model.device,
    )
    request_socket, request_endpoint = bind_request_socket(node)
    events = (
        None
        if config.disable_radix_cache
        else KVEventPublisher(
            node.node_id,
            node.instance_id,
            cache_pages(config, runner.pool),
            node.endpoint(config.kv_events_port),
        )
    )
    tokenizer = Tokenizer.from_pretrained(resolve_model_dir(config.model.model_path))
    grammar = build_grammar(config.node, config.model, runner.spec.vocab_size, tokenizer)
    scheduler = PrefillScheduler(
        config,
        runner,
        kv,
        request_socket,
        events=events,
        grammar=grammar,
        eos_token_ids=tokenizer.eos_token_ids,
    )

    def load() -> dict[str, Any]:
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
        node,
        scheduler.step,
        lambda: {"kv_pages_held": scheduler.stats.num_held_pages(), **load()},
        check=scheduler.check_integrity,
    )
    served = ServedNode(
        node.node_id,
        "prefill",
        request_endpoint,
        kv.control_endpoint,
        config.max_running_requests or 0,
        load,
        scheduler.gateway_watch,
        kv_events_endpoint=events.endpoint if events is not None else "",
        num_cache_pages=cache_pages(config, runner.pool),
    )
    process.serve(
        runner,
        [served],
        backend=config.transfer.backend,
        auth_token=config.transfer.auth_token,
        drain=lambda: not scheduler.states,
        on_drain_timeout=lambda: scheduler.fail_all(
            503, "the prefill node is shutting down (drain timeout)"
        ),
        close=[kv.close, *([events.close] if events is not None else [])],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
