"""One request on the prefill node: its lifecycle state machine and everything it holds.

    BOOTSTRAP ──▶ WAITING ──▶ PREFILLING ──▶ TRANSFERRING ──▶ FINISHED
        │            ▲  ▲             │
        └▶ GRAMMAR ──┘  └─────────────┘   deferred: pages ran short, its own pages freed
    every state above but FINISHED ──▶ FAILED   (abort, bootstrap, grammar or transfer failure)

BOOTSTRAP     in the bootstrap queue: its KVSender waits for the decode node's pages
GRAMMAR       in the grammar queue: bootstrapped, its grammar still compiling off the loop;
              holds no page
WAITING       in the waiting queue: sorted by the policy, admitted by the PrefillAdder;
              holds no page
PREFILLING    admitted: in this round's batch, and between rounds the one chunked
              request (scheduler.chunked); holds the pages of what it computed
TRANSFERRING  in the inflight queue: every chunk computed and sent, until the sender
              reports Success or Failed
FINISHED / FAILED are terminal: nothing leaves them and they hold no pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import xgrammar as xgr

from common import messages as msg
from common.grammar.backend import GrammarTicket
from common.node.scheduling import check_transition
from common.radix_node import TreeNode
from common.sampling_params import SamplingParams
from prefill_node.request import Req
from transfer.kv_sender import KVSender


class PrefillState(Enum):
    BOOTSTRAP = "bootstrap"
    GRAMMAR = "grammar"
    WAITING = "waiting"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    FINISHED = "finished"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in (PrefillState.FINISHED, PrefillState.FAILED)


_TRANSITIONS: dict[PrefillState, frozenset[PrefillState]] = {
    PrefillState.BOOTSTRAP: frozenset(
        {PrefillState.GRAMMAR, PrefillState.WAITING, PrefillState.FAILED}
    ),
    PrefillState.GRAMMAR: frozenset({PrefillState.WAITING, PrefillState.FAILED}),
    PrefillState.WAITING: frozenset({PrefillState.PREFILLING, PrefillState.FAILED}),
    PrefillState.PREFILLING: frozenset(
        {PrefillState.WAITING, PrefillState.TRANSFERRING, PrefillState.FAILED}
    ),
    PrefillState.TRANSFERRING: frozenset({PrefillState.FINISHED, PrefillState.FAILED}),
    PrefillState.FINISHED: frozenset(),
    PrefillState.FAILED: frozenset(),
}


@dataclass(eq=False)
class PrefillReq:
    """What the prefill node holds for one request besides the policy's Req.

    Hashable by identity.
    """

    req: Req
    generate: msg.GenerateReq
    sampling: SamplingParams
    sender: KVSender
    state: PrefillState = PrefillState.BOOTSTRAP
    # Pages for tokens [0, num_computed): the first num_prefix_pages are the radix cache's
    # (locked through locked_node); the rest were allocated for this request.
    pages: list[int] = field(default_factory=list)
    num_prefix_pages: int = 0
    num_computed: int = 0
    num_cached_tokens: int = 0
    locked_node: TreeNode | None = None
    # Own pages whose tokens another request cached first; freed when this request ends.
    duplicate_pages: list[int] = field(default_factory=list)
    # Wall-clock marks (common/stages.py), sent on to the decode node with the KV.
    marks: dict[str, float] = field(default_factory=dict)
    # Structured output: the compile under way, then its result (the first token is
    # sampled under it).
    grammar_ticket: GrammarTicket | None = None
    grammar: xgr.CompiledGrammar | None = None
    # GenerateReq.return_prompt_logprobs: what the chunks computed so far
    # (prefill_node/prompt_logprobs.py)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[Any]] = field(default_factory=list)
    # Computed nothing and holds no page: its decode node holds the prompt's KV (another
    # sample of it there) and its first token came from that sample's logits
    # (prefill_node/sample_groups.py).
    is_group_sample: bool = False

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def room(self) -> int:
        return self.req.room

    @property
    def own_pages(self) -> list[int]:
        return self.pages[self.num_prefix_pages :]

    def advance(self, new: PrefillState) -> None:
        """The one place a request changes state; illegal moves raise IllegalTransition."""
        check_transition(_TRANSITIONS, self.rid, self.state, new)
        self.state = new
