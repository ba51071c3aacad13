"""Peers are processes, not names: a restarted prefill or decode node is noticed.

It is then handshaken anew.
"""

from __future__ import annotations

import socket
import time

import torch
import zmq

from common import messages as msg
from common.kv_pool import KVLayout, KVPool
from tests.support.kv_managers import drive
from transfer.kv_manager import KVManager
from transfer.kv_poll import FailureReason, KVPoll
from transfer.kv_receiver import KVReceiver
from transfer.kv_sender import AuxData, KVSender
from transfer.loopback_backend import LoopbackBackend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, dtype="float32")


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _manager(name: str, role: str, endpoint: str = "tcp://127.0.0.1:0") -> KVManager:
    pool = KVPool(LAYOUT, 16)
    pool.buffer.copy_(torch.randn_like(pool.buffer))
    deadline = time.monotonic() + 5
    while True:  # a port just closed by the old process may take a moment to free
        backend = LoopbackBackend(name)
        try:
            return KVManager(
                name,
                role,
                backend,
                pool,
                backend_kind="loopback",
                control_endpoint=endpoint,
                lease_s=5.0,
            )
        except zmq.ZMQError:
            backend.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _granted(prefill: KVManager, decode: KVManager, room: int) -> tuple[KVSender, KVReceiver]:
    """A room both sides know, its destination pages sent and its first lease granted."""
    sender = prefill.create_sender(room, 8)
    receiver = decode.create_receiver(room, prefill.control_endpoint)
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.WaitingForInput)
    receiver.send_metadata([room % 8, room % 8 + 8])
    drive([prefill, decode], lambda: sender.fence.has_grant)
    return sender, receiver


def _transfer(prefill: KVManager, decode: KVManager, room: int) -> None:
    sender, receiver = _granted(prefill, decode, room)
    sender.send([1, 2], 8, AuxData(first_token_id=3, room_echo=room))
    drive([prefill, decode], lambda: receiver.poll() is KVPoll.Success)
    assert torch.equal(decode.pool.buffer[[room % 8, room % 8 + 8]], prefill.pool.buffer[[1, 2]])


def test_the_first_transfer_after_a_prefill_restart_on_the_same_address_succeeds():
    endpoint = _free_endpoint()
    prefill = _manager("rp", "prefill", endpoint)
    decode = _manager("rd", "decode")
    try:
        _transfer(prefill, decode, 1)
        old_instance = prefill.instance_id
        prefill.close()  # kill -9 and a restart: same node id, address and name, new process
        prefill = _manager("rp", "prefill", endpoint)
        assert prefill.instance_id != old_instance
        # The decode node still holds a READY peer for the old process; the new one does
        # not know it, answers PeerReset, and the room goes through after a new handshake.
        _transfer(prefill, decode, 2)
        assert prefill.metrics.num_dropped["unknown_peer"] == 1
        assert decode.peers[endpoint].instance_id == prefill.instance_id
    finally:
        prefill.close()
        decode.close()


def test_a_restarted_decode_node_fails_the_rooms_of_its_old_process():
    prefill = _manager("rp2", "prefill")
    decode = _manager("rd2", "decode")
    try:
        sender, _ = _granted(prefill, decode, 5)
        decode.close()
        decode = _manager("rd2", "decode")  # same node id, a new process and pool
        _transfer(prefill, decode, 6)  # its hello names another instance
        assert sender.poll() is KVPoll.Failed
        assert sender.status.reason == FailureReason.PEER_RESTARTED
    finally:
        prefill.close()
        decode.close()


def test_control_messages_naming_another_instance_are_dropped():
    prefill = _manager("rp3", "prefill")
    decode = _manager("rd3", "decode")
    try:
        sender, receiver = _granted(prefill, decode, 7)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 1000)
        push.connect(decode.control_endpoint)
        # A process that took the prefill node's name (but is not the one we shook hands
        # with) claims the room is done and failed: neither is believed.
        for fake in (
            msg.TransferDone(
                room=7,
                node_id="rp3",
                first_token_id=1,
                first_logprob=None,
                top_logprobs=[],
                room_echo=7,
                num_pages=2,
                instance_id="impostor",
            ),
            msg.TransferFailed(room=7, node_id="rp3", reason="x", instance_id="impostor"),
        ):
            push.send(msg.encode(fake))
        push.close()
        drive([decode], lambda: decode.metrics.num_dropped["unexpected_message"] == 2)
        assert receiver.poll() is KVPoll.Transferring and not receiver.is_abort_acked
        sender.send([1, 2], 8, AuxData(first_token_id=3, room_echo=7))
        drive([prefill, decode], lambda: receiver.poll() is KVPoll.Success)
    finally:
        prefill.close()
        decode.close()
