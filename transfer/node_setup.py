"""A node's KVManager from its TransferConfig: the one place nodes build their transfer side."""

from __future__ import annotations

from common.config import TransferConfig
from common.kv_pool import KVPool
from transfer.backends import make_backend
from transfer.kv_manager import KVManager


def build_kv_manager(
    node_id: str,
    role: str,
    transfer: TransferConfig,
    pool: KVPool,
    *,
    control_endpoint: str,
    instance_id: str,
    device: str = "cpu",
    backend_kind: str | None = None,
    backend_name: str | None = None,
    lease_s: float | None = None,
) -> KVManager:
    """The KVManager of node `node_id` over `pool`, bound on `control_endpoint`, on the
    backend --disaggregation-transfer-backend names (`backend_kind` overrides it, as the
    colocated process does with its in-memory "loopback"; `backend_name` names that
    backend's agent, default `node_id`), with the cluster's token, timeouts and lease
    (`lease_s` overrides it)."""
    kind = backend_kind or transfer.backend
    backend = make_backend(kind, backend_name or node_id, device=device)
    return KVManager(
        node_id,
        role,
        backend,
        pool,
        backend_kind=kind,
        control_endpoint=control_endpoint,
        auth_token=transfer.auth_token,
        bootstrap_timeout_s=transfer.bootstrap_timeout_s,
        waiting_timeout_s=transfer.waiting_timeout_s,
        lease_s=transfer.lease_s if lease_s is None else lease_s,
        instance_id=instance_id,
    )
