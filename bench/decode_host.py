"""The decode step's host work per step, this tree against a baseline revision side by side.

What the host does for one decode step of B running requests with C-token contexts, with the
device's work taken out (the graph replay / forward returns ready logits at once): the
running batch's step as the decode node runs it (each request's next page when it needs
one, the step's inputs: its page table and span checks, or its decode slots; the sampler;
its tokens back on the host) and the gateway's messages for the step's tokens (one zmq send
per request, or one ReplyBatch per gateway). A tiny model (one layer, a 32-token vocabulary)
on the CPU keeps everything else negligible; the page table is as wide as C tokens need, in
16-token pages. The baseline runs the same measurement in a git worktree of --baseline
(default: the commit before this work, bcfab82), through this file, in a subprocess: the
two columns come from the same machine in the same run. (Past 32k tokens the baseline ran
decode without its graph buffers, its forward included: compare 2k and 8k.)

Prints the CPU, a table (batch, context, host ms per step, baseline's, ratio), then one
JSON line per point. Usage:
    python bench/decode_host.py [--batches 1 32 128] [--contexts 2048 8192] [--steps 48]
        [--baseline REV]
(bench/decode.py --host-time runs it.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
PAGE = 16
BASELINE = "bcfab82"  # main before the decode slots, overlap and ReplyBatch


def _spec(context: int):  # type: ignore[no-untyped-def]
    from common.model.spec import ModelSpec

    return ModelSpec.from_hf_config(
        dict(
            model_type="llama",
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=context + 1024,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
        )
    )


def _weights(spec):  # type: ignore[no-untyped-def]
    import torch

    h, q, kv, inter = spec.hidden_size, spec.num_heads * 8, spec.num_kv_heads * 8, 32
    p = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (spec.vocab_size, h),
        "model.norm.weight": (h,),
        p + "self_attn.q_proj.weight": (q, h),
        p + "self_attn.k_proj.weight": (kv, h),
        p + "self_attn.v_proj.weight": (kv, h),
        p + "self_attn.o_proj.weight": (h, q),
        p + "mlp.gate_proj.weight": (inter, h),
        p + "mlp.up_proj.weight": (inter, h),
        p + "mlp.down_proj.weight": (h, inter),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }
    return {k: torch.zeros(s) for k, s in shapes.items()}


def worker(batches: list[int], contexts: list[int], steps: int) -> list[dict]:
    """Host ms per step for each (batch, context), on the tree this process imports."""
    import torch
    import zmq

    from common import messages as msg
    from common.ipc import PushPool, bind_pull, recv_messages
    from common.model import cuda_graph
    from common.model.runner import ModelRunner
    from common.sampling_params import SamplingParams
    from decode_node import running_batch
    from decode_node.req import DecodeState
    from tests.support.decode_harness import bare_req

    torch.set_num_threads(1)
    is_new = hasattr(ModelRunner, "decode_slots")
    rows = []
    ctx = zmq.Context.instance()
    sink, endpoint = bind_pull(ctx, "tcp://127.0.0.1:0")
    for context in contexts:
        spec = _spec(context)
        max_bs = max(batches)
        pages_per = (context + steps) // PAGE + 2
        runner = ModelRunner(
            spec,
            _weights(spec),
            dtype="float32",
            page_size=PAGE,
            num_pages=max_bs * pages_per + 8,
            cuda_graph_max_bs=max_bs,
            pack_weights=False,
            cpu_kernels=False,
            attention_backend="torch",
            **({"max_decode_slots": max_bs} if is_new else {}),
        )

        def no_device(self, bs, *rest, **kw):  # the device's work, done at once
            return torch.zeros(bs, spec.vocab_size)

        cuda_graph.DecodeGraphs._forward = no_device  # type: ignore[method-assign]
        if not is_new:  # the baseline's GPU path: its graph buffers (numpy page table)
            runner.graphs = cuda_graph.DecodeGraphs(runner, max_bs, capture=False)
        for bs in batches:
            reqs = []
            for i in range(bs):
                r = bare_req(f"r{i}", [1] * context, max_new_tokens=steps + 8)
                r.sampling = SamplingParams(temperature=0.0)
                r.output_ids = [1]
                r.state = DecodeState.WAITING
                r.pages = runner.pool.allocator.allocate(-(-(context + 1) // PAGE))
                reqs.append(r)
            if is_new:
                from decode_node.outbox import Outbox
                from decode_node.transfer_queue import ReleaseQueue

                batch = running_batch.RunningBatch(
                    runner, max_bs, ReleaseQueue(runner.pool.allocator)
                )
                out = Outbox(PushPool(ctx))
            else:
                batch = running_batch.RunningBatch(runner, max_bs)
                out = PushPool(ctx)
            batch.admit(list(reqs))
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                if is_new:
                    step = batch.launch(runner.pool.allocator)
                    got = batch.results()
                    batch.sample(step)
                    got = got or batch.results()
                    rows_, sample = got
                else:
                    rows_, sample = batch.step(runner.pool.allocator)
                for r, t in zip(rows_, sample.token_ids):
                    r.output_ids.append(t)
                    chunk = msg.TokenChunk(
                        rid=r.rid, token_ids=[t], logprobs=None, top_logprobs=None
                    )
                    out.send(endpoint, chunk)
                if is_new:
                    out.flush()
                times.append(time.perf_counter() - t0)
                recv_messages(sink)
            for r in reqs:
                if is_new:
                    batch.remove(r)
                runner.pool.allocator.free(r.pages)
            out.close()
            recv_messages(sink)
            rows.append(
                {
                    "batch": bs,
                    "context": context,
                    "host_ms_per_step": round(1e3 * statistics.median(times[4:]), 3),
                }
            )
    return rows


def _baseline_rows(rev: str, args: argparse.Namespace) -> list[dict]:
    """The same worker on a git worktree of `rev` (its packages, this measurement)."""
    repo = HERE.parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "baseline"
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "add", "--detach", str(tree), rev],
            check=True,
            capture_output=True,
        )
        try:
            # its CPU kernels' built libraries are ignored files: reuse this tree's
            lib = repo / "common" / "model" / "cpu" / "lib"
            if lib.exists():
                os.symlink(lib, tree / "common" / "model" / "cpu" / "lib")
            done = subprocess.run(
                [
                    sys.executable,
                    str(HERE),
                    "--worker",
                    str(tree),
                    "--batches",
                    *map(str, args.batches),
                    "--contexts",
                    *map(str, args.contexts),
                    "--steps",
                    str(args.steps),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
        finally:
            subprocess.run(
                ["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)],
                check=False,
                capture_output=True,
            )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--baseline", default=BASELINE, help="git revision to compare against")
    ap.add_argument("--worker", metavar="ROOT", help=argparse.SUPPRESS)
    args = ap.parse_args()
    root = Path(args.worker) if args.worker else HERE.parent.parent
    sys.path[:] = [str(root), *(p for p in sys.path if Path(p or ".").resolve() != HERE.parent)]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        print(json.dumps(worker(args.batches, args.contexts, args.steps)))
        return 0
    sys.path.append(str(HERE.parent))
    from cpu_info import describe_cpu

    print(f"# {describe_cpu()}")
    ours = worker(args.batches, args.contexts, args.steps)
    base = _baseline_rows(args.baseline, args)
    print(f"{'batch':>5} {'context':>7} {'host ms':>8} {args.baseline + ' ms':>12} {'ratio':>6}")
    lines = []
    for new, old in zip(ours, base):
        ratio = old["host_ms_per_step"] / new["host_ms_per_step"]
        print(
            f"{new['batch']:>5} {new['context']:>7} {new['host_ms_per_step']:>8.3f} "
            f"{old['host_ms_per_step']:>12.3f} {ratio:>6.2f}"
        )
        lines.append(
            json.dumps(
                {
                    "bench": "decode_host",
                    **new,
                    "baseline": args.baseline,
                    "baseline_host_ms_per_step": old["host_ms_per_step"],
                    "speedup": round(ratio, 2),
                }
            )
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
