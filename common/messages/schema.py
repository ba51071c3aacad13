"""Field validators built once per message class from its type annotations.

A field may hold messages (``M``, ``M1 | M2`` or a list of them, e.g. ReplyBatch's
entries): on the wire each is its own ``[tag, {field: value}]``, validated by its class.
"""

import base64
import binascii
import dataclasses
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

from common.messages.base import MalformedMessage, Message

# (value, path) -> the value as the dataclass field holds it; raises MalformedMessage.
Converter = Callable[[Any, str], Any]
# The field's value as it goes on the wire (a field that holds messages); raises TypeError.
ToWire = Callable[[Any], Any]
_NONE_TYPE = type(None)


@dataclass(frozen=True)
class FieldSpec:
    """One declared field: its name, whether the wire must carry it, and its converters.

    ``nested``: the message classes the field holds (empty for a field of plain values);
    ``to_wire`` turns them into ``[tag, fields]`` (None: the value goes as it is).
    """

    name: str
    is_required: bool
    from_msgpack: Converter
    from_json: Converter
    nested: tuple[type[Message], ...] = ()
    to_wire: ToWire | None = None


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
        hint = hints[f.name]
        specs.append(
            FieldSpec(
                name=f.name,
                is_required=not has_default,
                from_msgpack=_compile(hint, is_json=False),
                from_json=_compile(hint, is_json=True),
                nested=_nested_in(hint),
                to_wire=_to_wire(hint),
            )
        )
    return tuple(specs)


def wire_fields(msg: Message) -> dict[str, Any]:
    """``{field: value}`` of ``msg`` as msgpack takes it, in declaration order."""
    return {
        spec.name: getattr(msg, spec.name)
        if spec.to_wire is None
        else spec.to_wire(getattr(msg, spec.name))
        for spec in schema_of(type(msg))
    }


def build(cls: type[Message], payload: Any, where: str, *, is_json: bool) -> Message:
    """Validate ``payload`` as the fields of ``cls`` and make the message; ``where`` starts
    each MalformedMessage reason (the class name, or the path of a nested message)."""
    if not isinstance(payload, dict):
        raise MalformedMessage(f"{where}: fields must be a map, got {type(payload).__name__}")
    schema = schema_of(cls)
    unknown = payload.keys() - {spec.name for spec in schema}
    if unknown:
        listed = ", ".join(sorted(f"{k!r:.40}" for k in unknown))
        raise MalformedMessage(f"{where}: unknown field(s) {listed:.200}")
    kwargs: dict[str, Any] = {}
    for spec in schema:
        if spec.name not in payload:
            if spec.is_required:
                raise MalformedMessage(f"{where}: missing field {spec.name!r}")
            continue
        convert = spec.from_json if is_json else spec.from_msgpack
        kwargs[spec.name] = convert(payload[spec.name], f"{where}.{spec.name}")
    return cls(**kwargs)


def shape(obj: Any) -> str:
    """A value's kind for a reason: ``list of 3``, ``dict``."""
    if isinstance(obj, list):
        return f"list of {len(obj)}"
    return type(obj).__name__


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


def _message_classes(hint: Any) -> tuple[type[Message], ...] | None:
    """The message classes ``hint`` names (``M`` or ``M1 | M2``); None if it is no message."""
    if isinstance(hint, type) and get_origin(hint) is None and issubclass(hint, Message):
        return (hint,)
    if get_origin(hint) in (Union, types.UnionType):
        args = get_args(hint)
        if all(_message_classes(a) is not None for a in args):
            return args
        if any(_message_classes(a) is not None for a in args):
            raise TypeError(f"a union mixes messages and other values: {hint!r}")
    return None


def _nested_in(hint: Any) -> tuple[type[Message], ...]:
    """The message classes a field of type ``hint`` holds: ``M``, ``M1 | M2`` or a list of them."""
    if get_origin(hint) is list:
        return _nested_in(get_args(hint)[0])
    return _message_classes(hint) or ()


def _to_wire(hint: Any) -> ToWire | None:
    classes = _message_classes(hint)
    if classes is not None:
        return _message_to_wire(classes)
    if get_origin(hint) is list:
        item = _to_wire(get_args(hint)[0])
        if item is not None:
            return lambda value: [item(x) for x in value]
    return None


def _message_to_wire(classes: tuple[type[Message], ...]) -> ToWire:
    allowed = frozenset(classes)

    def to_wire(msg: Any) -> list[Any]:
        if type(msg) not in allowed:
            names = " | ".join(c.__name__ for c in classes)
            raise TypeError(f"{type(msg).__name__} cannot go where {names} is expected")
        return [msg.TAG, wire_fields(msg)]

    return to_wire


def _compile(hint: Any, *, is_json: bool) -> Converter:
    if hint is Any:
        return lambda value, path: value
    classes = _message_classes(hint)
    if classes is not None:
        return message_converter(classes, is_json=is_json)
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
        if _to_wire(key) is not None or _to_wire(value) is not None:
            raise TypeError(f"messages go in a field of their own or a list, not {hint!r}")
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


def message_converter(classes: tuple[type[Message], ...], *, is_json: bool) -> Converter:
    """The validator of one nested message: ``[tag, fields]`` of one of ``classes``."""
    by_tag = {cls.TAG: cls for cls in classes}
    names = " | ".join(cls.__name__ for cls in classes)

    def convert(value: Any, path: str) -> Message:
        if not isinstance(value, list) or len(value) != 2:
            raise MalformedMessage(f"{path}: expected [tag, fields], got {shape(value)}")
        tag, payload = value
        cls = by_tag.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise MalformedMessage(f"{path}: tag {tag!r:.60} is not one of {names}")
        return build(cls, payload, f"{path}: {cls.__name__}", is_json=is_json)

    return convert


def _union_of(hint: Any, members: list[Converter]) -> Converter:
    accepts_none = _NONE_TYPE in get_args(hint)

    def convert(value: Any, path: str) -> Any:
        # An optional field left empty is the common case: no member is tried (and fails).
        if value is None and accepts_none:
            return None
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
