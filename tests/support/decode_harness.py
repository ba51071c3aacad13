"""The decode loop in one process for unit tests: the real prefill loop, loopback KV
transfer and a tiny Llama (PD), with the helpers the decode tests share."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import torch
import zmq

from common import messages as msg
from common.config import DecodeConfig, ModelConfig, PrefillConfig
from common.ipc import bind_pull, recv_messages
from common.model.runner import ModelRunner
from decode_node.scheduler import DecodeScheduler
from prefill_node.scheduler import PrefillScheduler
from tests.unit.common.model.test_default_model import _greedy
from transfer.kv_manager import KVManager
from transfer.loopback_backend import LoopbackBackend

PAGE = 4
LEASE_S = 5.0
SMALL_CHUNKS = {"chunked_prefill_size": 8, "max_prefill_tokens": 8}
_ids = itertools.count()


class FakeTokenizer:
    """Stands in for the tiny model's tokenizer: token i reads as one letter, chr(97 + i % 26)."""

    def __init__(self, eos=()):
        self.eos_token_ids = frozenset(eos)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class ManualClock:
    def __init__(self):
        self.offset = 0.0

    def __call__(self):
        return time.monotonic() + self.offset


def greedy(runner, prompt, n):
    """Single-request reference: one extend, then a decode loop (no transfer, no batching)."""
    return _greedy(runner, prompt, n)


