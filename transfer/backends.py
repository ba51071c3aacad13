"""Transfer backend factory: a backend by its config name ("nixl", "fake", "loopback")."""

from __future__ import annotations

from transfer.backend import TransferBackend

BACKEND_KINDS = ("nixl", "fake", "loopback")


def make_backend(kind: str, name: str, *, device: str = "cpu") -> TransferBackend:
    """A new backend of `kind` for the node called `name`, whose KV pool is on `device`.

    NIXL is imported only when asked; it starts UCX with the transports that device needs.
    """
    if kind == "nixl":
        from transfer.nixl_backend import NixlBackend

        return NixlBackend(name, device=device)
    if kind == "fake":
        from transfer.fake_backend import FakeBackend

        return FakeBackend(name)
    if kind == "loopback":
        from transfer.loopback_backend import LoopbackBackend

        return LoopbackBackend(name)
    raise ValueError(f"unknown transfer backend {kind!r}; expected one of {list(BACKEND_KINDS)}")
