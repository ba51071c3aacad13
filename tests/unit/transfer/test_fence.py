"""Write fencing (transfer/fence.py): a paused writer posts nothing.

Pages are reused only after the fence.
"""

from __future__ import annotations

import itertools

import torch

from common.kv_pool import KVLayout, KVPool
from tests.support.kv_managers import Clock, drive
from transfer.fence import MARGIN_FRACTION, Fence, RenewalLog, receiver_fence_end, writer_fence_end
from transfer.kv_manager import KVManager
from transfer.kv_poll import FailureReason, KVPoll
from transfer.kv_sender import AuxData
from transfer.loopback_backend import LoopbackBackend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")
LEASE_S = 5.0  # the lease thread renews every 1.7 s: these tests finish long before that
_names = itertools.count()


def _pair(prefill_clock=None, decode_clock=None):
    n = next(_names)
    p_pool, d_pool = KVPool(LAYOUT, 16), KVPool(LAYOUT, 16)
    p_pool.buffer.copy_(torch.randn_like(p_pool.buffer))
    kw = dict(backend_kind="loopback", lease_s=LEASE_S)
    prefill = KVManager(
        f"fp{n}", "prefill", LoopbackBackend(f"fp{n}"), p_pool, clock=prefill_clock or Clock(), **kw
    )
    decode = KVManager(
        f"fd{n}", "decode", LoopbackBackend(f"fd{n}"), d_pool, clock=decode_clock or Clock(), **kw
    )
    return prefill, decode


def _granted_room(prefill, decode, room, dst):
    sender = prefill.create_sender(room, 8)
    receiver = decode.create_receiver(room, prefill.control_endpoint)
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata(dst)
    drive([prefill, decode], lambda: sender.fence.has_grant)
    return sender, receiver


def test_the_writer_fence_ends_before_the_receiver_may_reuse():
    # Sent at 0, granted at 0.3 on the other clock: the writer stops a margin before.
    assert writer_fence_end(0.0, 10.0) == 10.0 * (1 - MARGIN_FRACTION)
    assert writer_fence_end(0.0, 10.0) < receiver_fence_end(0.3, 10.0)
    fence = Fence()
    assert not fence.has_grant and not fence.is_open(0.0)
    fence.extend(5.0)
    fence.extend(3.0)  # an older grant read late never shortens the fence
    assert fence.is_open(4.99) and not fence.is_open(5.0)


def test_a_grant_is_dated_by_the_renewal_it_answers_and_opens_once():
    log = RenewalLog(horizon_s=10.0)
    seq = log.record("tcp://a", 7.0)
    assert log.take(seq, "tcp://b") is None  # answered by another peer: not ours
    assert log.take(seq, "tcp://a") == 7.0
    assert log.take(seq, "tcp://a") is None  # a replayed grant opens nothing


def test_a_paused_writer_posts_nothing_when_it_resumes():
    clock = Clock()  # one real time: both processes see it pass
    prefill, decode = _pair(prefill_clock=clock, decode_clock=clock)
    try:
        sender, receiver = _granted_room(prefill, decode, 7, [2, 3])
        # SIGSTOP of the prefill node for two leases: meanwhile the decode node fails the
        # room, frees its pages (the fence passed) and a new request writes into them.
        clock.t += 2 * LEASE_S
        decode.poll()
        assert receiver.poll() is KVPoll.Failed and receiver.is_release_safe()
        decode.pool.buffer[[2, 3]] = 7.0
        # SIGCONT: the model step ends and the chunk is handed over.
        sender.send([4, 5], 8, AuxData(first_token_id=1, room_echo=7))
        assert prefill.metrics.num_fenced == 1 and sender.handles == []
        drive([prefill, decode], lambda: sender.poll() is KVPoll.Failed)
        assert sender.status.reason in (FailureReason.LEASE_EXPIRED, FailureReason.PEER_ABORTED)
        assert sender.handles == []  # nothing was ever posted
        assert bool((decode.pool.buffer[[2, 3]] == 7.0).all())  # the new owner's bytes
    finally:
        prefill.close()
        decode.close()


