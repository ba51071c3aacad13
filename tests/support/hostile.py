"""Hostile inputs for a real cluster: API bodies (hypothesis strategies) and internal zmq frames.

A body starts valid (short, so a generation costs little) and gets one to three fields
replaced by values an attacker would try: integers past int64 and uint64, wrong types,
lone surrogates, huge or empty strings, deep nesting, NaN. Frames for the internal sockets
are garbage, truncated messages, unknown tags, wrong field types, deep nesting, several
frames, and an oversized one.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgpack
from hypothesis import strategies as st

from common import messages as msg

MAX_TOKENS = 4  # of a valid body: every example that is served costs little

_INTS = st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30, -(10**30)])
_TEXT = st.one_of(
    st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "\u202e", "x" * 20000, "😀" * 50]),
    st.text(max_size=40),
)
_ODD = st.one_of(
    _INTS,
    _TEXT,
    st.sampled_from([None, True, False, [], {}, [None], {"": None}, 1.5, -0.0, math.inf, math.nan]),
    st.lists(_INTS, max_size=3),
    st.dictionaries(st.text(max_size=5), _INTS, max_size=3),
    st.just(json.loads("[" * 200 + "]" * 200)),  # deep nesting
)
_SAMPLING = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "n",
    "priority",
    "routing_key",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "user",
    "stream",
    "stream_options",
    "model",
    "ignore_eos",
]
CHAT_FIELDS = [
    *_SAMPLING,
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "messages.0.content",
    "messages.0.role",
    "messages.0",
]
COMPLETION_FIELDS = [*_SAMPLING, "prompt", "max_tokens", "logprobs", "echo", "best_of", "suffix"]
GENERATE_FIELDS = [
    "text",
    "input_ids",
    "sampling_params",
    "sampling_params.max_new_tokens",
    "sampling_params.temperature",
    "sampling_params.top_k",
    "sampling_params.seed",
    "sampling_params.stop",
    "stream",
    "return_logprob",
    "top_logprobs_num",
    "priority",
    "routing_key",
]


def valid_body(route: str, text: str) -> dict[str, Any]:
    if route == "/v1/chat/completions":
        return {
            "model": "default",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
    if route == "/v1/completions":
        return {"model": "default", "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0}
    return {"text": text, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}


def _set(body: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node: Any = body
    try:
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last)] = value
        elif isinstance(node, dict):
            node[last] = value
    except (IndexError, KeyError, ValueError, TypeError, AttributeError):
        pass  # an earlier change made this path something else


def _bound_cost(body: dict[str, Any], route: str) -> None:
    """No example may buy a long generation: an unset length gets the short one back."""
    if route == "/v1/chat/completions":
        if body.get("max_completion_tokens") is None and body.get("max_tokens") is None:
            body["max_tokens"] = MAX_TOKENS  # unset means the rest of the context
    elif route == "/generate":
        params = body.get("sampling_params")
        if isinstance(params, dict) and "max_new_tokens" not in params:
            params["max_new_tokens"] = MAX_TOKENS  # unset means 128


@st.composite
def hostile_body(draw: st.DrawFn, route: str) -> dict[str, Any]:
    fields = {
        "/v1/chat/completions": CHAT_FIELDS,
        "/v1/completions": COMPLETION_FIELDS,
        "/generate": GENERATE_FIELDS,
    }[route]
    body = valid_body(route, draw(st.sampled_from(["Hi", "Name a colour.", "1 2 3"])))
    for path in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique=True)):
        _set(body, path, draw(_ODD))
    _bound_cost(body, route)
    return body


def body_bytes(body: dict[str, Any]) -> bytes:
    """JSON as a careless client would send it: NaN and lone surrogates kept."""
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


# ---- internal frames ----------------------------------------------------------------------


def bad_frames() -> dict[str, list[bytes]]:
    """Frames that are not valid messages, by kind (each sent as its own single frame)."""
    abort = msg.encode(msg.AbortReq(node_id="fuzz", room=1, rid="fuzz", reason="fuzz"))
    return {
        "garbage": [b"", b"\xc1", b"\xff" * 64, b"not msgpack at all"],
        "truncated": [abort[:n] for n in (1, 2, len(abort) // 2, len(abort) - 1)],
        "unknown_tag": [msgpack.packb(["no_such_message", {}])],
        "wrong_types": [
            msgpack.packb(["abort_req", {"node_id": 5, "room": "x", "rid": None, "reason": []}]),
            msgpack.packb(
                [
                    "abort_req",
                    {"node_id": "n", "room": 2**64 - 1, "rid": "r", "reason": "r", "extra": 1},
                ]
            ),
            msgpack.packb(["abort_req", []]),
            msgpack.packb({"abort_req": {}}),
        ],
        "deep": [b"\x91" * 100_000 + b"\xc0"],  # 100k nested one-element arrays
        "length_lies": [b"\xdb\xff\xff\xff\xff", b"\xc6\x7f\xff\xff\xff" + b"x" * 10],
        "large": [b"\x92\xa9abort_req" + b"\xc4" + b"\xff" + b"x" * 255 + b"y" * (1 << 20)],
    }
