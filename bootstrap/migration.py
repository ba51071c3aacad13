"""Mid-stream migration: when a request's node pair fails, whether it moves, and its new start.

The gateway knows a request's prompt and every token it has streamed. A failure on the
nodes' side (a node the gateway lost, or a ReqFailed the node marked ``retryable``: a
failed transfer or handshake, a lost peer, a drain past its timeout, a full queue) moves
the request to another pair with ``output_ids`` = the tokens so far; the new prefill node
computes the KV of prompt + those tokens and samples the next one, and the client's
stream goes on. Pure decisions here; ``bootstrap/generation.py`` runs them.

Exactness: greedy tokens depend on the sequence alone; a seeded draw depends on (seed,
output position) alone (``common/sampler.py``'s position_seed); a grammar's matcher is
rebuilt from the tokens; max_new_tokens and usage count the earlier tokens as output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bootstrap.dispatcher import InflightReq
from common import messages as msg
from common.sampling_params import SamplingParams
from common.stop import FinishReason, StopChecker

# While no pair can take a migrating request (nodes restarting, none healthy), it tries
# again this often, until --migration-timeout (and within its --request-timeout).
MIGRATION_RETRY_S = 0.25

# (output token ids so far, node ids to avoid) -> the request dispatched to a new pair;
# raises bootstrap.errors.APIError (503: no pair now).
Redispatch = Callable[[list[int], frozenset[str]], InflightReq]


def migration_reason(req: InflightReq, failed: msg.ReqFailed) -> str | None:
    """Why ``req`` may move to another pair after ``failed`` (a metric label), or None when
    the failure is the request's own (a bad request, an abort, a grammar that fails)."""
    if req.lost is not None:
        return req.lost
    return "node_failure" if failed.retryable else None


@dataclass
class OutputSoFar:
    """What the gateway has of a request's output, and whether it is already complete
    (its pair failed after sending the last token but before saying it finished)."""

    sampling: SamplingParams
    stop: StopChecker
    eos_token_ids: frozenset[int]
    num_prompt_tokens: int
    context_length: int
    token_ids: list[int]

    @classmethod
    def start(
        cls,
        sampling: SamplingParams,
        eos_token_ids: Iterable[int],
        num_prompt_tokens: int,
        context_length: int,
    ) -> OutputSoFar:
        eos = frozenset(eos_token_ids)
        return cls(sampling, StopChecker(sampling, eos), eos, num_prompt_tokens, context_length, [])

    def add(self, token_ids: Iterable[int]) -> None:
        self.token_ids.extend(token_ids)

    def finished(self) -> FinishReason | None:
        """The finish the nodes would have sent for the tokens so far, if any: migrating
        such a request would continue past its end."""
        if not self.token_ids:
            return None
        last, num = self.token_ids[-1], len(self.token_ids)
        finish = self.stop.check_token(last, num)
        if finish is None and self.sampling.grammar is not None and last in self.eos_token_ids:
            finish = FinishReason.stop(last)  # a grammar ends at eos, ignore_eos or not
        if finish is None and self.num_prompt_tokens + num >= self.context_length:
            finish = FinishReason.length()
        return finish