def test_a_closed_fence_holds_writes_until_a_live_receiver_grants_again():
    pclock = Clock()
    prefill, decode = _pair(prefill_clock=pclock)
    try:
        sender, receiver = _granted_room(prefill, decode, 11, [12, 13])
        # The writer's view of its lease lapsed (its renewals were answered late), but the
        # decode node still holds the room: the write waits for a new grant, then goes.
        pclock.t += LEASE_S
        sender.send([4, 5], 8, AuxData(first_token_id=1, room_echo=11))
        assert sender.handles == [] and sender.poll() is KVPoll.Transferring
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.Success)
        assert torch.equal(decode.pool.buffer[[12, 13]], prefill.pool.buffer[[4, 5]])
        assert prefill.metrics.num_fenced == 1
    finally:
        prefill.close()
        decode.close()


def test_a_failed_room_is_reused_only_after_its_last_grant_plus_a_lease():
    dclock = Clock()
    prefill, decode = _pair(decode_clock=dclock)
    try:
        sender, receiver = _granted_room(prefill, decode, 8, [4, 5])
        granted_until = receiver.fence.until
        assert granted_until == receiver.lease_deadline
        prefill.close()  # the writer goes silent (dead or paused): no stop will come
        dclock.t += LEASE_S + 0.01
        decode.poll()
        decode.poll()  # housekeeping: the writer stopped renewing
        assert receiver.poll() is KVPoll.Failed
        assert receiver.status.reason == FailureReason.LEASE_EXPIRED
        dclock.t = granted_until - 0.001
        assert not receiver.is_release_safe()
        dclock.t = granted_until
        assert receiver.is_release_safe()
    finally:
        prefill.close()
        decode.close()


def test_a_room_never_granted_is_free_at_once():
    prefill, decode = _pair()
    try:
        sender = prefill.create_sender(9, 8)
        receiver = decode.create_receiver(9, prefill.control_endpoint)
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
        receiver.send_metadata([6, 7])
        receiver.abort()  # before the prefill node asked for (and got) a grant
        assert receiver.is_release_safe()
        drive([prefill, decode], lambda: sender.poll() is KVPoll.Failed)
        assert not sender.fence.has_grant
        assert torch.count_nonzero(decode.pool.buffer[[6, 7]]) == 0
    finally:
        prefill.close()
        decode.close()


def test_writes_wait_for_the_first_grant_instead_of_failing():
    prefill, decode = _pair()
    try:
        sender = prefill.create_sender(10, 8)
        receiver = decode.create_receiver(10, prefill.control_endpoint)
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
        receiver.send_metadata([8, 9])
        drive([prefill], lambda: sender.poll() is KVPoll.WaitingForInput)  # decode not polled
        sender.send([1, 2], 8, AuxData(first_token_id=3, room_echo=10))
        assert sender.poll() is KVPoll.Transferring and sender.pending_pairs
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.Success)
        assert torch.equal(decode.pool.buffer[[8, 9]], prefill.pool.buffer[[1, 2]])
    finally:
        prefill.close()
        decode.close()


class PausingBackend(LoopbackBackend):
    """A loopback backend whose next write takes `pause_s` on the writer's clock (SIGSTOP
    landing between the fence check and the end of the post)."""

    def __init__(self, name: str, clock: Clock) -> None:
        super().__init__(name)
        self.clock, self.pause_s = clock, 0.0

    def write(self, peer, pairs, notification=b""):
        handle = super().write(peer, pairs, notification)
        self.clock.t += self.pause_s
        self.pause_s = 0.0
        return handle


def test_a_write_that_straddles_the_fence_is_reported_and_its_pages_new_owners_warned():
    pclock = Clock()
    n = next(_names)
    p_pool, d_pool = KVPool(LAYOUT, 16), KVPool(LAYOUT, 16)
    backend = PausingBackend(f"fp{n}", pclock)
    prefill = KVManager(
        f"fp{n}", "prefill", backend, p_pool, backend_kind="loopback", lease_s=LEASE_S, clock=pclock
    )
    decode = KVManager(
        f"fd{n}",
        "decode",
        LoopbackBackend(f"fd{n}"),
        d_pool,
        backend_kind="loopback",
        lease_s=LEASE_S,
        clock=Clock(),
    )
    reported: list[tuple[int, list[int]]] = []
    decode.on_late_write = lambda room, pages: reported.append((room, pages))
    try:
        sender, _ = _granted_room(prefill, decode, 12, [14, 15])
        backend.pause_s = 2 * LEASE_S
        sender.send([4, 5], 8, AuxData(first_token_id=1, room_echo=12))
        drive([prefill, decode], lambda: reported)
        assert reported == [(12, [14, 15])]
        assert prefill.metrics.num_late_writes == 1 and decode.metrics.num_late_writes == 1
    finally:
        prefill.close()
        decode.close()
