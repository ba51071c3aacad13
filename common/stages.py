"""Where a request's time to first token goes: marks stamped along its path, and its stages.

Each process stamps wall-clock marks (``time.time()``) where a request crosses one of its
boundaries; the marks travel with the request (prefill's in TransferDone to the decode
node, decode's and prefill's in the first TokenChunk to the gateway), and the gateway
turns them into stages. The critical path from the request's first byte at the gateway
to the first byte of its response is cut into CHAIN stages, each from one mark to the
next, so they add up to the whole (the end-to-end TTFT) by construction; PARALLEL
stages run beside the chain (the decode node preallocates while prefill waits for it).

Marks from different machines differ by their clocks' skew: a stage between two
processes (``prefill_bootstrap_queue``, ``kv_transfer``, ``decode_first_token``) absorbs
it; a negative one (skew larger than the stage) is recorded as 0.
"""

from __future__ import annotations

import math
from typing import Final

# Marks, in path order.
RECEIVED: Final = "received"  # gateway: the request's headers arrived (ASGI middleware)
PARSED: Final = "parsed"  # gateway: the body is read and validated (the route handler runs)
TOKENIZED: Final = "tokenized"  # gateway: chat template and tokenizer done
DISPATCHED: Final = "dispatched"  # gateway: routed; GenerateReq sent to both nodes
PREFILL_RECEIVED: Final = "prefill_received"  # prefill: GenerateReq taken off its socket
PREFILL_BOOTSTRAPPED: Final = "prefill_bootstrapped"  # prefill: decode's pages known
PREFILL_SCHEDULED: Final = "prefill_scheduled"  # prefill: its first chunk admitted
PREFILL_COMPUTED: Final = "prefill_computed"  # prefill: last chunk computed, token sampled
DECODE_RECEIVED: Final = "decode_received"  # decode: GenerateReq taken off its socket
DECODE_PREALLOCATED: Final = "decode_preallocated"  # decode: pages allocated, sent to prefill
DECODE_TRANSFERRED: Final = "decode_transferred"  # decode: every page and TransferDone arrived
FIRST_TOKEN: Final = "first_token"  # gateway: the first TokenChunk arrived
FIRST_BYTE: Final = "first_byte"  # gateway: the first response bytes handed to the server

# (stage, from mark, to mark): the critical path, contiguous from RECEIVED to FIRST_BYTE.
CHAIN: Final = (
    ("receive", RECEIVED, PARSED),
    ("tokenize", PARSED, TOKENIZED),
    ("route", TOKENIZED, DISPATCHED),
    ("prefill_bootstrap_queue", DISPATCHED, PREFILL_BOOTSTRAPPED),
    ("prefill_waiting_queue", PREFILL_BOOTSTRAPPED, PREFILL_SCHEDULED),
    ("prefill_compute", PREFILL_SCHEDULED, PREFILL_COMPUTED),
    ("kv_transfer", PREFILL_COMPUTED, DECODE_TRANSFERRED),
    ("decode_first_token", DECODE_TRANSFERRED, FIRST_TOKEN),
    ("first_byte", FIRST_TOKEN, FIRST_BYTE),
)
# Beside the chain: on the decode node while the prefill node bootstraps and computes.
PARALLEL: Final = (
    ("decode_prealloc_queue", DECODE_RECEIVED, DECODE_PREALLOCATED),
    ("decode_transfer_queue", DECODE_PREALLOCATED, DECODE_TRANSFERRED),
)
STAGES: Final = tuple(name for name, _, _ in CHAIN + PARALLEL)
# What each node records itself, from its own marks: the same stage names, each seen from
# the node (its bootstrap queue starts when it took the request, not when it was sent).
PREFILL_STAGES: Final = (
    ("prefill_bootstrap_queue", "prefill_received", "prefill_bootstrapped"),
    ("prefill_waiting_queue", "prefill_bootstrapped", "prefill_scheduled"),
    ("prefill_compute", "prefill_scheduled", "prefill_computed"),
)
DECODE_STAGES: Final = PARALLEL

# Marks each node stamps and forwards; the gateway's own never leave it.
PREFILL_MARKS: Final = (PREFILL_RECEIVED, PREFILL_BOOTSTRAPPED, PREFILL_SCHEDULED, PREFILL_COMPUTED)
DECODE_MARKS: Final = (DECODE_RECEIVED, DECODE_PREALLOCATED, DECODE_TRANSFERRED)
NODE_MARKS: Final = PREFILL_MARKS + DECODE_MARKS
# Bounds a forwarded mark must respect to be used (a peer's message is not trusted).
MAX_MARKS: Final = 16


def stage_seconds(
    marks: dict[str, float], stages: tuple[tuple[str, str, str], ...] = CHAIN + PARALLEL
) -> dict[str, float]:
    """Each stage whose two marks are present: its duration in seconds, at least 0."""
    out = {}
    for name, start, end in stages:
        if start in marks and end in marks:
            out[name] = max(0.0, marks[end] - marks[start])
    return out


def forwarded(marks: dict[str, float] | None, allowed: tuple[str, ...]) -> dict[str, float]:
    """The marks of ``allowed`` names from a peer's message; anything else is dropped."""
    if not marks or len(marks) > MAX_MARKS:
        return {}
    return {
        k: float(v)
        for k, v in marks.items()
        if k in allowed and isinstance(v, (int, float)) and math.isfinite(v)
    }
