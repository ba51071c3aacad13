"""KVManager/KVSender/KVReceiver in one process: real zmq control sockets, loopback backend."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import zmq

from common import messages as msg
from common import metrics
from common.kv_pool import KVLayout, KVPool
from tests.support.kv_managers import drive
from transfer.kv_manager import KVManager
from transfer.kv_poll import FailureReason, KVPoll
from transfer.kv_sender import AuxData
from transfer.loopback_backend import LoopbackBackend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")
_names = itertools.count()


def make_pair(
    lease_s=5.0,
    bootstrap_timeout_s=5.0,
    waiting_timeout_s=5.0,
    decode_layout=LAYOUT,
    prefill_token=None,
    decode_token=None,
    num_pages=32,
):
    n = next(_names)
    p_pool, d_pool = KVPool(LAYOUT, num_pages), KVPool(decode_layout, num_pages)
    torch.manual_seed(n)
    p_pool.buffer.copy_(torch.randn_like(p_pool.buffer))
    kw = dict(
        backend_kind="loopback",
        lease_s=lease_s,
        bootstrap_timeout_s=bootstrap_timeout_s,
        waiting_timeout_s=waiting_timeout_s,
    )
    prefill = KVManager(
        f"p{n}", "prefill", LoopbackBackend(f"p{n}"), p_pool, auth_token=prefill_token, **kw
    )
    decode = KVManager(
        f"d{n}", "decode", LoopbackBackend(f"d{n}"), d_pool, auth_token=decode_token, **kw
    )
    return prefill, decode


@pytest.fixture
def pair():
    p, d = make_pair()
    yield p, d
    p.close()
    d.close()


def test_chunked_transfer_of_concurrent_rooms_lands_byte_for_byte(pair):
    prefill, decode = pair
    rooms = {101: 13, 102: 8, 103: 22}  # room -> prompt tokens
    src_pages = {101: [9, 3, 4, 5], 102: [0, 1], 103: [20, 21, 22, 7, 8, 30]}
    dst_pages = {101: [2, 3, 4, 11], 102: [15, 14], 103: [5, 6, 7, 8, 9, 10]}
    senders = {r: prefill.create_sender(r, n) for r, n in rooms.items()}
    receivers = {r: decode.create_receiver(r, prefill.control_endpoint) for r in rooms}
    drive(
        [prefill, decode],
        lambda: all(r.poll() is KVPoll.WaitingForInput for r in receivers.values()),
    )
    for r, rec in receivers.items():
        rec.send_metadata(dst_pages[r], aux_slot=r % 7)
    drive(
        [prefill, decode], lambda: all(s.poll() is KVPoll.WaitingForInput for s in senders.values())
    )
    assert senders[101].aux_slot == 101 % 7
    # Chunks that end mid-page: only whole pages go until the last chunk.
    for r, n in rooms.items():
        for end in (5, 9):
            senders[r].send(src_pages[r], min(end, n - 1))
        senders[r].send(
            src_pages[r],
            n,
            AuxData(
                first_token_id=r,
                room_echo=r,
                first_logprob=-0.5,
                top_logprobs=[(r, -0.5), (7, -1.25)],
            ),
        )
    drive(
        [prefill, decode],
        lambda: all(x.poll() is KVPoll.Success for x in (*senders.values(), *receivers.values())),
    )
    for r in rooms:
        assert torch.equal(decode.pool.buffer[dst_pages[r]], prefill.pool.buffer[src_pages[r]])
        aux = receivers[r].aux
        assert aux.first_token_id == r and aux.first_logprob == -0.5
        assert aux.top_logprobs == [(r, -0.5), (7, -1.25)]
        assert receivers[r].is_release_safe()
        assert receivers[r].status.history == [
            KVPoll.Bootstrapping,
            KVPoll.WaitingForInput,
            KVPoll.Transferring,
        ]
    untouched = sorted(set(range(32)) - {p for ps in dst_pages.values() for p in ps})
    assert torch.count_nonzero(decode.pool.buffer[untouched]) == 0


def _ready_room(prefill, decode, room, tokens=8, dst=(0, 1)):
    sender = prefill.create_sender(room, tokens)
    receiver = decode.create_receiver(room, prefill.control_endpoint)
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata(list(dst))
    # Ready to write: the decode side granted the room's lease (transfer/fence.py).
    drive(
        [prefill, decode],
        lambda: sender.poll() is KVPoll.WaitingForInput and sender.fence.has_grant,
    )
    return sender, receiver


def test_fake_backend_completes_rooms_through_the_control_socket():
    from transfer.fake_backend import FakeBackend

    n = next(_names)
    pool_p, pool_d = KVPool(LAYOUT, 8), KVPool(LAYOUT, 8)
    prefill = KVManager(f"fp{n}", "prefill", FakeBackend(f"fp{n}"), pool_p, backend_kind="fake")
    decode = KVManager(f"fd{n}", "decode", FakeBackend(f"fd{n}"), pool_d, backend_kind="fake")
    try:
        sender, receiver = _ready_room(prefill, decode, 41)
        sender.send([0, 1], 5)
        sender.send([0, 1], 8, AuxData(first_token_id=9, room_echo=41))
        drive(
            [prefill, decode],
            lambda: receiver.poll() is KVPoll.Success and sender.poll() is KVPoll.Success,
        )
        assert receiver.aux.first_token_id == 9
        assert prefill.backend.num_pages_written == 2  # counted, nothing moved
    finally:
        prefill.close()
        decode.close()


def test_room_echo_mismatch_is_detected(pair):
    prefill, decode = pair
    sender, receiver = _ready_room(prefill, decode, 7)
    sender.send([4, 5], 8, AuxData(first_token_id=1, room_echo=8))
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.Failed)
    assert receiver.status.reason == FailureReason.ROOM_ECHO_MISMATCH
    assert "room 8" in receiver.failure_reason


def test_abort_from_decode_fails_sender_and_is_acknowledged(pair):
    prefill, decode = pair
    sender, receiver = _ready_room(prefill, decode, 9)
    receiver.abort()
    assert receiver.poll() is KVPoll.Failed and not receiver.is_release_safe()
    drive([prefill, decode], lambda: sender.poll() is KVPoll.Failed and receiver.is_release_safe())
    assert sender.status.reason == FailureReason.PEER_ABORTED


def test_abort_from_prefill_reaches_decode(pair):
    prefill, decode = pair
    sender, receiver = _ready_room(prefill, decode, 10)
    sender.abort("client went away")
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.Failed)
    assert "client went away" in receiver.failure_reason and receiver.is_release_safe()


def test_abort_before_sender_exists_fails_it_on_creation(pair):
    prefill, decode = pair
    receiver = decode.create_receiver(11, prefill.control_endpoint)
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata([0, 1])
    receiver.abort()
    drive([prefill, decode], lambda: 11 in prefill.early_aborts)
    assert prefill.create_sender(11, 8).poll() is KVPoll.Failed


def test_transfer_request_before_sender_exists_is_kept(pair):
    prefill, decode = pair
    receiver = decode.create_receiver(12, prefill.control_endpoint)
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata([3, 4])
    drive([prefill, decode], lambda: 12 in prefill.early_requests)
    sender = prefill.create_sender(12, 5)
    assert sender.poll() is KVPoll.WaitingForInput and sender.dst_pages == [3, 4]


def test_a_transfer_request_for_a_room_that_failed_and_was_cleared_fails_at_once():
    """The prefill node aborted a room (and its scheduler cleared it) before the decode
    node's TransferRequest came: the decode side hears TransferFailed at once, not after
    the bootstrap timeout (60 s here; it held its pages all that time before)."""
    prefill, decode = make_pair(bootstrap_timeout_s=60.0)
    try:
        sender = prefill.create_sender(13, 8)
        sender.abort("client went away")
        sender.clear()
        assert 13 in prefill.ended_rooms
        receiver = decode.create_receiver(13, prefill.control_endpoint)
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
        receiver.send_metadata([0, 1])
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.Failed)
        assert "client went away" in receiver.failure_reason and receiver.is_release_safe()
        assert 13 not in prefill.ended_rooms and 13 not in prefill.early_requests
    finally:
        prefill.close()
        decode.close()


def test_an_ended_room_nobody_asks_for_is_forgotten_after_the_bootstrap_timeout():
    prefill, decode = make_pair(bootstrap_timeout_s=0.2)
    try:
        sender = prefill.create_sender(14, 8)
        sender.abort()
        sender.clear()
        drive([prefill], lambda: 14 not in prefill.ended_rooms)
    finally:
        prefill.close()
        decode.close()


def test_incompatible_pools_are_refused_with_a_clear_reason():
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=8, dtype="float32")
    prefill, decode = make_pair(decode_layout=other)
    try:
        receiver = decode.create_receiver(1, prefill.control_endpoint)
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.Failed)
        assert receiver.status.reason == FailureReason.INCOMPATIBLE
        assert "page_size 4 != 8" in receiver.failure_reason
    finally:
        prefill.close()
        decode.close()


def test_wrong_cluster_token_is_refused_and_nothing_is_written():
    prefill, decode = make_pair(prefill_token="secret", decode_token="guess")
    try:
        receiver = decode.create_receiver(1, prefill.control_endpoint)
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.Failed)
        assert receiver.status.reason == FailureReason.UNAUTHORIZED
        assert prefill.peer_by_node == {}
    finally:
        prefill.close()
        decode.close()


def test_bootstrap_timeout_fails_a_sender_nobody_asks_for():
    prefill, decode = make_pair(bootstrap_timeout_s=0.2)
    try:
        sender = prefill.create_sender(5, 8)
        drive([prefill], lambda: sender.poll() is KVPoll.Failed, timeout=3)
        assert sender.status.reason == FailureReason.BOOTSTRAP_TIMEOUT
    finally:
        prefill.close()
        decode.close()


def test_a_busy_loop_keeps_its_leases(pair):
    prefill, decode = make_pair(lease_s=0.3)
    try:
        sender, receiver = _ready_room(prefill, decode, 5)
        # The prefill loop stalls (a long model step) for three leases while the decode
        # loop runs: the lease thread's renewals are granted meanwhile, and the grants,
        # dated by their sending, keep the fence open when the loop reads them.
        stall_until = time.monotonic() + 1.0
        while time.monotonic() < stall_until:
            decode.poll()
            time.sleep(0.001)
        drive([prefill, decode], lambda: True)
        assert sender.poll() is KVPoll.WaitingForInput and receiver.poll() is KVPoll.Transferring
        assert sender.fence.is_open(time.monotonic())
    finally:
        prefill.close()
        decode.close()


def test_silent_decode_makes_the_sender_release_within_the_lease():
    prefill, decode = make_pair(lease_s=0.3)
    try:
        sender, _ = _ready_room(prefill, decode, 6)
        start = time.monotonic()
        decode.close()  # the decode node dies: nobody renews its rooms any more
        drive([prefill], lambda: sender.poll() is KVPoll.Failed, timeout=3)
        assert sender.status.reason == FailureReason.LEASE_EXPIRED
        assert time.monotonic() - start < 1.0
    finally:
        prefill.close()
        decode.close()


def test_silent_prefill_makes_the_receiver_fail_and_its_pages_become_safe():
    prefill, decode = make_pair(lease_s=0.3)
    try:
        _, receiver = _ready_room(prefill, decode, 6)
        prefill.close()  # the prefill node dies
        drive([decode], lambda: receiver.poll() is KVPoll.Failed, timeout=3)
        assert receiver.status.reason == FailureReason.LEASE_EXPIRED
        drive([decode], receiver.is_release_safe, timeout=3)
    finally:
        prefill.close()
        decode.close()


def test_garbage_on_the_control_socket_is_dropped_and_the_next_transfer_works(pair):
    prefill, decode = pair
    labels = {"role": metrics.ROLE, "socket": "prefill_kv_control"}
    before = metrics.REGISTRY.get_sample_value("pdserve_malformed_messages_total", labels) or 0
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(prefill.control_endpoint)
    push.send(b"\x93garbage")
    push.send(msg.encode(msg.LeaseRenew(node_id="stranger", rooms=[1])))
    push.close()
    drive([prefill], lambda: prefill.metrics.num_dropped[FailureReason.UNAUTHORIZED] == 1)
    after = metrics.REGISTRY.get_sample_value("pdserve_malformed_messages_total", labels)
    assert after == before + 1  # the garbage frame; the stranger's renew counts as unauthorized
    rejected = metrics.REGISTRY.get_sample_value(
        "pdserve_rejected_messages_total",
        {"role": "prefill", "socket": "prefill_kv_control", "reason": FailureReason.UNAUTHORIZED},
    )
    assert rejected is not None and rejected >= 1  # exported, not only counted in memory
    sender, receiver = _ready_room(prefill, decode, 21)
    sender.send([1, 2], 8, AuxData(first_token_id=3, room_echo=21))
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.Success)


def test_write_error_fails_the_room_and_the_peer_recovers_after_backoff(pair):
    prefill, decode = pair
    sender, receiver = _ready_room(prefill, decode, 31)
    prefill.backend.fail_next_write = True
    sender.send([1, 2], 8, AuxData(first_token_id=3, room_echo=31))
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.Failed)
    assert sender.status.reason == FailureReason.WRITE_ERROR
    time.sleep(0.6)  # first back-off step
    sender2, receiver2 = _ready_room(prefill, decode, 32)
    sender2.send([1, 2], 8, AuxData(first_token_id=3, room_echo=32))
    drive([prefill, decode], lambda: receiver2.poll() is KVPoll.Success)


def test_a_partial_transfer_writes_only_the_pages_after_the_held_ones(pair):
    """The decode side holds the first 3 pages (its prefix cache): only pages 3.. move, into
    its destination pages in order, and nothing lands in any other page."""
    prefill, decode = pair
    room, tokens = 201, 21  # 6 pages, the last partial
    src = [10, 11, 12, 13, 14, 15]
    dst = [4, 9, 2]  # for source pages 13, 14, 15
    sender = prefill.create_sender(room, tokens)
    receiver = decode.create_receiver(room, prefill.control_endpoint)
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata(dst, num_held_pages=3)
    drive([prefill, decode], lambda: sender.poll() is KVPoll.WaitingForInput)
    assert sender.num_held_pages == 3
    for end in (6, 13, 17):  # chunks inside the held pages send nothing
        sender.send(src, end)
    sender.send(src, tokens, AuxData(first_token_id=5, room_echo=room))
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.Success)
    assert torch.equal(decode.pool.buffer[dst], prefill.pool.buffer[src[3:]])
    untouched = sorted(set(range(32)) - set(dst))
    assert torch.count_nonzero(decode.pool.buffer[untouched]) == 0
    assert sender.num_bytes == 3 * LAYOUT.bytes_per_page


def test_a_room_whose_every_page_is_held_moves_only_the_first_token(pair):
    """The decode side copied the whole prompt from another sample of it: no destination
    page, no page written, the TransferDone (first token) still arrives."""
    prefill, decode = pair
    room, tokens = 203, 21  # 6 pages
    sender = prefill.create_sender(room, tokens)
    receiver = decode.create_receiver(room, prefill.control_endpoint)
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata([], num_held_pages=6)
    drive([prefill, decode], lambda: sender.poll() is KVPoll.WaitingForInput)
    sender.send([], tokens, AuxData(first_token_id=7, room_echo=room))
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.Success)
    assert receiver.aux is not None and receiver.aux.first_token_id == 7
    assert sender.num_bytes == 0 and torch.count_nonzero(decode.pool.buffer) == 0


@pytest.mark.parametrize(
    ("held", "num_dst"),
    [(7, 0), (5, 0), (-1, 7), (2, 3)],  # 21 tokens: at most 6 held, and 6 - held destinations
)
def test_a_transfer_request_with_impossible_held_pages_fails_the_room(pair, held, num_dst):
    prefill, decode = pair
    sender = prefill.create_sender(202, 21)
    receiver = decode.create_receiver(202, prefill.control_endpoint)
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata(list(range(num_dst)), num_held_pages=held)
    drive([prefill, decode], lambda: sender.poll() is KVPoll.Failed)
    assert sender.status.failure_reason.startswith(FailureReason.BAD_REQUEST)
