"""A writer whose loop is in a long model step stays alive to its receivers (transfer/leases.py).

The prefill node reads a TransferRequest only between model steps; a batched prefill of
long prompts on a CPU can outlast the lease. Its lease thread keeps telling every peer it
is alive, so the decode node waits for the room instead of failing it as lease_expired.
"""

from __future__ import annotations

import itertools
import time

import torch

from common.kv_pool import KVLayout, KVPool
from tests.support.kv_managers import Clock, drive
from transfer.kv_manager import KVManager
from transfer.kv_poll import FailureReason, KVPoll
from transfer.kv_sender import AuxData
from transfer.loopback_backend import LoopbackBackend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")
_names = itertools.count()


def _pair(lease_s: float, clock=time.monotonic):
    n = next(_names)
    p_pool, d_pool = KVPool(LAYOUT, 16), KVPool(LAYOUT, 16)
    p_pool.buffer.copy_(torch.randn_like(p_pool.buffer))
    kw = dict(backend_kind="loopback", lease_s=lease_s, clock=clock)
    prefill = KVManager(f"lp{n}", "prefill", LoopbackBackend(f"lp{n}"), p_pool, **kw)
    decode = KVManager(f"ld{n}", "decode", LoopbackBackend(f"ld{n}"), d_pool, **kw)
    return prefill, decode


def test_a_room_waits_while_the_writers_loop_is_in_a_step_longer_than_the_lease():
    lease_s = 1.5
    prefill, decode = _pair(lease_s)
    try:
        sender = prefill.create_sender(3, 8)
        receiver = decode.create_receiver(3, prefill.control_endpoint)
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
        receiver.send_metadata([5, 6])
        # The prefill loop is stuck in a model step for 3 leases: it never reads the
        # request. Only the decode node runs (and would fail the room at one lease).
        end = time.monotonic() + 3 * lease_s
        while time.monotonic() < end:
            decode.poll()
            time.sleep(0.005)
        assert receiver.poll() is KVPoll.Transferring, receiver.failure_reason
        # The step ends: the request is attached, granted and written.
        drive([prefill, decode], lambda: sender.poll() is KVPoll.WaitingForInput)
        sender.send([1, 2], 8, AuxData(first_token_id=4, room_echo=3))
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.Success)
        assert torch.equal(decode.pool.buffer[[5, 6]], prefill.pool.buffer[[1, 2]])
    finally:
        prefill.close()
        decode.close()


def test_a_dead_writer_still_fails_a_room_it_never_took_up_after_one_lease():
    clock = Clock()
    prefill, decode = _pair(5.0, clock)
    try:
        prefill.create_sender(4, 8)
        receiver = decode.create_receiver(4, prefill.control_endpoint)
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
        receiver.send_metadata([7, 8])
        prefill.close()  # killed: its lease thread stops with it
        clock.t += 5.01
        decode.poll()
        decode.poll()
        assert receiver.poll() is KVPoll.Failed
        assert receiver.status.reason == FailureReason.LEASE_EXPIRED
        assert receiver.is_release_safe()  # never granted: nothing can have been written
    finally:
        prefill.close()
        decode.close()


def test_a_round_renews_leased_rooms_and_tells_other_touched_peers_we_are_alive():
    clock = Clock()
    prefill, _ = _pair(5.0, clock)
    decode_a, decode_b = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"
    try:
        leases = prefill._leases
        leases.touch(decode_a)
        leases.lease(9, decode_b)
        leases.lease(10, decode_b)
        assert leases.due() == {decode_a: [], decode_b: [9, 10]}
        clock.t += leases.idle_s + 1  # no handshake, room or grant since: stop vouching
        leases.unlease(9)
        assert leases.due() == {decode_b: [10]}  # a leased room is renewed whatever its age
        leases.unlease(10)
        assert leases.due() == {}
    finally:
        prefill.close()
