"""Structured output's price per decode step: TPOT with and without a JSON schema, same run.

Every row of a batch (1, 8, 32) answers the same chat prompt, prefilled once per row; then
a decode loop as the decode node runs it: runner.decode, Sampler.sample with the rows'
GrammarStates, GrammarState.accept per row, and rows leave the batch when their grammar
terminates. The plain loop is the same with no grammar; its rows leave at the lengths the
grammar run of the same round gave them, so both runs step the same batches. TPOT is the
median per-step wall time; grammar and plain runs alternate (G P G P, --rounds each), greedy
and sampled (temperature 0.7, seeded per row). Also the schema's compile time (cold on a
fresh GrammarBackend, then cached) and the TokenizerInfo's build, and the grammar outputs'
validity (json.loads + jsonschema; one cut at --max-tokens counts as invalid, as "cut").
Prints the CPU, a table, then one JSON line per (batch, variant) and one for compile times.
Usage: python bench/grammar.py [--batches 1 8 32] [--max-tokens 128] [--rounds 2]
       [--dtype float32] [--threads N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jsonschema  # type: ignore[import-untyped]  # noqa: E402
import torch  # noqa: E402
import xgrammar as xgr  # noqa: E402
from cpu_info import describe_cpu  # noqa: E402

from common.grammar.backend import GrammarBackend, GrammarState  # noqa: E402
from common.kv_pool import pages_needed  # noqa: E402
from common.model.default_model import default_model_dir  # noqa: E402
from common.model.runner import ExtendRequest, ModelRunner  # noqa: E402
from common.sampler import Sampler, make_generator  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from common.tokenizer import Tokenizer  # noqa: E402

PROMPT = "Describe a fictional person as JSON."
SCHEMA: dict = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 32},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"type": "string", "minLength": 1, "maxLength": 32},
        "mood": {"enum": ["happy", "calm", "curious", "grumpy"]},
        "hobbies": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 24},
            "minItems": 1,
            "maxItems": 3,
        },
        "is_student": {"type": "boolean"},
    },
    "required": ["name", "age", "occupation", "mood", "hobbies", "is_student"],
    "additionalProperties": False,
}
VARIANTS = {"greedy": 0.0, "sampled": 0.7}
PARTS = ("decode", "sample", "accept")


@dataclass
class Prefilled:
    """B rows of one prompt, prefilled once: their pages and the first token's logits."""

    prompt_len: int
    tables: list[list[int]]
    logits: torch.Tensor


@dataclass
class Run:
    """One decode loop: each row's output tokens and seconds per step (whole, and by part)."""

    outputs: list[list[int]]
    is_cut: list[bool]
    step_s: list[float] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PARTS})


def prefill(runner: ModelRunner, ids: list[int], batch: int, max_tokens: int) -> Prefilled:
    pages = pages_needed(len(ids) + max_tokens + 1, runner.page_size)
    tables = [runner.pool.allocator.allocate(pages) for _ in range(batch)]
    logits = runner.extend([ExtendRequest(ids, 0, t) for t in tables]).logits
    return Prefilled(len(ids), tables, logits.float().clone())


def decode_loop(
    runner: ModelRunner,
    pre: Prefilled,
    temperature: float,
    max_tokens: int,
    compiled: xgr.CompiledGrammar | None,
    lengths: list[int] | None = None,
) -> Run:
    """Decode every row until its grammar terminates (or, with no grammar, until it has its
    `lengths` tokens), max_tokens at most. The first token (the prefill node's) is untimed."""
    batch = len(pre.tables)
    sampler = Sampler()
    params = SamplingParams(max_new_tokens=max_tokens, temperature=temperature)
    sampled = temperature > 0
    generators = [make_generator(1000 + row) if sampled else None for row in range(batch)]
    states = [GrammarState(compiled) if compiled else None for _ in range(batch)]
    limits = lengths or [max_tokens] * batch
    run = Run([[] for _ in range(batch)], [False] * batch)

    def commit(rows: list[int], tokens: list[int]) -> list[int]:
        """Take one token per row; the rows still running."""
        still = []
        for row, token in zip(rows, tokens):
            state = states[row]
            if state is not None and not state.accept(token):
                raise RuntimeError(f"the grammar refused the sampled token {token}")
            run.outputs[row].append(token)
            if state is not None and state.is_terminated:
                continue
            if len(run.outputs[row]) >= limits[row]:
                run.is_cut[row] = state is not None
                continue
            still.append(row)
        return still

    first = sampler.sample(pre.logits.clone(), [params] * batch, generators, states)
    active = commit(list(range(batch)), first.token_ids)
    while active:
        t0 = time.perf_counter()
        logits = runner.decode(
            [run.outputs[r][-1] for r in active],
            [pre.prompt_len + len(run.outputs[r]) for r in active],
            [pre.tables[r] for r in active],
        )
        t1 = time.perf_counter()
        out = sampler.sample(
            logits,
            [params] * len(active),
            [generators[r] for r in active],
            [states[r] for r in active],
        )
        t2 = time.perf_counter()
        active = commit(active, out.token_ids)
        t3 = time.perf_counter()
        run.step_s.append(t3 - t0)
        for name, seconds in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2)):
            run.parts[name].append(seconds)
    return run


