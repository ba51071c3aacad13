"""Whether a decode request's grammar lets it commit its first token (no I/O).

A request's grammar compiles off the loop while its KV travels; when the KV is in place
the request goes on only once its matcher is built (rebuilt from the tokens so far: a
migrated request's output before this pair; none otherwise). A grammar that failed to
compile, or timed out, fails the request, even before its KV arrives.
"""

from __future__ import annotations

from collections.abc import Iterable

from common.grammar.backend import GrammarBackend, GrammarError, GrammarState, poll_pending
from decode_node.req import DecodeReq


def poll_grammar(backend: GrammarBackend | None, r: DecodeReq) -> bool | GrammarError:
    """True: r has no grammar, or its matcher is built now (``r.grammar``); False: still
    compiling; a GrammarError: it failed."""
    if r.grammar is not None:
        return True
    polled = poll_pending(backend, r.grammar_ticket)
    if isinstance(polled, (bool, GrammarError)):
        return polled
    r.grammar = GrammarState(polled, r.all_output_ids)
    return True


def failed_grammars(
    backend: GrammarBackend | None, reqs: Iterable[DecodeReq]
) -> list[tuple[DecodeReq, GrammarError]]:
    """The requests (still without KV) whose grammar failed to compile or timed out."""
    if backend is None:
        return []
    failed = []
    for r in reqs:
        if r.grammar_ticket is not None and r.grammar is None:
            try:
                backend.poll(r.grammar_ticket)
            except GrammarError as exc:
                failed.append((r, exc))
    return failed
