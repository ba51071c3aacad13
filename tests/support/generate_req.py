"""A GenerateReq for unit tests that build one by hand: the fields a test does not care
about filled in, any of them overridable."""

from __future__ import annotations

from typing import Any

from common import messages as msg


def generate_req(**fields: Any) -> msg.GenerateReq:
    defaults: dict[str, Any] = dict(
        rid="r",
        room=1,
        input_ids=[1, 2, 3],
        sampling={},
        priority=None,
        routing_key=None,
        prefill_node_id="p",
        decode_node_id="d",
        reply_endpoint="tcp://127.0.0.1:1",
        arrival_time=0.0,
        return_logprob=False,
    )
    return msg.GenerateReq(**{**defaults, **fields})
