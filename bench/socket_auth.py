"""Cost of CURVE on pdserve's zmq sockets: open PUSH/PULL vs CURVE (cluster keys, ZAP) side by side.

Through common.ipc (PushPool.send, recv_messages: msgpack encode and decode included), a
sender thread pushes N messages to a PULL socket in this process, with open sockets and
with CURVE (what every cluster with a token runs), alternating the two in each round.
Sizes: an AbortReq (~90 B, most control messages), a GenerateReq of a 1k-token prompt
(~3 KB) and of an 8k-token prompt (~25 KB). Prints the CPU, a table of microseconds per
message and the CURVE/open ratio, then one JSON line per case.
Usage: python bench/socket_auth.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zmq
from cpu_info import describe_cpu

from common import messages as msg
from common import socket_auth
from common.ipc import PushPool, bind_pull, close_pull, recv_messages


def _generate(num_tokens: int) -> msg.Message:
    return msg.GenerateReq(
        rid="r" * 32,
        room=123456789,
        input_ids=list(range(num_tokens)),
        sampling={"max_new_tokens": 128, "temperature": 0.7},
        priority=None,
        routing_key=None,
        prefill_node_id="prefill-0",
        decode_node_id="decode-0",
        reply_endpoint="tcp://10.0.0.1:5555",
        arrival_time=time.time(),
        return_logprob=False,
    )


CASES: dict[str, msg.Message] = {
    "abort_req": msg.AbortReq(node_id="prefill-0", room=123456789, rid="r" * 32, reason="client"),
    "generate_1k": _generate(1024),
    "generate_8k": _generate(8192),
}


def _run_ipc(message: msg.Message, n: int) -> float:
    """Microseconds per message, PushPool.send -> recv_messages, encode and decode included."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock, endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    push = PushPool(ctx)
    try:
        push.send(endpoint, message)  # connect and handshake before timing
        while not recv_messages(sock):
            time.sleep(0.001)
        t0 = time.perf_counter()

        def send_all() -> None:
            for _ in range(n):
                while not push.send(endpoint, message):
                    time.sleep(0)

        sender = threading.Thread(target=send_all)
        sender.start()
        got = 0
        while got < n:
            batch = recv_messages(sock, max_frames=512)
            got += len(batch)
            if not batch:
                sock.poll(100)
        sender.join()
        return (time.perf_counter() - t0) / n * 1e6
    finally:
        push.close()
        close_pull(sock)
        socket_auth.current().stop()
        ctx.destroy(linger=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n = 5_000 if args.quick else 20_000
    rounds = 3 if args.quick else 5
    print(f"cpu: {describe_cpu()}")
    print(f"{'message':<12} {'bytes':>7} {'open us/msg':>12} {'curve us/msg':>13} {'ratio':>6}")
    lines = []
    for name, message in CASES.items():
        size = len(msg.encode(message))
        times: dict[str, list[float]] = {"open": [], "curve": []}
        for _ in range(rounds):
            for mode in ("open", "curve"):
                socket_auth.configure("bench-token" if mode == "curve" else None)
                times[mode].append(_run_ipc(message, n))
        socket_auth.configure(None)
        open_us, curve_us = statistics.median(times["open"]), statistics.median(times["curve"])
        print(f"{name:<12} {size:>7} {open_us:>12.2f} {curve_us:>13.2f} {curve_us / open_us:>6.2f}")
        lines.append(
            {
                "bench": "socket_auth",
                "message": name,
                "bytes": size,
                "open_us": round(open_us, 3),
                "curve_us": round(curve_us, 3),
                "ratio_curve_vs_open": round(curve_us / open_us, 3),
                "extra_us": round(curve_us - open_us, 3),
            }
        )
    for line in lines:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
