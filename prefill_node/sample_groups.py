"""The samples of one prompt (n > 1, best_of) computed once on the prefill node.

The gateway sends a prompt's samples as separate requests of one sample group
(GenerateReq.sample_group) to one pair. The first of them to finish its prefill leaves its
last position's logits here. The decode node serves a later sample of the group by copying
the first one's KV there (decode_node/sample_groups.py) and then holds every page of its
room: such a sample computes nothing here, it samples its first token from these logits
(under its own seed, penalties and grammar, as after its own prefill) and sends only that.
A sample whose decode node asks for pages (the first one had finished there) is computed
as any request: the KV it sends must exist.

The logits of a group are kept until each of its other samples took them, or for
``KEEP_S`` seconds, and at most ``MAX_GROUPS`` groups at once (the oldest go first): on a
GPU one row is the vocabulary in float32 (0.2 MB for SmolLM2, 0.5 MB for a 128K vocabulary).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from prefill_node.req_state import PrefillReq

KEEP_S = 30.0
MAX_GROUPS = 64


@dataclass
class _Logits:
    key: tuple[bytes | None, bytes]  # the prompt (cache salt namespace, packed tokens)
    logits: torch.Tensor  # [1, vocab]: the prompt's last position
    num_left: int  # samples of the group yet to take them
    made_at: float


class SampleGroups:
    """The last logits of the prompts whose samples are still coming."""

    def __init__(self, keep_s: float = KEEP_S, max_groups: int = MAX_GROUPS) -> None:
        self.keep_s = keep_s
        self.max_groups = max_groups
        self._groups: OrderedDict[str, _Logits] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._groups)

    def keep(self, s: PrefillReq, logits: torch.Tensor, now: float) -> None:
        """s's prefill ended with ``logits`` ([1, vocab]): keep them for the other samples
        of its group, if it has others and none left them here before."""
        g = s.generate
        if g.num_group_samples <= 1 or not g.sample_group or g.output_ids:
            return
        if g.sample_group in self._groups:
            return
        self.expire(now)
        while len(self._groups) >= self.max_groups:
            self._groups.popitem(last=False)
        key = (s.req.namespace, s.req.key)
        self._groups[g.sample_group] = _Logits(
            key, logits.detach().clone(), g.num_group_samples - 1, now
        )

    def covers(self, s: PrefillReq) -> bool:
        """Whether s's group logits are here (for its prompt): s will likely compute nothing."""
        kept = self._groups.get(s.generate.sample_group) if s.generate.sample_group else None
        return kept is not None and kept.key == (s.req.namespace, s.req.key)

    def take(self, s: PrefillReq, now: float) -> torch.Tensor | None:
        """The logits s samples its first token from, when it needs no prefill: its decode
        node holds every page of its room and its group's logits are here, for the same
        prompt. None: s is prefilled as usual."""
        g = s.generate
        if not g.sample_group or g.output_ids or not self._holds_every_page(s):
            return None
        self.expire(now)
        kept = self._groups.get(g.sample_group)
        if kept is None or kept.key != (s.req.namespace, s.req.key):
            return None
        kept.num_left -= 1
        if kept.num_left <= 0:
            del self._groups[g.sample_group]
        return kept.logits.clone()  # the sampler may change its logits in place

    @staticmethod
    def _holds_every_page(s: PrefillReq) -> bool:
        """Whether the decode node holds every page (held + destinations are all of them)."""
        return not s.sender.dst_pages and s.sender.num_held_pages > 0

    def expire(self, now: float) -> None:
        """Drop the logits kept longer than keep_s."""
        while self._groups:
            oldest = next(iter(self._groups.values()))
            if now - oldest.made_at < self.keep_s:
                break
            self._groups.popitem(last=False)
