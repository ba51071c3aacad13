"""Per-request sampling parameters (SGLang-like defaults), their validation and wire form."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, NoReturn

MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1
# Stop strings are searched at every token: bound what one request can make a node do.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 makes it (nearly) certain
INT64_MAX = 2**63 - 1  # integers travel as msgpack int64 and become torch int64 tensors
GREEDY_TEMPERATURE_EPS = 1e-5
# A grammar travels with the request to both nodes and is compiled on each: bound its text.
MAX_GRAMMAR_CHARS = 256 * 1024
# SGLang's names: at most one of them constrains a request's output (common/grammar/).
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: limits, filters, stop conditions and logprob options.

    temperature 0 means greedy; top_k -1 or 0 disables top-k; top_p 1 and min_p 0
    disable their filters. `validate()` checks values; `from_wire()` checks types too.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Penalties (common/penalties.py): OpenAI's frequency and presence, SGLang's repetition;
    # min_tokens holds back end-of-sequence and stop token ids until that many are out.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # OpenAI's logit_bias: (token id, bias) pairs, the bias added to that id's logit.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output: the output must match this grammar (at most one is set).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(kind, text) of the grammar that constrains the output; None when there is none."""
        for name in GRAMMAR_FIELDS:
            text = getattr(self, name)
            if text is not None:
                return name, text
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first field whose value is out of range."""
        if self.max_new_tokens < 0:
            _fail("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            _fail("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k > INT64_MAX:
            _fail(
                "top_k",
                f"must be -1 or 0 (disabled) or a positive integer below 2**63, got {self.top_k}",
            )
        if self.max_new_tokens > INT64_MAX:
            _fail("max_new_tokens", f"must be below 2**63, got {self.max_new_tokens}")
        if not (0.0 <= self.min_p <= 1.0):
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            _fail("seed", f"must be in [0, 2**64 - 1], got {self.seed}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                _fail(name, f"must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            _fail("repetition_penalty", f"must be a number > 0, got {self.repetition_penalty}")
        if not (0 <= self.min_tokens <= self.max_new_tokens):
            _fail(
                "min_tokens",
                f"must be in [0, max_new_tokens={self.max_new_tokens}], got {self.min_tokens}",
            )
        self._validate_logit_bias(vocab_size)
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            _fail("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", f"must hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not s:
                _fail(f"stop[{i}]", "must be a non-empty string")
            if len(s) > MAX_STOP_CHARS:
                _fail(f"stop[{i}]", f"must be at most {MAX_STOP_CHARS} characters, got {len(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            _fail(
                "stop_token_ids",
                f"must hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
            )
        for i, tid in enumerate(self.stop_token_ids):
            if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                _fail(f"stop_token_ids[{i}]", f"must be a token id in {bound}, got {tid}")
        given = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            _fail(given[1], f"cannot be combined with {given[0]}: pass one grammar")
        for name in given:
            text = getattr(self, name)
            if not text:
                _fail(name, "must be a non-empty string")
            if len(text) > MAX_GRAMMAR_CHARS:
                _fail(name, f"must be at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            _fail(
                "logit_bias", f"must bias at most {MAX_LOGIT_BIAS} ids, got {len(self.logit_bias)}"
            )
        seen: set[int] = set()
        for tid, bias in self.logit_bias:
            if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
                _fail(f"logit_bias[{tid}]", f"must name a token id in {bound}")
            if tid in seen:
                _fail(f"logit_bias[{tid}]", "is given twice")
            seen.add(tid)
            if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
                _fail(f"logit_bias[{tid}]", f"must be in [-100, 100], got {bias}")

    def to_wire(self) -> dict[str, Any]:
        """Plain dict for msgpack (tuples become lists)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs,
            "top_logprobs": self.top_logprobs,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "logit_bias": [[tid, bias] for tid, bias in self.logit_bias],
            **{name: getattr(self, name) for name in GRAMMAR_FIELDS},
        }

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> SamplingParams:
        """Inverse of to_wire; missing keys take defaults, unknown keys and bad types fail."""
        if not isinstance(d, dict):
            _fail("payload", f"must be a dict, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"sampling params: unknown field(s) {', '.join(unknown)}")
        kwargs: dict[str, Any] = {}
        for name, value in d.items():
            kwargs[name] = _WIRE_CHECKS[name](name, value)
        params = cls(**kwargs)
        params.validate()
        return params


def _fail(field: str, message: str) -> NoReturn:
    raise ValueError(f"sampling params: {field} {message}")


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, f"must be an integer, got {type(value).__name__}")
    return int(value)


def _as_optional_int(name: str, value: Any) -> int | None:
    return None if value is None else _as_int(name, value)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(name, f"must be a number, got {type(value).__name__}")
    return float(value)


def _as_optional_str(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        _fail(name, f"must be a string, got {type(value).__name__}")
    return value


def _as_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        _fail(name, f"must be a boolean, got {type(value).__name__}")
    return bool(value)


def _as_str_tuple(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        _fail(name, f"must be a list of strings, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            _fail(f"{name}[{i}]", f"must be a string, got {type(item).__name__}")
    return tuple(value)


def _as_int_tuple(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        _fail(name, f"must be a list of integers, got {type(value).__name__}")
    return tuple(_as_int(f"{name}[{i}]", item) for i, item in enumerate(value))


def _as_bias_pairs(name: str, value: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, (list, tuple)):
        _fail(name, f"must be a list of [token id, bias] pairs, got {type(value).__name__}")
    pairs = []
    for i, item in enumerate(value):
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            _fail(f"{name}[{i}]", "must be a [token id, bias] pair")
        pairs.append((_as_int(f"{name}[{i}][0]", item[0]), _as_float(f"{name}[{i}][1]", item[1])))
    return tuple(pairs)


_WIRE_CHECKS = {
    "max_new_tokens": _as_int,
    "temperature": _as_float,
    "top_p": _as_float,
    "top_k": _as_int,
    "min_p": _as_float,
    "seed": _as_optional_int,
    "stop": _as_str_tuple,
    "stop_token_ids": _as_int_tuple,
    "ignore_eos": _as_bool,
    "logprobs": _as_bool,
    "top_logprobs": _as_int,
    "frequency_penalty": _as_float,
    "presence_penalty": _as_float,
    "repetition_penalty": _as_float,
    "min_tokens": _as_int,
    "logit_bias": _as_bias_pairs,
    **{name: _as_optional_str for name in GRAMMAR_FIELDS},
}