def prompt(n, seed):
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class PD:
    """A prefill loop and a decode loop wired by the loopback backend, plus a gateway socket."""

    def __init__(
        self, model_dir, decode_pages=64, prefill_pages=128, tokenizer=None, prefill_cfg=None, **cfg
    ):
        n = next(_ids)
        cfg.setdefault("num_reserved_decode_tokens", 8)
        self.config = DecodeConfig(model=ModelConfig(page_size=PAGE), **cfg)
        self.prefill_runner = ModelRunner.from_path(
            str(model_dir), progress=False, page_size=PAGE, num_pages=prefill_pages
        )
        self.runner = ModelRunner.from_path(
            str(model_dir), progress=False, page_size=PAGE, num_pages=decode_pages
        )
        ctx = zmq.Context.instance()
        self.kv_clock = ManualClock()
        self.pkv = KVManager(
            f"pd-p{n}",
            "prefill",
            LoopbackBackend(f"pd-p{n}"),
            self.prefill_runner.pool,
            backend_kind="loopback",
            lease_s=LEASE_S,
        )
        self.dkv = KVManager(
            f"pd-d{n}",
            "decode",
            LoopbackBackend(f"pd-d{n}"),
            self.runner.pool,
            backend_kind="loopback",
            lease_s=LEASE_S,
            clock=self.kv_clock,
        )
        p_sock, p_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
        d_sock, d_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
        self.reply_sock, self.reply_endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
        prefill_cfg = {"chunked_prefill_size": 64, "max_prefill_tokens": 256, **(prefill_cfg or {})}
        self.prefill = PrefillScheduler(
            PrefillConfig(model=ModelConfig(page_size=PAGE), **prefill_cfg),
            self.prefill_runner,
            self.pkv,
            p_sock,
            eos_token_ids=frozenset((tokenizer or FakeTokenizer()).eos_token_ids),
        )
        self.known_prefill_nodes = {"p"}
        self.decode = DecodeScheduler(
            self.config,
            self.runner,
            self.dkv,
            d_sock,
            tokenizer or FakeTokenizer(),
            lambda node: self.pkv.control_endpoint if node in self.known_prefill_nodes else None,
            prefill_lookup_timeout_s=1.0,
        )
        self.to_prefill, self.to_decode = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
        self.to_prefill.connect(p_endpoint)
        self.to_decode.connect(d_endpoint)
        self.replies: dict[str, list] = defaultdict(list)
        self.is_prefill_paused = False
        self.max_batch = 0

    def submit(
        self,
        rid,
        room,
        ids,
        *,
        to_prefill=True,
        prefill_node="p",
        priority=None,
        return_logprob=False,
        gateway_id="",
        output_ids=(),
        cache_salt=None,
        return_prompt_logprobs=False,
        sample_group="",
        num_group_samples=1,
        **sampling,
    ):
        g = msg.GenerateReq(
            rid=rid,
            room=room,
            input_ids=ids,
            sampling={"max_new_tokens": 8, "temperature": 0.0, **sampling},
            priority=priority,
            routing_key=None,
            prefill_node_id=prefill_node,
            decode_node_id="d",
            reply_endpoint=self.reply_endpoint,
            arrival_time=time.time(),
            return_logprob=return_logprob,
            gateway_id=gateway_id,
            output_ids=list(output_ids),
            cache_salt=cache_salt,
            return_prompt_logprobs=return_prompt_logprobs,
            sample_group=sample_group,
            num_group_samples=num_group_samples,
        )
        if to_prefill:
            self.to_prefill.send(msg.encode(g))
        self.to_decode.send(msg.encode(g))

    def step(self):
        if not self.is_prefill_paused:
            self.prefill.step()
        self.decode.step()
        self.max_batch = max(self.max_batch, len(self.decode.running))
        for m in recv_messages(self.reply_sock):
            self.replies[m.rid].append(m)
        self.decode.check_integrity()
        self.prefill.check_integrity()

    def run_until(self, cond, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not cond():
            self.step()
            assert time.monotonic() < deadline, "condition not reached"

    def tokens(self, rid):
        return [t for m in self.replies[rid] if isinstance(m, msg.TokenChunk) for t in m.token_ids]

    def result(self, rid):
        ends = [m for m in self.replies[rid] if isinstance(m, (msg.ReqFinished, msg.ReqFailed))]
        return ends[-1] if ends else None

    def first_result(self, rid):
        ends = [m for m in self.replies[rid] if isinstance(m, (msg.ReqFinished, msg.ReqFailed))]
        return ends[0] if ends else None

    def done(self, *rids):
        return all(self.result(r) is not None for r in rids)

    def state(self, rid):
        r = self.decode.reqs.get(rid)
        return r.state if r is not None else None

    def close(self):
        self.to_prefill.close(0)
        self.to_decode.close(0)
        self.decode.close()
        self.pkv.close()
        self.dkv.close()


def bare_req(rid, ids, priority=None, max_new_tokens=16):
    """A DecodeReq outside any loop, for unit tests of the queues and caches."""
    from common.sampling_params import SamplingParams
    from common.stop import StopChecker
    from decode_node.req import DecodeReq
    from tests.support.generate_req import generate_req

    g = generate_req(rid=rid, room=hash(rid) & 0xFFFF, input_ids=ids, priority=priority)
    stop = StopChecker(SamplingParams(), ())
    return DecodeReq(
        generate=g, sampling=SamplingParams(), stop=stop, max_new_tokens=max_new_tokens
    )


def spy_transfer_requests(h):
    """(room, held pages, destination pages) of each TransferRequest the decode node sends."""
    sent = []
    send = h.dkv.send_transfer_request

    def spy(receiver):
        sent.append((receiver.room, receiver.num_held_pages, len(receiver.dst_pages)))
        send(receiver)

    h.dkv.send_transfer_request = spy
    return sent


def assert_all_free(h):
    h.decode.check_integrity()
    assert h.decode.is_idle() and h.decode.stats.num_held_pages() == 0
    assert h.runner.pool.allocator.num_used_pages == 0
    assert h.prefill.stats.num_held_pages() == 0


class UnsafeReceiver:
    """A failed room whose writer may still be writing: its pages stay held until released."""

    def __init__(self):
        self.is_safe = False
        self.is_cleared = False

    def is_release_safe(self):
        return self.is_safe

    def clear(self):
        self.is_cleared = True
