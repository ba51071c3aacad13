"""The wire protocol's version, the base class of every message and the decode error."""

from dataclasses import Field
from typing import Any, ClassVar, Final

# Bumped on any incompatible change to a message; checked when a node registers
# (RegisterNode) and when a decode node greets a prefill node (PeerHello).
PROTOCOL_VERSION: Final = 8


class MalformedMessage(ValueError):
    """Bytes or JSON that are not a valid message; the one-line message says why."""


class Message:
    """Base of every wire message: a frozen dataclass with a class-level ``TAG``.

    Subclasses are listed explicitly in ``codec.MESSAGE_TYPES``; the tag, not the
    class name, is what travels on the wire.
    """

    __slots__ = ()
    TAG: ClassVar[str]
    # Declared so type checkers accept any Message in dataclasses.fields / replace.
    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]


def is_supported_protocol(version: int) -> bool:
    """Whether a peer speaking ``version`` can talk to this build."""
    return version == PROTOCOL_VERSION
