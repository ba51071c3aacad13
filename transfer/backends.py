"""Transfer backend factory: a backend by its config name ("nixl", "fake", "loopback")."""

from __future__ import annotations

from transfer.backend import TransferBackend

BACKEND_KINDS = ("nixl", "fake", "loopback")


def make_backend(kind: str, name: str) -> TransferBackend:
    """A new backend of `kind` for the node called `name`; NIXL is imported only when asked."""
    if kind == "nixl":
        from transfer.nixl_backend import NixlBackend

        return NixlBackend(name)
    if kind == "fake":
        from transfer.fake_backend import FakeBackend

        return FakeBackend(name)
    if kind == "loopback":
        from transfer.loopback_backend import LoopbackBackend

        return LoopbackBackend(name)
    raise ValueError(f"unknown transfer backend {kind!r}; expected one of {list(BACKEND_KINDS)}")
