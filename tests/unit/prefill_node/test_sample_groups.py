"""prefill_node/sample_groups.py: which samples take the first one's logits, and for how
long they are kept."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from prefill_node.request import Req
from prefill_node.sample_groups import SampleGroups


def sample(group: str, ids: list[int], *, n: int = 3, held_all: bool = True, salt=None, out=()):
    """What the stash reads of a PrefillReq: its request, GenerateReq and sender."""
    req = Req("r", 0, ids, max_new_tokens=1, cache_salt=salt)
    generate = SimpleNamespace(sample_group=group, num_group_samples=n, output_ids=list(out))
    sender = SimpleNamespace(dst_pages=[] if held_all else [5], num_held_pages=2)
    return SimpleNamespace(req=req, generate=generate, sender=sender)


def test_the_other_samples_take_a_copy_of_the_first_ones_logits_then_it_is_dropped():
    groups = SampleGroups()
    logits = torch.arange(6.0).reshape(1, 6)
    groups.keep(sample("g", [1, 2, 3]), logits, now=0.0)
    logits += 100  # kept is a copy
    first = groups.take(sample("g", [1, 2, 3]), now=1.0)
    assert first is not None and first.tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    first += 7  # a sampler may change its logits in place: the next sample is unaffected
    second = groups.take(sample("g", [1, 2, 3]), now=2.0)
    assert second is not None and second.tolist() == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]]
    assert len(groups) == 0  # n = 3: both others took them
    assert groups.take(sample("g", [1, 2, 3]), now=2.0) is None


def test_a_sample_takes_nothing_unless_its_decode_node_holds_every_page_of_the_same_prompt():
    groups = SampleGroups()
    groups.keep(sample("g", [1, 2, 3], n=8), torch.zeros(1, 4), now=0.0)
    assert groups.take(sample("g", [1, 2, 3], held_all=False), now=0.0) is None
    assert groups.take(sample("g", [1, 2, 4]), now=0.0) is None  # another prompt
    assert groups.take(sample("g", [1, 2, 3], salt="s"), now=0.0) is None  # another salt
    assert groups.take(sample("h", [1, 2, 3]), now=0.0) is None  # another group
    assert groups.take(sample("g", [1, 2, 3], out=[9]), now=0.0) is None  # migrated
    assert groups.take(sample("g", [1, 2, 3]), now=0.0) is not None


def test_nothing_is_kept_for_a_lone_sample_a_migrated_one_or_twice_per_group():
    groups = SampleGroups()
    groups.keep(sample("", [1, 2]), torch.zeros(1, 4), now=0.0)
    groups.keep(sample("g", [1, 2], n=1), torch.zeros(1, 4), now=0.0)
    groups.keep(sample("m", [1, 2], out=[3]), torch.zeros(1, 4), now=0.0)
    assert len(groups) == 0
    groups.keep(sample("g", [1, 2]), torch.zeros(1, 4), now=0.0)
    groups.keep(sample("g", [1, 2]), torch.ones(1, 4), now=0.0)  # a second prefill of it
    taken = groups.take(sample("g", [1, 2]), now=0.0)
    assert taken is not None and taken.sum() == 0


def test_logits_are_kept_for_keep_s_and_for_at_most_max_groups():
    groups = SampleGroups(keep_s=10.0, max_groups=2)
    groups.keep(sample("a", [1]), torch.zeros(1, 4), now=0.0)
    assert groups.take(sample("a", [1]), now=10.0) is None  # expired
    for name, now in (("b", 1.0), ("c", 2.0), ("d", 3.0)):
        groups.keep(sample(name, [1]), torch.zeros(1, 4), now=now)
    assert len(groups) == 2
    assert groups.take(sample("b", [1]), now=4.0) is None  # the oldest made room
    assert groups.take(sample("d", [1]), now=4.0) is not None
