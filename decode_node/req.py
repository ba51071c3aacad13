"""One request on the decode node: its lifecycle state machine and everything it holds.

    PREALLOC ──▶ TRANSFER ──▶ WAITING ──▶ RUNNING ──▶ FINISHED
                    │            ▲           │
                    │            └─RETRACTED◀┘      retract: KV to host; resume: KV back
                    └───────────────────────────────▶ FINISHED  (the first token ended it)
    every state above but FINISHED ──▶ FAILED         (abort, handshake or transfer failure)

PREALLOC   receiver created; waits for the handshake and for the KV budget
TRANSFER   destination pages allocated and sent to the prefill node; KV arriving
WAITING    KV and first token committed; waits for a slot in the running batch
RUNNING    decoded one token per iteration
RETRACTED  device pages freed, KV kept in host memory, output, sampler and grammar state kept
FINISHED / FAILED are terminal: nothing leaves them and they hold no pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from common import messages as msg
from common.grammar.backend import GrammarState, GrammarTicket
from common.node.scheduling import check_transition
from common.penalties import PenaltyState
from common.radix_node import TreeNode
from common.sampling_params import SamplingParams
from common.stop import StopChecker
from common.tokenizer import IncrementalDetokenizer
from transfer.kv_receiver import KVReceiver


class DecodeState(Enum):
    PREALLOC = "prealloc"
    TRANSFER = "transfer"
    WAITING = "waiting"
    RUNNING = "running"
    RETRACTED = "retracted"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (DecodeState.FINISHED, DecodeState.FAILED)


_TRANSITIONS: dict[DecodeState, frozenset[DecodeState]] = {
    DecodeState.PREALLOC: frozenset({DecodeState.TRANSFER, DecodeState.FAILED}),
    DecodeState.TRANSFER: frozenset(
        {DecodeState.WAITING, DecodeState.FINISHED, DecodeState.FAILED}
    ),
    DecodeState.WAITING: frozenset({DecodeState.RUNNING, DecodeState.FAILED}),
    DecodeState.RUNNING: frozenset(
        {DecodeState.RETRACTED, DecodeState.FINISHED, DecodeState.FAILED}
    ),
    DecodeState.RETRACTED: frozenset({DecodeState.WAITING, DecodeState.FAILED}),
    DecodeState.FINISHED: frozenset(),
    DecodeState.FAILED: frozenset(),
}


@dataclass(eq=False)
class DecodeReq:
    """What the decode node holds for one request. Hashable by identity."""

    generate: msg.GenerateReq
    sampling: SamplingParams
    stop: StopChecker
    # Tokens the request may still produce, counting the first: max_new_tokens clipped
    # so that prompt + output stays inside the context.
    max_new_tokens: int
    receiver: KVReceiver | None = None
    detokenizer: IncrementalDetokenizer | None = None  # only when there are stop strings
    generator: torch.Generator | None = None  # None: greedy
    seed: int = 0  # the request's seed (drawn when it gave none): draw i uses (seed, i)
    is_logprob: bool = False
    arrival: float = 0.0  # node clock
    # Wall-clock marks (common/stages.py): this node's, then the prefill node's with the KV;
    # they go to the gateway with the first token.
    marks: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int = 0  # prompt tokens the prefill node served from its radix cache
    state: DecodeState = DecodeState.PREALLOC
    # Device pages in order; they hold KV for the first kv_len tokens. With a prefix cache
    # the first num_prefix_pages are the cache's (locked at prefix_node), the rest are own.
    pages: list[int] = field(default_factory=list)
    num_prefix_pages: int = 0
    prefix_node: TreeNode | None = None
    # The pages another sample of its prompt held when r copied them (sample_groups.py):
    # a late write into one of them may have reached r's copy too.
    copied_from: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    last_token_at: float | None = None
    num_retractions: int = 0
    # While running: its decode slot (common.model.decode_slots: its page row and next
    # token on the device), held by the running batch.
    decode_slot: int | None = None
    # Structured output: the compile under way (from arrival), then the matcher, built from
    # the compiled grammar and the output tokens so far (the prefill node's first token on).
    grammar_ticket: GrammarTicket | None = None
    grammar: GrammarState | None = None
    # Penalties and min_tokens (common/penalties.py): None when it asks for none.
    penalty: PenaltyState | None = None

    @property
    def rid(self) -> str:
        return self.generate.rid

    @property
    def room(self) -> int:
        return self.generate.room

    @property
    def origin_input_ids(self) -> list[int]:
        """What the prefill node computed: the prompt, and a migrated request's output so
        far (its first output_ids are then the tokens after those)."""
        return [*self.generate.input_ids, *self.generate.output_ids]

    @property
    def num_input_tokens(self) -> int:
        return len(self.generate.input_ids) + len(self.generate.output_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """The client's prompt alone (usage counts a migrated request's tokens as output)."""
        return len(self.generate.input_ids)

    @property
    def num_resumed_tokens(self) -> int:
        """Output tokens the client had before this node pair took the request (migration)."""
        return len(self.generate.output_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def all_output_ids(self) -> list[int]:
        """Every output token of the request, from before a migration on."""
        return [*self.generate.output_ids, *self.output_ids]

    @property
    def own_pages(self) -> list[int]:
        """The pages this request alone holds (after its cached prefix)."""
        return self.pages[self.num_prefix_pages :]

    @property
    def priority(self) -> int | None:
        return self.generate.priority

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is in pages: the prompt plus every output token but the last."""
        return self.num_input_tokens + max(len(self.output_ids) - 1, 0)

    @property
    def seq_len(self) -> int:
        """Tokens in the sequence; the next step feeds the last one at position seq_len - 1."""
        return self.num_input_tokens + len(self.output_ids)

    def advance(self, new: DecodeState) -> None:
        """The one place a request changes state; illegal moves raise IllegalTransition."""
        check_transition(_TRANSITIONS, self.rid, self.state, new)
        self.state = new
