"""Accuracy parity: served greedy outputs and logprobs against the single-process reference.

Natural-language prompts (tests/data/parity_prompts.txt) matter here: a wrong KV (a page
reused after an abort, a stale prefix, a transfer into the wrong page) turns a model's
answer into different text, while on random token ids a right and a wrong KV both yield
noise. The reference is the built-in model in float32 in this process, one request at a
time (common/launch/offline.py), with the logprobs a node reports.

How outputs are compared:
- token ids equal; a served output may part from the reference only where the
  reference's best two tokens were within ``TIE_GAP`` (a near tie, which float32 sums in
  another order can break the other way); such a part is counted, and the tokens after
  it are not compared;
- logprobs equal within ``tol`` over the tokens compared (float32 matrix products sum in
  a different order in a batch of another shape: about 1e-5 here; a wrong KV moves them by
  whole units).

Used by tests/integration/test_parity.py (a short run in `make test`) and bench/parity.py
(the 500-prompt run).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "data" / "parity_prompts.txt"
TIE_GAP = 1e-3  # reference top-1 minus top-2 logprob below which a part is a near tie
LOGPROB_TOL = 1e-3


def load_prompts(num: int | None = None) -> list[str]:
    lines = PROMPTS_FILE.read_text().splitlines()
    prompts = [line for line in lines if line.strip() and not line.startswith("#")]
    return prompts if num is None else prompts[:num]


@dataclass
class Answer:
    """One greedy output: its token ids and each token's logprob."""

    token_ids: list[int]
    logprobs: list[float]
    gaps: list[float] = field(default_factory=list)  # reference only: top-1 minus top-2


def references(prompts: Sequence[str], max_new_tokens: int) -> list[Answer]:
    """Greedy float32 outputs of the built-in model in this process, one prompt at a time."""
    from common.launch.offline import OfflineResult, generate_stream
    from common.model.default_model import default_model_dir
    from common.model.runner import ModelRunner
    from common.sampling_params import SamplingParams
    from common.tokenizer import Tokenizer

    runner = ModelRunner.from_path(None, progress=False, dtype="float32", max_total_tokens=2048)
    runner.warmup()
    tok = Tokenizer.from_pretrained(default_model_dir())
    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
    )
    out = []
    for prompt in prompts:
        result = list(generate_stream(runner, tok, tok.encode(prompt), params))[-1]
        assert isinstance(result, OfflineResult) and result.logprobs is not None
        tops = result.top_logprobs or []
        gaps = [t[0][1] - t[1][1] if len(t) > 1 else float("inf") for t in tops]
        out.append(Answer(result.token_ids, result.logprobs, gaps))
    return out


def generate(api: str, prompt: str, max_new_tokens: int, timeout_s: float = 600) -> Answer:
    """One greedy /generate through the gateway, with logprobs."""
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    req = urllib.request.Request(
        api + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        out = json.loads(resp.read())
    logprobs = [float(lp) for lp, _tid, _ in out["meta_info"]["output_token_logprobs"]]
    return Answer(list(out["output_ids"]), logprobs)


def serve_all(
    api: str,
    prompts: Sequence[str],
    max_new_tokens: int,
    concurrency: int,
    on_done: Callable[[int], None] | None = None,
) -> list[Answer | str]:
    """Every prompt through the gateway, ``concurrency`` at a time; an error as its text."""
    results: list[Answer | str] = ["not run"] * len(prompts)
    next_index = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_index, None)
            if i is None:
                return
            try:
                results[i] = generate(api, prompts[i], max_new_tokens)
            except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
                detail = exc.read()[:300] if isinstance(exc, urllib.error.HTTPError) else b""
                results[i] = f"{type(exc).__name__}: {exc} {detail!r}"
            if on_done is not None:
                on_done(i)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@dataclass
class Verdict:
    num: int = 0
    num_equal: int = 0  # every token id equal
    num_tie_parts: int = 0  # parted from the reference at a near tie
    tokens_compared: int = 0
    max_logprob_diff: float = 0.0
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)  # parted where no tie explains it

    @property
    def is_ok(self) -> bool:
        return not self.errors and not self.mismatches

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.num,
            "ids_equal": self.num_equal,
            "parted_at_near_tie": self.num_tie_parts,
            "tokens_compared": self.tokens_compared,
            "max_abs_logprob_diff": self.max_logprob_diff,
            "errors": len(self.errors),
            "mismatches": len(self.mismatches),
        }


def compare(
    served: Sequence[Answer | str], refs: Sequence[Answer], tol: float = LOGPROB_TOL
) -> Verdict:
    verdict = Verdict(num=len(served))
    for i, (got, ref) in enumerate(zip(served, refs, strict=True)):
        if isinstance(got, str):
            verdict.errors.append(f"#{i}: {got}")
            continue
        same = 0
        while (
            same < min(len(got.token_ids), len(ref.token_ids))
            and got.token_ids[same] == ref.token_ids[same]
        ):
            same += 1
        if got.token_ids == ref.token_ids:
            verdict.num_equal += 1
        elif same < len(ref.gaps) and ref.gaps[same] <= TIE_GAP and same < len(got.token_ids):
            verdict.num_tie_parts += 1
        else:
            verdict.mismatches.append(
                f"#{i}: parted at token {same} (reference gap "
                f"{ref.gaps[same] if same < len(ref.gaps) else 'n/a'}): "
                f"{got.token_ids[same : same + 4]} vs {ref.token_ids[same : same + 4]}"
            )
            continue
        diffs = [abs(a - b) for a, b in zip(got.logprobs[:same], ref.logprobs[:same], strict=True)]
        verdict.tokens_compared += len(diffs)
        worst = max(diffs, default=0.0)
        verdict.max_logprob_diff = max(verdict.max_logprob_diff, worst)
        if worst > tol:
            verdict.mismatches.append(f"#{i}: a logprob differs by {worst:.2e} (> {tol:.0e})")
    return verdict