def compile_times(tokenizer: Tokenizer, vocab_size: int) -> tuple[dict, GrammarBackend]:
    """Milliseconds to build the backend (its TokenizerInfo), to compile the schema cold on
    it, and to get it again from its cache; and the backend."""
    t = time.perf_counter()
    backend = GrammarBackend.for_tokenizer(tokenizer, vocab_size)
    info_s = time.perf_counter() - t
    text = json.dumps(SCHEMA)
    times = []
    for _ in range(2):  # cold, then cached
        t = time.perf_counter()
        ticket = backend.submit("json_schema", text)
        while backend.poll(ticket) is None:
            time.sleep(1e-4)
        times.append(time.perf_counter() - t)
    ms = {"compile_cold_ms": times[0], "compile_cached_ms": times[1], "tokenizer_info_ms": info_s}
    return {"bench": "grammar", **{k: round(1e3 * v, 3) for k, v in ms.items()}}, backend


def check_outputs(tokenizer: Tokenizer, run: Run) -> tuple[int, int]:
    """(valid outputs, cut outputs) of a grammar run; prints every failure."""
    validator = jsonschema.Draft202012Validator(SCHEMA)
    valid = cut = 0
    for out, is_cut in zip(run.outputs, run.is_cut):
        text = tokenizer.decode(out)
        if is_cut:
            cut += 1
            print(f"# cut at {len(out)} tokens: {text!r}")
            continue
        try:
            validator.validate(json.loads(text))
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError) as e:
            print(f"# invalid ({type(e).__name__}: {str(e).splitlines()[0]}): {text!r}")
    return valid, cut


def _ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 3)


def measure(
    runner: ModelRunner,
    tokenizer: Tokenizer,
    compiled: xgr.CompiledGrammar,
    pre: Prefilled,
    variant: str,
    args: argparse.Namespace,
) -> dict:
    """Grammar and plain runs alternated, `args.rounds` each: one JSON row."""
    temperature = VARIANTS[variant]
    warm = decode_loop(runner, pre, temperature, 8, compiled)  # untimed: first-call costs
    decode_loop(runner, pre, temperature, 8, None, [len(o) for o in warm.outputs])
    plain: list[Run] = []
    grammar: list[Run] = []
    valid = cut = 0
    for _ in range(args.rounds):
        grammar.append(decode_loop(runner, pre, temperature, args.max_tokens, compiled))
        lengths = [len(o) for o in grammar[-1].outputs]
        plain.append(decode_loop(runner, pre, temperature, args.max_tokens, None, lengths))
        k, c = check_outputs(tokenizer, grammar[-1])
        valid, cut = valid + k, cut + c
    g_steps = [s for r in grammar for s in r.step_s]
    p_steps = [s for r in plain for s in r.step_s]
    lengths = [len(o) for r in grammar for o in r.outputs]
    return {
        "bench": "grammar",
        "batch": len(pre.tables),
        "variant": variant,
        "plain_ms_per_token": _ms(p_steps),
        "grammar_ms_per_token": _ms(g_steps),
        "ratio": round(statistics.median(g_steps) / statistics.median(p_steps), 3),
        "valid": valid,
        "cut": cut,
        "total": len(lengths),
        # the step's parts (medians): the forward, the sampler (grammar: bitmask fill and
        # apply), the accept and bookkeeping per row
        **{f"plain_{p}_ms": _ms([s for r in plain for s in r.parts[p]]) for p in PARTS},
        **{f"grammar_{p}_ms": _ms([s for r in grammar for s in r.parts[p]]) for p in PARTS},
        "steps": len(g_steps),
        "mean_output_tokens": round(statistics.mean(lengths), 1),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--max-tokens", type=int, default=128, help="per row; a grammar output cut here is invalid"
    )
    ap.add_argument("--rounds", type=int, default=2, help="grammar and plain runs per point")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="batches 1 and 8, 1 round, no kernel choice at warm-up (the smoke test)",
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.rounds = [1, 8], 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"cpu: {describe_cpu()}; torch threads: {torch.get_num_threads()}")
    pages = pages_needed(args.max_tokens + 64, 16) + 1
    runner = ModelRunner.from_path(
        None,
        progress=False,
        dtype=args.dtype,
        max_total_tokens=max(args.batches) * pages * 16,
    )
    if not args.quick:
        runner.warmup()  # as a node: the product kernels chosen and fixed (~90 s on 2 cores)
    tokenizer = Tokenizer.from_pretrained(default_model_dir())
    compile_row, backend = compile_times(tokenizer, runner.spec.vocab_size)
    compiled = backend.poll(backend.submit("json_schema", json.dumps(SCHEMA)))
    assert compiled is not None
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    rows = []
    for batch in args.batches:
        pre = prefill(runner, ids, batch, args.max_tokens)
        try:
            rows += [measure(runner, tokenizer, compiled, pre, v, args) for v in VARIANTS]
        finally:
            for t in pre.tables:
                runner.pool.allocator.free(t)
    backend.close()
    print(f"{'batch':>5} {'variant':>8} {'plain ms/tok':>13} {'grammar ms/tok':>15} ratio  valid")
    for r in rows:
        share = f"{r['valid']}/{r['total']}" + (f" ({r['cut']} cut)" if r["cut"] else "")
        print(
            f"{r['batch']:5d} {r['variant']:>8} {r['plain_ms_per_token']:13.2f} "
            f"{r['grammar_ms_per_token']:15.2f} {r['ratio']:6.3f} {share}"
        )
    print(
        f"compile: cold {compile_row['compile_cold_ms']:.1f} ms, cached "
        f"{compile_row['compile_cached_ms']:.3f} ms; TokenizerInfo "
        f"{compile_row['tokenizer_info_ms']:.1f} ms"
    )
    for r in [*rows, compile_row]:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
