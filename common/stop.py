"""Finish conditions: stop token ids, eos, max_new_tokens and text stop strings."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from common.sampling_params import SamplingParams


class FinishKind(StrEnum):
    """Why a request finished; the values are OpenAI's finish_reason strings."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class FinishReason:
    """A finish kind and, for STOP, the token id or stop string that matched."""

    kind: FinishKind
    matched: int | str | None = None

    def __post_init__(self) -> None:
        if (self.kind is FinishKind.STOP) != (self.matched is not None):
            raise ValueError(
                f"FinishReason {self.kind.value}: matched must be set iff kind is stop"
            )

    @classmethod
    def stop(cls, matched: int | str) -> FinishReason:
        return cls(FinishKind.STOP, matched)

    @classmethod
    def length(cls) -> FinishReason:
        return cls(FinishKind.LENGTH)

    @classmethod
    def abort(cls) -> FinishReason:
        return cls(FinishKind.ABORT)


class StopChecker:
    """Decides when one request's generation ends and trims its text at stop strings.

    Token checks (`check_token`) see each sampled id; text checks (`feed`) see the
    detokenized text as it grows and hold back any tail that could begin a stop string,
    so a client never sees part of one. Call `flush` when generation ends otherwise.
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Iterable[int]) -> None:
        self._max_new_tokens = params.max_new_tokens
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._stop_strings = tuple(params.stop)
        self._max_hold = max((len(s) - 1 for s in self._stop_strings), default=0)
        self._held = ""
        self._matched_stop: str | None = None

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended generation, once `feed` has found one."""
        return self._matched_stop

    def check_token(self, token_id: int, num_generated: int) -> FinishReason | None:
        """Finish reason after sampling `token_id`, the `num_generated`-th output token."""
        if token_id in self._stop_token_ids or token_id in self._eos_token_ids:
            return FinishReason.stop(token_id)
        if num_generated >= self._max_new_tokens:
            return FinishReason.length()
        return None

    def feed(self, new_text: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop string has matched.

        On a match the text before the earliest stop string is returned and the stop
        string itself is dropped; after a match every call returns ("", True).
        """
        if self._matched_stop is not None:
            return "", True
        text = self._held + new_text
        match = self._earliest_match(text)
        if match is not None:
            index, stop = match
            self._held = ""
            self._matched_stop = stop
            return text[:index], True
        hold = self._partial_stop_suffix(text)
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Release the held-back tail when generation ends for another reason."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stop_strings:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for length in range(min(len(text), self._max_hold), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stop_strings):
                return length
        return 0
