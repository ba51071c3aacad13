"""The prefill loop in one process for unit tests: the scheduler with a tiny Llama, real
zmq sockets and a loopback KV transfer to a test receiver (a decode-side KVManager)."""

from __future__ import annotations

import itertools
import time

import torch
import zmq

from common import messages as msg
from common.config import ModelConfig, PrefillConfig
from common.ipc import bind_pull, recv_messages
from common.kv_pool import KVPool, pages_needed
from common.model.runner import ExtendRequest, ModelRunner
from prefill_node.scheduler import PrefillScheduler
from tests.support.tolerance import assert_close_scaled
from transfer.kv_manager import KVManager
from transfer.kv_poll import KVPoll
from transfer.loopback_backend import LoopbackBackend

PAGE = 4
_ids = itertools.count()


class Harness:
    def __init__(self, model_dir, num_pages=64, **cfg):
        n = next(_ids)
        cfg.setdefault("chunked_prefill_size", 64)
        cfg.setdefault("max_prefill_tokens", 256)
        self.config = PrefillConfig(model=ModelConfig(page_size=PAGE), **cfg)
        self.runner = ModelRunner.from_path(
            str(model_dir), progress=False, page_size=PAGE, num_pages=num_pages
        )
        self.ref = ModelRunner.from_path(
            str(model_dir), progress=False, page_size=PAGE, num_pages=num_pages
        )
        ctx = zmq.Context.instance()
        self.kv = KVManager(
            f"p{n}",
            "prefill",
            LoopbackBackend(f"p{n}"),
            self.runner.pool,
            backend_kind="loopback",
            lease_s=5,
        )
        self.dpool = KVPool(self.runner.layout, num_pages)
        self.decode = KVManager(
            f"d{n}",
            "decode",
            LoopbackBackend(f"d{n}"),
            self.dpool,
            backend_kind="loopback",
            lease_s=5,
        )
        self.req_sock, self.req_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
        self.reply_sock, self.reply_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
        self.sched = PrefillScheduler(self.config, self.runner, self.kv, self.req_sock)
        self.push = ctx.socket(zmq.PUSH)
        self.push.connect(self.req_endpoint)
        self.replies: list = []

    def submit(self, rid, room, ids, **kw):
        sampling = {"max_new_tokens": 8, "temperature": 0.0}
        self.push.send(
            msg.encode(
                msg.GenerateReq(
                    rid=rid,
                    room=room,
                    input_ids=ids,
                    sampling=kw.pop("sampling", sampling),
                    priority=kw.pop("priority", None),
                    routing_key=None,
                    prefill_node_id="p",
                    decode_node_id="d",
                    reply_endpoint=self.reply_endpoint,
                    arrival_time=time.time(),
                    return_logprob=False,
                    cache_salt=kw.pop("cache_salt", None),
                    return_prompt_logprobs=kw.pop("return_prompt_logprobs", False),
                    sample_group=kw.pop("sample_group", ""),
                    num_group_samples=kw.pop("num_group_samples", 1),
                )
            )
        )

    def receive(self, room, num_tokens, *, holds_all=False):
        """A decode side for the room; ``holds_all``: it holds every page already (a copy
        from another sample of the prompt) and asks for the first token alone."""
        r = self.decode.create_receiver(room, self.kv.control_endpoint)
        self.run_until(lambda: r.poll() is KVPoll.WaitingForInput)
        if holds_all:
            r.send_metadata([], num_held_pages=pages_needed(num_tokens, PAGE))
            return r, []
        pages = self.dpool.allocator.allocate(pages_needed(num_tokens, PAGE))
        r.send_metadata(pages)
        return r, pages

    def run_until(self, cond, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not cond():
            self.sched.step()
            self.decode.poll()
            self.replies += recv_messages(self.reply_sock)
            assert time.monotonic() < deadline, "condition not reached"

    def reference(self, ids):
        pages = self.ref.pool.allocator.allocate(pages_needed(len(ids), PAGE))
        out = self.ref.extend([ExtendRequest(ids, 0, pages)])
        kv = self.ref.pool.buffer[pages].clone()
        self.ref.pool.allocator.free(pages)
        return kv, int(out.logits[0].argmax())

    def close(self):
        self.push.close(0)
        self.kv.close()
        self.decode.close()


def prompt(n, seed):
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_landed(h, receiver, pages, ids):
    kv, first = h.reference(ids)
    assert receiver.aux.first_token_id == first and receiver.aux.room_echo == receiver.room
    lay = h.runner.layout

    def tokens(pages_kv):  # [pages, L, 2, ps, kvh, hd] -> [L, 2, tokens, kvh * hd]
        flat = pages_kv.permute(1, 2, 0, 3, 4, 5).reshape(
            lay.num_layers, 2, -1, lay.num_kv_heads * lay.head_dim
        )
        return flat[:, :, : len(ids)]  # the tail of the last page holds no token

    assert_close_scaled(tokens(h.dpool.buffer[pages]), tokens(kv))
