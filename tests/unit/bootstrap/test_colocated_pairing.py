"""A colocated process's two halves pair only with each other (bootstrap/service.py, router.py)."""

from __future__ import annotations

from bootstrap.registry import NodeView
from bootstrap.router import DecodeCandidate, PrefillLoads, Router
from bootstrap.service import _pairable


def view(node_id: str, role: str, partner: str = "") -> NodeView:
    return NodeView(node_id, role, True, "tcp://x:1", "tcp://x:2", 64, {}, colocated_with=partner)


def test_colocated_halves_pair_with_each_other_and_plain_nodes_with_plain_ones():
    prefills = [view("c.prefill", "prefill", "c.decode"), view("p0", "prefill")]
    decodes = [view("c.decode", "decode", "c.prefill"), view("d0", "decode")]
    usable, partners = _pairable(prefills, decodes)
    assert [v.node_id for v in usable] == ["c.prefill", "p0"]
    assert partners == {"c.prefill": "c.decode"}
    router = Router(mode="round-robin")
    pairs = {
        router.route(
            [1] * 40,
            None,
            PrefillLoads([v.node_id for v in usable]),
            [DecodeCandidate("c.decode", 0), DecodeCandidate("d0", 5)],
            partners=partners,
        )
        for _ in range(4)
    }
    # The plain decode node is busier, yet p0 never goes to the colocated decode half.
    assert {(d.prefill_id, d.decode_id) for d in pairs} == {("c.prefill", "c.decode"), ("p0", "d0")}


def test_a_half_whose_partner_is_gone_takes_nothing():
    prefills = [view("c.prefill", "prefill", "c.decode"), view("p0", "prefill")]
    usable, partners = _pairable(prefills, [view("d0", "decode")])
    assert [v.node_id for v in usable] == ["p0"] and partners == {}
    usable, _ = _pairable([view("p0", "prefill")], [view("c.decode", "decode", "c.prefill")])
    assert usable == []  # a plain prefill node needs a plain decode node
