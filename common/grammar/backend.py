"""Grammar compilation off the node loop (xgrammar): a cache keyed by the grammar, worker threads.

A node submits a request's grammar when the request arrives and polls its ticket from the
loop: the compile runs on a worker thread (xgrammar's compiler releases the GIL), so the
loop goes on serving other requests meanwhile. Compiled grammars are cached by (kind,
text): a second request with the same schema reuses the first one's compile, or waits on
the same compile if it is still running. A grammar that does not compile fails its
request alone (400); one that is still compiling at its deadline fails it with 500, and
the compile is kept for the next request with the same grammar.
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from common import metrics
from common.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GRAMMAR_CACHE_ENTRIES = 1024  # compiled grammars kept (LRU); xgrammar's own cache is bounded too
XGRAMMAR_CACHE_BYTES = 512 * 1024 * 1024


class GrammarError(Exception):
    """A request's grammar cannot be used; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class GrammarTicket:
    """One request's wait for its compiled grammar."""

    kind: str
    future: Future[xgr.CompiledGrammar]
    deadline: float


_XGRAMMAR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its '[hh:mm:ss] /project/cpp/file.cc:123: ' prefix."""
    lines = _XGRAMMAR_PREFIX.sub("", str(exc).strip()).splitlines()
    return lines[0] if lines else type(exc).__name__


class GrammarBackend:
    """The node's grammar compiler: tickets per request, a shared compile cache."""

    def __init__(
        self,
        info: xgr.TokenizerInfo,
        *,
        timeout_s: float = 30.0,
        max_workers: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.info = info
        self.timeout_s = timeout_s
        self.clock = clock
        self._compiler = xgr.GrammarCompiler(
            self.info, max_threads=1, cache_limit_bytes=XGRAMMAR_CACHE_BYTES
        )
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[xgr.CompiledGrammar]] = OrderedDict()

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int, **kwargs: Any) -> GrammarBackend:
        """A backend for a model's tokenizer. The model's vocabulary can be larger than the
        tokenizer's (padding rows): the bitmask covers every logit, and ids past the
        tokenizer's are never allowed. The grammar's stop tokens are the tokenizer's eos."""
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer.hf_tokenizer,
            vocab_size=vocab_size,
            stop_token_ids=sorted(tokenizer.eos_token_ids) or None,
        )
        return cls(info, **kwargs)

    def submit(self, kind: str, text: str) -> GrammarTicket:
        """Start (or join) the compile of a grammar; the loop polls the ticket."""
        key = (kind, text)
        future = self._cache.get(key)
        if future is not None:  # compiled, compiling, or known not to compile
            self._cache.move_to_end(key)
            metrics.GRAMMAR_CACHE_TOTAL.labels(result="hit", **metrics.role_labels()).inc()
        else:
            metrics.GRAMMAR_CACHE_TOTAL.labels(result="miss", **metrics.role_labels()).inc()
            future = self._pool.submit(self._compile, kind, text)
            self._cache[key] = future
            while len(self._cache) > GRAMMAR_CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return GrammarTicket(kind, future, self.clock() + self.timeout_s)

    def poll(self, ticket: GrammarTicket) -> xgr.CompiledGrammar | None:
        """The compiled grammar once ready, None while compiling; raises GrammarError."""
        if not ticket.future.done():
            if self.clock() >= ticket.deadline:
                raise GrammarError(
                    500,
                    f"compiling the {ticket.kind} grammar took over {self.timeout_s:g} s "
                    "(--grammar-compile-timeout)",
                )
            return None
        exc = ticket.future.exception()
        if exc is not None:
            raise GrammarError(400, f"invalid {ticket.kind}: {clean_error(exc)}")
        return ticket.future.result()

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        compiler = self._compiler
        if kind == "json_schema":
            # Compact separators: with any whitespace allowed a small model can emit blank
            # lines until max_tokens and never close the object.
            compiled = compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        elif kind == "regex":
            compiled = compiler.compile_regex(text)
        elif kind == "ebnf":
            compiled = compiler.compile_grammar(text)
        elif kind == "structural_tag":
            compiled = compiler.compile_structural_tag(text)
        else:
            raise ValueError(f"unknown grammar kind {kind!r}")
        metrics.GRAMMAR_COMPILE_SECONDS.labels(**metrics.role_labels()).observe(
            time.perf_counter() - start
        )
        return compiled

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def poll_pending(
    backend: GrammarBackend | None, ticket: GrammarTicket | None
) -> xgr.CompiledGrammar | bool | GrammarError:
    """A request's grammar ticket polled from a node's loop: True when there is none to
    wait for, False while it compiles, the compiled grammar once ready, or the error it
    failed with (a request fails with it alone)."""
    if ticket is None:
        return True
    assert backend is not None, "a grammar ticket comes from a backend"
    try:
        compiled = backend.poll(ticket)
    except GrammarError as exc:
        return exc
    return False if compiled is None else compiled


class GrammarState:
    """One request's position in its grammar: the xgrammar matcher and the tokens it took."""

    def __init__(self, compiled: xgr.CompiledGrammar, tokens: Sequence[int] = ()) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0
        for token in tokens:
            if not self.accept(token):
                raise GrammarError(
                    500,
                    f"output token {token} (#{self.num_accepted}) does not match the grammar "
                    "on this node: its nodes disagree on the grammar or the tokenizer",
                )

    def accept(self, token: int) -> bool:
        """Advance past `token`; False (state unchanged) when the grammar forbids it."""
        if not self.matcher.accept_token(token):
            return False
        self.num_accepted += 1
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token taken: nothing more may follow."""
        return bool(self.matcher.is_terminated())
