"""The bootstrap and inflight queues around the prefill scheduler (request states: req_state.py).

GenerateReq ─▶ bootstrap_queue ─▶ waiting_queue ─▶ (chunked) prefill ─▶ inflight_queue ─▶ done
               sender Bootstrapping  sorted by the     KV sent after      until the sender
               until the decode      policy, admitted   every chunk        reports Success
               node's pages arrive   by PrefillAdder
                      │                 ▲
                      └▶ grammar_queue ─┘  a grammar still compiling (SGLang's grammar queue)
"""

from __future__ import annotations

from common.grammar.backend import GrammarBackend, GrammarError, poll_pending
from prefill_node.req_state import PrefillReq
from transfer.kv_poll import KVPoll


class _Queue:
    """Requests in arrival order."""

    def __init__(self) -> None:
        self.queue: list[PrefillReq] = []

    def add(self, r: PrefillReq) -> None:
        self.queue.append(r)

    def remove(self, r: PrefillReq) -> bool:
        if r in self.queue:
            self.queue.remove(r)
            return True
        return False

    def __len__(self) -> int:
        return len(self.queue)


class _SenderQueue(_Queue):
    """Requests held until their KVSender leaves the states the queue waits on."""

    waits_on: tuple[KVPoll, ...] = ()

    def _pop(self) -> tuple[list[PrefillReq], list[PrefillReq]]:
        """(moved on, failed), both in arrival order; the rest stay."""
        moved: list[PrefillReq] = []
        failed: list[PrefillReq] = []
        keep: list[PrefillReq] = []
        for s in self.queue:
            state = s.sender.poll()
            if state in self.waits_on:
                keep.append(s)
            else:
                (failed if state is KVPoll.Failed else moved).append(s)
        self.queue = keep
        return moved, failed


class BootstrapQueue(_SenderQueue):
    """Requests whose decode side has not yet sent destination pages for their room."""

    waits_on = (KVPoll.Bootstrapping,)

    def pop_bootstrapped(self) -> tuple[list[PrefillReq], list[PrefillReq]]:
        """(ready for the waiting queue, failed)."""
        return self._pop()


class InflightQueue(_SenderQueue):
    """Requests whose KV is fully computed and sent, until their transfer ends."""

    waits_on = (KVPoll.WaitingForInput, KVPoll.Transferring)

    def pop_done(self) -> tuple[list[PrefillReq], list[PrefillReq]]:
        """(transferred, failed)."""
        return self._pop()


class GrammarQueue(_Queue):
    """Bootstrapped requests whose grammar is still compiling on the backend's threads."""

    def pop_ready(
        self, backend: GrammarBackend
    ) -> tuple[list[PrefillReq], list[tuple[PrefillReq, GrammarError]]]:
        """(compiled, in arrival order; failed with why); the rest stay."""
        ready: list[PrefillReq] = []
        failed: list[tuple[PrefillReq, GrammarError]] = []
        keep: list[PrefillReq] = []
        for r in self.queue:
            outcome = poll_grammar(r, backend)
            if isinstance(outcome, GrammarError):
                failed.append((r, outcome))
            elif outcome:
                ready.append(r)
            else:
                keep.append(r)
        self.queue = keep
        return ready, failed


def poll_grammar(r: PrefillReq, backend: GrammarBackend | None) -> bool | GrammarError:
    """Whether r's grammar is ready (True when it has none), or why it cannot be."""
    if r.grammar is not None:
        return True
    polled = poll_pending(backend, r.grammar_ticket)
    if isinstance(polled, (bool, GrammarError)):
        return polled
    r.grammar = polled
    return True
