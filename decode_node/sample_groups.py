"""The samples of one prompt (n > 1, best_of) on the decode node: the prompt moves once.

A sample whose sample group (GenerateReq.sample_group) has a request here holding the same
prompt's KV on the device (arrived: waiting or running) takes it from that request instead
of receiving it: the whole pages from the prefix cache, as any prompt (locked, shared), and
the rest (the page of its last token, partly filled or not) copied on the device into its
own pages. It then tells the prefill node it holds every page of its room
(TransferRequest.num_held_pages), and the prefill node sends the first token alone, sampled
from the first sample's logits (prefill_node/sample_groups.py). A sample waits in the
prealloc queue while another of its group receives the prompt's KV, so that it finds it
here; not for one that copies it too (the samples then follow one another).

The copy is made when the sample is preallocated, while that request holds the pages. Its
positions past the prompt may hold that request's first output KV: this sample's own
decode writes them before reading them (attention reads the first kv_len positions).
"""

from __future__ import annotations

from collections.abc import Iterable

from decode_node.req import DecodeReq, DecodeState

_HOLDS_KV = (DecodeState.WAITING, DecodeState.RUNNING)


def is_group_mate(r: DecodeReq, d: DecodeReq) -> bool:
    """Whether d is another sample of r's prompt (same group, prompt and cache salt)."""
    g, other = r.generate, d.generate
    return (
        bool(g.sample_group)
        and other.sample_group == g.sample_group
        and d is not r
        and not g.output_ids
        and not other.output_ids
        and other.cache_salt == g.cache_salt
        and other.input_ids == g.input_ids
    )


def find_donor(r: DecodeReq, reqs: Iterable[DecodeReq]) -> DecodeReq | None:
    """A request of r's sample group whose KV of the same prompt is on the device here."""
    if not r.generate.sample_group:
        return None
    return next((d for d in reqs if d.state in _HOLDS_KV and is_group_mate(r, d)), None)
