"""Random mixes of what meets on a decode node at once: samples of one prompt (n > 1),
prompts sharing prefixes, priorities with preemption, the decode prefix cache, aborts at
any stage and a pool small enough to retract; the loopback P/D harness checks every page's
place after every step. Each request that finished equals its run alone (greedy: the
single-request reference; seeded: the same request ungrouped, without priority, on an idle
node), and at the end nothing is held. ``MIX_SEEDS=N`` runs N mixes (100 in the suite;
2 of them crashed a decode node before the partial-match split of decode_node/prefix_cache.py;
1,500 ran clean after it)."""

from __future__ import annotations

import os
import random

import pytest

from common import messages as msg
from tests.support.decode_harness import PD, greedy, prompt

CACHE = {"disaggregation_decode_enable_radix_cache": True}
SAMPLING = ("max_new_tokens", "temperature", "seed", "frequency_penalty", "presence_penalty")


def _needs_a_run_alone(r: dict) -> bool:
    """Sampled or penalized: the single-request greedy reference does not apply."""
    return "seed" in r or "frequency_penalty" in r


def _requests(rng: random.Random) -> list[dict]:
    """Requests as the gateway would send them: a group's samples share ids and group."""
    bases = [prompt(24, 700 + i) for i in range(3)]
    reqs: list[dict] = []
    for p in range(rng.randint(6, 9)):
        head = rng.choice(bases)[: rng.choice([0, 4, 8, 12, 16, 24])]
        ids = head + prompt(rng.choice([1, 2, 4, 5, 9]), 800 + p)
        n = rng.choice([1, 1, 2, 3, 4])
        sampling: dict = {"max_new_tokens": rng.randint(4, 20)}
        if rng.random() < 0.5:
            sampling |= {"temperature": 0.9, "seed": 1000 * p}
        if rng.random() < 0.25:
            sampling |= {"frequency_penalty": 0.5, "presence_penalty": 0.3}
        extra = {"priority": rng.choice([None, 0, 50, 100]), "cache_salt": rng.choice([None, "t"])}
        for i in range(n):
            group = {"sample_group": f"g{p}", "num_group_samples": n} if n > 1 else {}
            own = dict(sampling, seed=sampling["seed"] + i) if "seed" in sampling else sampling
            reqs.append({"rid": f"r{p}.{i}", "ids": ids, **own, **extra, **group})
    return reqs


@pytest.mark.parametrize("seed", range(int(os.environ.get("MIX_SEEDS", "100"))))
def test_a_random_mix_of_groups_priorities_aborts_and_retraction(model_dir, ref, seed):
    rng = random.Random(seed)
    flags = dict(CACHE) if rng.random() < 0.5 else {}
    if rng.random() < 0.6:
        flags |= {
            "enable_priority_scheduling": True,
            "priority_scheduling_preemption_threshold": 10,
        }
    h = PD(model_dir, decode_pages=rng.randint(24, 40), num_reserved_decode_tokens=4, **flags)
    try:
        reqs = _requests(rng)
        aborted = set(rng.sample([r["rid"] for r in reqs], k=rng.randint(0, 2)))
        rooms = {r["rid"]: 2000 + k for k, r in enumerate(reqs)}
        pending = list(reqs)
        # steps after its submission, and which node hears it (the gateway tells both)
        abort_at = {
            rid: (rng.randint(0, 12), rng.choice(["decode", "prefill", "both"])) for rid in aborted
        }
        submitted: dict[str, int] = {}
        step = 0
        while pending or not h.done(*rooms):
            while pending and rng.random() < 0.5:
                r = pending.pop(0)
                fields = {k: v for k, v in r.items() if k not in ("rid", "ids")}
                h.submit(r["rid"], rooms[r["rid"]], r["ids"], **fields)
                submitted[r["rid"]] = step
            for rid, (at, where) in abort_at.items():
                if submitted.get(rid) is not None and step - submitted[rid] == at:
                    if where != "prefill":
                        h.decode.abort(rid, None, "client gone")
                    if where != "decode":
                        h.prefill.abort(rid, None, "client gone")
            h.step()
            step += 1
            assert step < 5000, (
                "the mix did not finish",
                abort_at,
                [(r, h.state(r), h.prefill.states.get(r)) for r in rooms if not h.done(r)],
            )
        h.run_until(lambda: h.decode.is_idle(), timeout=10)
        d = h.decode
        assert d.stats.num_held_pages() == 0 and h.prefill.stats.num_held_pages() == 0
        cached = (
            d.prefix_cache.num_pages if "disaggregation_decode_enable_radix_cache" in flags else 0
        )
        assert d.prefix_cache.tree.num_protected_pages == 0
        assert h.runner.pool.allocator.num_used_pages == cached
        for r in reqs:
            end = h.result(r["rid"])
            if r["rid"] in aborted and isinstance(end, msg.ReqFailed):
                continue
            assert isinstance(end, msg.ReqFinished), (r["rid"], end)
            if not _needs_a_run_alone(r):
                assert h.tokens(r["rid"]) == greedy(ref, r["ids"], r["max_new_tokens"]), r["rid"]
        for k, r in enumerate(x for x in reqs if _needs_a_run_alone(x) and x["rid"] not in aborted):
            alone = f"alone-{r['rid']}"
            sampling = {key: v for key, v in r.items() if key in SAMPLING}
            h.submit(alone, 5000 + k, r["ids"], cache_salt=r["cache_salt"], **sampling)
            h.run_until(lambda alone=alone: h.done(alone), timeout=60)
            assert h.tokens(r["rid"]) == h.tokens(alone), r["rid"]
    finally:
        h.close()
