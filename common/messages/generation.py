"""Request and result messages between the gateway and the nodes."""

from dataclasses import dataclass, field
from typing import Any, ClassVar

from common.messages.base import Message


@dataclass(frozen=True, slots=True)
class GenerateReq(Message):
    """Gateway -> prefill and decode: one request, its room and the chosen (P, D) pair."""

    TAG: ClassVar[str] = "generate_req"
    rid: str
    room: int
    input_ids: list[int]
    sampling: dict[str, Any]
    priority: int | None
    routing_key: str | None
    prefill_node_id: str
    decode_node_id: str
    reply_endpoint: str
    arrival_time: float
    return_logprob: bool
    # The instance id of the gateway that owns the request: nodes abort it when that
    # gateway is gone (common/node/gateway_watch.py).
    gateway_id: str = ""
    # Prefix-cache isolation: cached pages are shared only among requests of one salt.
    cache_salt: str | None = None
    # A migrated request (the gateway resends it to another pair mid-stream): the output
    # tokens the client already has. The nodes compute the KV of input_ids + output_ids,
    # and go on from output token len(output_ids): max_new_tokens, the grammar's matcher,
    # seeded draws and usage count these tokens as output.
    output_ids: list[int] = field(default_factory=list)
    # The logprob of each prompt token after the first (and the top sampling["top_logprobs"]
    # alternatives at each position): the prefill node computes the whole prompt, cached or
    # not, and the decode node sends them on in PromptLogprobs (completions' echo).
    return_prompt_logprobs: bool = False
    # The samples of one prompt (n > 1, best_of) share a group id and are sent to one pair
    # (empty: no group). The prefill node computes the prompt once: the others sample their
    # first token from the first one's last logits when the decode node copies that one's
    # last page instead of receiving it (prefill_node/sample_groups.py,
    # decode_node/sample_groups.py).
    sample_group: str = ""
    num_group_samples: int = 1


@dataclass(frozen=True, slots=True)
class TokenChunk(Message):
    """Decode -> gateway: new output tokens of a request (+ logprobs when asked for)."""

    TAG: ClassVar[str] = "token_chunk"
    rid: str
    token_ids: list[int]
    logprobs: list[float] | None
    # Per new token, its (token_id, logprob) pairs, best first.
    top_logprobs: list[list[Any]] | None
    # The first chunk only: the nodes' wall-clock marks (common/stages.py) for the gateway.
    marks: dict[str, float] | None = None


@dataclass(frozen=True, slots=True)
class PromptLogprobs(Message):
    """Decode -> gateway, before the request's first TokenChunk (or its ReqFinished): the
    logprob of each prompt token after the first, as the prefill node computed them."""

    TAG: ClassVar[str] = "prompt_logprobs"
    rid: str
    logprobs: list[float]
    # Per position, its (token_id, logprob) pairs, best first.
    top_logprobs: list[list[Any]]


@dataclass(frozen=True, slots=True)
class ReqFinished(Message):
    """Decode -> gateway: the request ended normally; usage counts for the response."""

    TAG: ClassVar[str] = "req_finished"
    rid: str
    finish_reason: str
    # The stop token id or stop string that ended the request, if any.
    matched_stop: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class ReqFailed(Message):
    """Decode or prefill -> gateway: the request failed; ``status`` is the HTTP status to return."""

    TAG: ClassVar[str] = "req_failed"
    rid: str
    status: int
    error: str
    # The failure is the nodes' (a lost peer, a failed transfer or handshake, a drain past
    # its timeout), not the request's: the gateway may migrate it to another pair.
    retryable: bool = False


# What a node sends a gateway about a request; the only messages a ReplyBatch carries.
GatewayReply = TokenChunk | PromptLogprobs | ReqFinished | ReqFailed


@dataclass(frozen=True, slots=True)
class ReplyBatch(Message):
    """Decode -> gateway: the replies of one decode step to one gateway, in the order sent.

    One frame instead of one per request per step. On the wire each entry is its own
    ``[tag, {field: value}]`` inside this message's msgpack (not bytes encoded twice); an
    entry must be one of the GatewayReply types, so a ReplyBatch never holds another.
    The gateway's receive (common/ipc.recv_messages) hands the entries on one by one as if
    they had come alone; a malformed entry is dropped there alone and counted.
    """

    TAG: ClassVar[str] = "reply_batch"
    messages: list[GatewayReply]
