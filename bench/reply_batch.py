"""One reply frame per decode step per gateway: 128 TokenChunks sent one by one vs one ReplyBatch.

A decode step at batch B sends each request's new token to its gateway. Here a sender
sends B TokenChunks per step to one PULL socket in this process, either one frame each
(PushPool.send, what the decode node did) or held in decode_node.outbox.Outbox and flushed
as one ReplyBatch; the two alternate in each round. Per step it times the sender (the
sends and the flush: what sits on the decode step's critical path) and the receiver
(recv_messages: zmq receive, msgpack decode and validation; what the gateway's reply
thread spends). Payloads: a TokenChunk without logprobs and one with a logprob and 2 top
logprobs; sockets open and CURVE (what every cluster with a token runs).
Prints the CPU, a table of microseconds per step and the one-by-one/batch ratios, then
one JSON line per case.
Usage: python bench/reply_batch.py [--quick] [--batch 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zmq
from cpu_info import describe_cpu

from common import messages as msg
from common import socket_auth
from common.ipc import PushPool, Socket, bind_pull, close_pull, recv_messages
from decode_node.outbox import Outbox

MODES = ("one_by_one", "batch")


def _chunks(batch: int, has_logprobs: bool) -> list[msg.TokenChunk]:
    return [
        msg.TokenChunk(
            rid=f"cmpl-{i:032x}",
            token_ids=[1000 + i],
            logprobs=[-0.5] if has_logprobs else None,
            top_logprobs=[[[1000 + i, -0.5], [7, -1.5]]] if has_logprobs else None,
        )
        for i in range(batch)
    ]


def _receive(sock: Socket, count: int) -> float:
    """Seconds spent in recv_messages until ``count`` messages came (waits are not timed)."""
    spent, got = 0.0, 0
    while got < count:
        sock.poll(1000)
        t0 = time.perf_counter()
        got += len(recv_messages(sock, socket_name="bench_replies"))
        spent += time.perf_counter() - t0
    return spent


def _run(mode: str, chunks: list[msg.TokenChunk], steps: int) -> tuple[float, float]:
    """Microseconds per step: (sender, receiver)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock, endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    push = PushPool(ctx)
    outbox = Outbox(push)
    send: Callable[[], None]
    if mode == "one_by_one":

        def send() -> None:
            for chunk in chunks:
                push.send(endpoint, chunk)
    else:

        def send() -> None:
            for chunk in chunks:
                outbox.send(endpoint, chunk)
            outbox.flush()

    try:
        push.send(endpoint, chunks[0])  # connect and handshake before timing
        _receive(sock, 1)
        sender = receiver = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            send()
            sender += time.perf_counter() - t0
            receiver += _receive(sock, len(chunks))
        return sender / steps * 1e6, receiver / steps * 1e6
    finally:
        outbox.close()
        close_pull(sock)
        socket_auth.current().stop()
        ctx.destroy(linger=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=128, help="TokenChunks per decode step")
    args = ap.parse_args()
    steps = 100 if args.quick else 400
    rounds = 3 if args.quick else 5
    print(f"cpu: {describe_cpu()}")
    print(f"batch {args.batch} TokenChunks per step, {steps} steps x {rounds} rounds, medians")
    header = f"{'payload':<9} {'sockets':<7} {'side':<8} {'1-by-1 us/step':>15}"
    print(f"{header} {'batch us/step':>14} {'ratio':>6} {'1-by-1 us/msg':>14}")
    lines = []
    for has_logprobs in (False, True):
        payload = "logprobs" if has_logprobs else "plain"
        chunks = _chunks(args.batch, has_logprobs)
        for security in ("open", "curve"):
            socket_auth.configure("bench-token" if security == "curve" else None)
            times: dict[str, dict[str, list[float]]] = {
                m: {"sender": [], "receiver": []} for m in MODES
            }
            for _ in range(rounds):
                for mode in MODES:
                    sender, receiver = _run(mode, chunks, steps)
                    times[mode]["sender"].append(sender)
                    times[mode]["receiver"].append(receiver)
            socket_auth.configure(None)
            for side in ("sender", "receiver"):
                one = statistics.median(times["one_by_one"][side])
                batch = statistics.median(times["batch"][side])
                print(
                    f"{payload:<9} {security:<7} {side:<8} {one:>15.1f} {batch:>14.1f}"
                    f" {one / batch:>6.2f} {one / args.batch:>14.2f}"
                )
                lines.append(
                    {
                        "bench": "reply_batch",
                        "payload": payload,
                        "sockets": security,
                        "side": side,
                        "batch": args.batch,
                        "one_by_one_us_per_step": round(one, 2),
                        "batch_us_per_step": round(batch, 2),
                        "ratio_one_by_one_vs_batch": round(one / batch, 3),
                        "one_by_one_us_per_msg": round(one / args.batch, 3),
                        "batch_us_per_msg": round(batch / args.batch, 3),
                    }
                )
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
