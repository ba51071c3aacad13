"""The bootstrap service: registry, router, rooms and dispatcher composed; admits requests.

``admit`` is the whole front half of a request: limit check (429), live nodes (503), the
router's pair, a fresh room, GenerateReq to both nodes. The lease timer runs here too.

A gateway that has just started (or restarted) knows no node until the nodes' next
heartbeats, at most a second apart: for --registration-window seconds after ``start``,
``is_registering`` holds (``/ready`` says not ready) and a request that finds no pair waits
for one instead of getting a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace

from bootstrap import gateway_metrics as gm
from bootstrap.api_keys import ApiKeys
from bootstrap.decode_sessions import DecodeSessions, cached_sequence_hash
from bootstrap.dispatcher import Dispatcher, InflightReq, NodeQueueFull
from bootstrap.errors import APIError
from bootstrap.generation import Generation, PreparedRequest
from bootstrap.kv_events import KVEventSubscriber, PrefillSource
from bootstrap.registry import DEFAULT_LEASE_S, NodeRegistry, NodeView
from bootstrap.router import (
    DEFAULT_AFFINITY_TOKENS,
    DEFAULT_EPSILON,
    DEFAULT_VIRTUAL_NODES,
    DecodeCandidate,
    PrefillLoads,
    RoomAllocator,
    RouteDecision,
    Router,
)
from common import messages as msg
from common import metrics, page_hash
from common.config import BootstrapConfig
from common.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

REGISTRATION_POLL_S = 0.05  # how often a request waiting for the first nodes looks again
_NO_NODE = frozenset({"no_prefill_node", "no_decode_node"})


@dataclass(frozen=True)
class GatewaySettings:
    """Bootstrap knobs beyond BootstrapConfig: leases, router and the reply socket."""

    lease_s: float = DEFAULT_LEASE_S
    affinity_tokens: int = DEFAULT_AFFINITY_TOKENS
    epsilon: float = DEFAULT_EPSILON
    virtual_nodes: int = DEFAULT_VIRTUAL_NODES
    reply_host: str = "127.0.0.1"  # where the reply PULL socket binds
    reply_port: int = 0  # 0: any free port
    advertise_host: str | None = None  # how nodes reach the reply socket; None: reply_host
    # New at each start: nodes tell a restarted gateway from the one whose requests they hold.
    gateway_id: str = field(default_factory=lambda: f"gateway-{uuid.uuid4().hex[:16]}")


def _live(views: list[NodeView]) -> list[NodeView]:
    """Healthy nodes; nodes that merely missed a heartbeat only when no healthy one is left
    (never one that closed its connection: it died, its lease has not run out yet)."""
    return [v for v in views if v.is_healthy] or [v for v in views if v.is_reachable]


def _pairable(
    prefills: list[NodeView], decodes: list[NodeView]
) -> tuple[list[NodeView], dict[str, str]]:
    """The prefill nodes a request can go to, and each colocated one's decode partner: a
    colocated prefill whose partner is not live is left out; a plain prefill node needs a
    plain decode node."""
    live = {d.node_id for d in decodes}
    has_plain_decode = any(not d.colocated_with for d in decodes)
    partners = {p.node_id: p.colocated_with for p in prefills if p.colocated_with}
    usable = [
        p for p in prefills if (p.colocated_with in live if p.colocated_with else has_plain_decode)
    ]
    return usable, {p: d for p, d in partners.items() if d in live}


def _avoiding(views: list[NodeView], avoid: frozenset[str]) -> list[NodeView]:
    """``views`` without the nodes in ``avoid`` (a migrating request's failed pair), unless
    that leaves none: a node that failed one transfer may still be the only one there."""
    return [v for v in views if v.node_id not in avoid] or views


def _int_load(view: NodeView, name: str) -> int | None:
    value = view.load.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class BootstrapService:
    """Everything the two HTTP apps share."""

    def __init__(
        self,
        config: BootstrapConfig,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        context_length: int,
        settings: GatewaySettings | None = None,
    ) -> None:
        self.config = config
        self.settings = settings = settings or GatewaySettings()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context_length = context_length
        self.lease_tick_s = min(1.0, settings.lease_s / 4)  # how often leases are checked
        # A registry not called for two ticks was paused with us: its leases skip the pause.
        self.registry = NodeRegistry(
            config.auth_token, settings.lease_s, pause_after_s=2 * self.lease_tick_s
        )
        self.api_keys = ApiKeys(config.api_keys, config.api_key_file)
        self.registry.gateway_id = settings.gateway_id
        self.router = Router(
            affinity_tokens=settings.affinity_tokens,
            virtual_nodes=settings.virtual_nodes,
            epsilon=settings.epsilon,
            mode=config.prefill_router,
        )
        # Precise routing: the index of what each prefill node caches, from its KV events.
        self.kv_events = (
            KVEventSubscriber(settings.gateway_id) if config.prefill_router == "precise" else None
        )
        self.rooms = RoomAllocator()
        # Decode nodes with a prefix cache: which one served each conversation's last turn.
        self.decode_sessions = DecodeSessions()
        self._caching_decodes: frozenset[str] = frozenset()  # as of the last dispatch
        self.dispatcher = Dispatcher(
            settings.gateway_id,
            f"tcp://{settings.reply_host}:{settings.reply_port}",
            settings.advertise_host,
        )
        self.registry.add_lost_listener(self._on_node_lost)
        self.dispatcher.on_disconnect = self._on_disconnect
        self.num_active = 0  # admitted and not yet ended at the gateway
        self._timer: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._started_at: float | None = None  # monotonic, at start()

    def is_registering(self, now: float | None = None) -> bool:
        """Within --registration-window of the start: nodes may be alive and not yet known."""
        if self._started_at is None:
            return True
        now = time.monotonic() if now is None else now
        return now - self._started_at < self.config.registration_window_s

    def registry_listening(self) -> None:
        """The registry's port is open: the registration window runs from now (the nodes
        cannot register before; uvicorn's start took up to a second on a busy 2-core VM)."""
        self._started_at = time.monotonic()

    async def start(self) -> None:
        self._started_at = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.dispatcher.start()
        if self.kv_events is not None:
            self.kv_events.start()
        self._timer = asyncio.create_task(self._lease_timer(), name="lease-timer")

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        if self.kv_events is not None:
            self.kv_events.close()
        self.dispatcher.close()

    async def _lease_timer(self) -> None:
        paused_s = 0.0
        while True:
            await asyncio.sleep(self.lease_tick_s)
            self.registry.expire()
            if self.registry.paused_s > paused_s:
                gm.REGISTRY_PAUSED.labels(**metrics.role_labels()).inc(
                    self.registry.paused_s - paused_s
                )
                paused_s = self.registry.paused_s
            self._sync_kv_events()
            for role in ("prefill", "decode"):
                num = len(self.registry.views(role))
                gm.REGISTERED_NODES.labels(**metrics.role_labels(node_role=role)).set(num)

    def _sync_kv_events(self) -> None:
        if self.kv_events is None:
            return
        views = self.registry.views("prefill")
        self.kv_events.sync(
            PrefillSource(
                v.node_id, v.instance_id, v.kv_events_endpoint, v.request_endpoint, v.num_pages
            )
            for v in views
        )
        sizes = {v.page_size for v in views if v.page_size}
        if len(sizes) == 1:
            self.router.page_size = sizes.pop()

    def page_hashes(self, prepared: PreparedRequest) -> PreparedRequest:
        """``prepared`` with its prompt's page hashes when the router reads them (worker
        thread, off the event loop)."""
        if self.kv_events is None and not self._caching_decodes:
            return prepared
        hashes = page_hash.prompt_hashes(
            prepared.input_ids, self.router.page_size, prepared.cache_salt
        )
        return replace(prepared, page_hashes=hashes.tolist())

    def _on_node_lost(self, node_id: str, reason: str) -> None:
        """Registry listener, on the registry's thread or ours: the work runs on our loop."""
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread:
            with contextlib.suppress(RuntimeError):  # the loop is closed: we are stopping
                loop.call_soon_threadsafe(self._node_lost, node_id, reason)
            return
        self._node_lost(node_id, reason)

    def _on_disconnect(self, request_endpoint: str) -> None:
        """A node closed its connection (loop thread): route nothing there until it is heard
        from again; its requests have already moved on."""
        gm.NODE_DISCONNECTS.labels(**metrics.role_labels()).inc(
            len(self.registry.mark_unreachable(request_endpoint))
        )

    def _node_lost(self, node_id: str, reason: str) -> None:
        gm.NODES_LOST.labels(**metrics.role_labels()).inc()
        if self.kv_events is not None:
            self.kv_events.drop(node_id)
        self.dispatcher.fail_node(node_id, reason)

    # ---- admission -------------------------------------------------------------------------

    async def admit(
        self, prepared: PreparedRequest, arrival: float, pair: tuple[str, str] | None = None
    ) -> Generation:
        """Route and dispatch one request; raises APIError 429 or 503 (counted as rejected).
        Within the registration window a request that finds no pair waits for one.
        ``pair``: (prefill, decode) to send it to while both are live (the samples of one
        prompt go where the first went: the prompt is computed and moved once there)."""
        while True:
            try:
                return self._admit(prepared, arrival, pair)
            except APIError as exc:
                if exc.code in _NO_NODE and self.is_registering():
                    await asyncio.sleep(REGISTRATION_POLL_S)
                    continue
                gm.count_request("rejected")
                raise

    def _admit(
        self, prepared: PreparedRequest, arrival: float, pair: tuple[str, str] | None = None
    ) -> Generation:
        limit = self.config.max_queued_requests
        if limit is not None and self.num_active >= limit:
            raise APIError(
                429,
                f"the gateway has {self.num_active} requests in flight, its limit "
                f"(--max-queued-requests {limit}); retry later",
                code="queue_full",
            )
        req = self._dispatch(prepared, [], frozenset(), pair)
        self.num_active += 1
        gm.GATEWAY_INFLIGHT.labels(**metrics.role_labels()).set(self.num_active)

        def redispatch(output_ids: list[int], avoid: frozenset[str]) -> InflightReq:
            return self._dispatch(prepared, output_ids, avoid)

        def finished(decode_id: str, output_ids: list[int]) -> None:
            self._record_session(prepared, decode_id, output_ids)

        return Generation(
            req,
            self.dispatcher,
            self.tokenizer,
            prepared,
            arrival=arrival,
            deadline=arrival + self.config.request_timeout_s,
            on_end=self._on_generation_end,
            on_finished=finished,
            redispatch=redispatch,
            migration_limit=self.config.migration_limit,
            migration_timeout_s=self.config.migration_timeout_s,
            context_length=self.context_length,
        )

    def _dispatch(
        self,
        prepared: PreparedRequest,
        output_ids: list[int],
        avoid: frozenset[str],
        pair: tuple[str, str] | None = None,
    ) -> InflightReq:
        """Route ``prepared`` to a pair and send it there, in a fresh room; a migrated
        request carries its ``output_ids`` so far and keeps off the nodes in ``avoid``
        while others are live. Raises APIError 503 when no pair can take it."""
        prefills = _avoiding(_live(self.registry.views("prefill")), avoid)
        decodes = _avoiding(_live(self.registry.views("decode")), avoid)
        for role, views in (("prefill", prefills), ("decode", decodes)):
            if not views:
                raise APIError(503, f"no {role} node is registered", code="no_" + role + "_node")
        prefills, partners = _pairable(prefills, decodes)
        if not prefills:
            raise APIError(
                503,
                "no prefill node has a decode node to pair with (a colocated "
                "node pairs only with its own other half)",
                code="no_decode_node",
            )
        self._caching_decodes = frozenset(v.node_id for v in decodes if v.caches_prefixes)
        live = {v.node_id for v in prefills}, {v.node_id for v in decodes}
        is_pinned = (
            pair is not None
            and pair[0] in live[0]
            and pair[1] in live[1]
            and pair[1] == partners.get(pair[0], pair[1])
        )
        decision = None if is_pinned else self._route(prepared, prefills, decodes, partners)
        if decision is None:
            assert pair is not None
            prefill_id, decode_id = pair
        else:
            prefill_id, decode_id = decision.prefill_id, decision.decode_id
        prefill = next(v for v in prefills if v.node_id == prefill_id)
        decode = next(v for v in decodes if v.node_id == decode_id)
        gen = msg.GenerateReq(
            rid=uuid.uuid4().hex,
            room=self.rooms.allocate(),
            input_ids=prepared.input_ids,
            sampling=prepared.sampling.to_wire(),
            priority=prepared.priority,
            routing_key=prepared.routing_key,
            prefill_node_id=prefill.node_id,
            decode_node_id=decode.node_id,
            reply_endpoint=self.dispatcher.reply_endpoint,
            arrival_time=time.time(),
            return_logprob=prepared.sampling.logprobs,
            gateway_id=self.dispatcher.gateway_id,
            cache_salt=prepared.cache_salt,
            output_ids=output_ids,
            # a migrated request with output has had them (they come before its first token)
            return_prompt_logprobs=prepared.prompt_logprobs and not output_ids,
            # a migrated sample's prompt differs from its group's (its output is added)
            sample_group="" if output_ids else prepared.sample_group,
            num_group_samples=1 if output_ids else prepared.num_group_samples,
        )
        try:
            req = self.dispatcher.dispatch(gen, prefill.request_endpoint, decode.request_endpoint)
        except NodeQueueFull as exc:
            raise APIError(503, str(exc), code="node_queue_full") from None
        if self.kv_events is not None:  # what the node will compute, until it reports it
            uncached = (
                len(prepared.input_ids)
                + len(output_ids)
                - (0 if decision is None else decision.cached_pages) * self.router.page_size
            )
            if decision is None and gen.sample_group:
                uncached = 0  # a later sample: the first computes the prompt for the group
            self.kv_events.note_dispatched(
                prefill.node_id, max(1, uncached), prepared.page_hashes or (), self.router.page_size
            )
        if decision is not None:  # a pinned pair was not the router's choice
            gm.count_decision(decision.kind, decision.is_affinity_hit)
        return req

    def _route(
        self,
        prepared: PreparedRequest,
        prefills: list[NodeView],
        decodes: list[NodeView],
        partners: dict[str, str],
    ) -> RouteDecision:
        """The router's pair for ``prepared`` among the live nodes."""
        started = time.perf_counter()
        session_node = None
        if self._caching_decodes and prepared.page_hashes:
            session_node = self.decode_sessions.find(prepared.page_hashes, self._caching_decodes)
        overlaps, host = None, None
        ids = [v.node_id for v in prefills]
        queued: dict[str, int] = {}  # read by precise routing only
        if self.kv_events is not None:
            if prepared.page_hashes:
                overlaps = self.kv_events.overlaps(prepared.page_hashes, ids)
                host = self.kv_events.host_hits(prepared.page_hashes, overlaps)
            queued = self.kv_events.queued_tokens()
        decision = self.router.route(
            prepared.input_ids,
            prepared.routing_key,
            PrefillLoads(ids, self.dispatcher.pending_prefill, queued),
            [
                DecodeCandidate(
                    v.node_id,
                    self.dispatcher.num_inflight(v.node_id),
                    v.num_pages,
                    _int_load(v, "free_pages"),
                    v.caches_prefixes,
                )
                for v in decodes
            ],
            prepared.cache_salt,
            overlaps,
            partners,
            host,
            session_node,
        )
        gm.ROUTE_SECONDS.labels(**metrics.role_labels()).observe(time.perf_counter() - started)
        return decision

    def _record_session(self, prepared: PreparedRequest, decode_id: str, out: list[int]) -> None:
        """A request finished on ``decode_id``: if it caches prefixes, it holds this
        sequence's KV now (bootstrap/decode_sessions.py)."""
        if decode_id not in self._caching_decodes:
            return
        page = self.router.page_size
        h = cached_sequence_hash(prepared.input_ids, out, page, prepared.cache_salt)
        if h is not None:
            self.decode_sessions.record(h, decode_id)

    def _on_generation_end(self) -> None:
        self.num_active -= 1
        gm.GATEWAY_INFLIGHT.labels(**metrics.role_labels()).set(self.num_active)
