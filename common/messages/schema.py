"""Field validators built once per message class from its type annotations."""

import base64
import binascii
import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

from common.messages.base import MalformedMessage

# (value, path) -> the value as the dataclass field holds it; raises MalformedMessage.
Converter = Callable[[Any, str], Any]
_NONE_TYPE = type(None)


@dataclass(frozen=True)
class FieldSpec:
    """One declared field: its name, whether the wire must carry it, and its converters."""

    name: str
    is_required: bool
    from_msgpack: Converter
    from_json: Converter


_SCHEMAS: dict[type, tuple[FieldSpec, ...]] = {}


def schema_of(cls: type) -> tuple[FieldSpec, ...]:
    """The fields of dataclass ``cls`` in declaration order, built once per class.

    Raises TypeError on an annotation the codec cannot validate.
    """
    schema = _SCHEMAS.get(cls)
    if schema is None:
        schema = _SCHEMAS[cls] = _build_schema(cls)
    return schema


def _build_schema(cls: type) -> tuple[FieldSpec, ...]:
    hints = get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        has_default = (
            f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        )
        specs.append(
            FieldSpec(
                name=f.name,
                is_required=not has_default,
                from_msgpack=_compile(hints[f.name], is_json=False),
                from_json=_compile(hints[f.name], is_json=True),
            )
        )
    return tuple(specs)


def describe(hint: Any) -> str:
    """A short readable name for a type hint: ``int``, ``list[int]``, ``int | str | None``."""
    if hint is _NONE_TYPE:
        return "None"
    if hint is Any:
        return "any"
    if isinstance(hint, type) and get_origin(hint) is None:
        return hint.__name__
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return " | ".join(describe(a) for a in args)
    return f"{origin.__name__}[{', '.join(describe(a) for a in args)}]"


def _fail(path: str, expected: Any, value: Any) -> MalformedMessage:
    return MalformedMessage(f"{path}: expected {describe(expected)}, got {type(value).__name__}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# Leaf types whose check is a predicate (the value is kept as is).
_PREDICATES: dict[Any, Callable[[Any], bool]] = {
    int: _is_int,
    str: lambda v: isinstance(v, str),
    bool: lambda v: isinstance(v, bool),
    _NONE_TYPE: lambda v: v is None,
}


def _compile(hint: Any, *, is_json: bool) -> Converter:
    if hint is Any:
        return lambda value, path: value
    if hint in _PREDICATES:
        return _leaf(hint, _PREDICATES[hint])
    if hint is float:
        return _to_float
    if hint is bytes:
        return _from_base64 if is_json else _leaf(bytes, lambda v: isinstance(v, bytes))
    origin, args = get_origin(hint), get_args(hint)
    if hint is list or origin is list:
        return _list_of(args[0] if args else Any, is_json=is_json)
    if hint is dict or origin is dict:
        key, value = args if args else (Any, Any)
        return _dict_of(key, value, is_json=is_json)
    if origin in (Union, types.UnionType):
        return _union_of(hint, [_compile(a, is_json=is_json) for a in args])
    raise TypeError(f"unsupported message field annotation {hint!r}")


def _leaf(hint: Any, is_ok: Callable[[Any], bool]) -> Converter:
    def convert(value: Any, path: str) -> Any:
        if not is_ok(value):
            raise _fail(path, hint, value)
        return value

    return convert


def _to_float(value: Any, path: str) -> float:
    if isinstance(value, float):
        return value
    if _is_int(value):
        try:
            return float(value)
        except OverflowError:
            raise MalformedMessage(f"{path}: integer too large for a float") from None
    raise _fail(path, float, value)


def _from_base64(value: Any, path: str) -> bytes:
    if not isinstance(value, str):
        raise MalformedMessage(f"{path}: expected base64 string, got {type(value).__name__}")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedMessage(f"{path}: not valid base64") from None


def _list_of(item: Any, *, is_json: bool) -> Converter:
    hint = list[item]
    is_ok = _PREDICATES.get(item)
    convert_item = _compile(item, is_json=is_json)

    def convert(value: Any, path: str) -> list[Any]:
        if not isinstance(value, list):
            raise _fail(path, hint, value)
        # Fast path for token id lists: one pass, no per-item call unless something is wrong.
        if is_ok is not None and all(map(is_ok, value)):
            return value
        return [convert_item(x, f"{path}[{i}]") for i, x in enumerate(value)]

    return convert


def _dict_of(key: Any, item: Any, *, is_json: bool) -> Converter:
    hint = dict[key, item]
    convert_key = _compile(key, is_json=is_json)
    convert_item = _compile(item, is_json=is_json)

    def convert(value: Any, path: str) -> dict[Any, Any]:
        if not isinstance(value, dict):
            raise _fail(path, hint, value)
        return {
            convert_key(k, f"{path} key"): convert_item(v, f"{path}[{k!r:.40}]")
            for k, v in value.items()
        }

    return convert


def _union_of(hint: Any, members: list[Converter]) -> Converter:
    def convert(value: Any, path: str) -> Any:
        nested: list[MalformedMessage] = []
        for member in members:
            try:
                return member(value, path)
            except MalformedMessage as exc:
                if not str(exc).startswith(f"{path}:"):
                    nested.append(exc)
        # The value had the right shape for one member but something inside was wrong:
        # that inner reason (e.g. ``x[3]: expected int``) says more than the union's name.
        if len(nested) == 1:
            raise nested[0]
        raise _fail(path, hint, value)

    return convert
