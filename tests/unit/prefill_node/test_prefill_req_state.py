"""The prefill request's lifecycle (prefill_node/req_state.py): its legal and illegal moves."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from common.node.scheduling import IllegalTransition
from common.sampling_params import SamplingParams
from prefill_node.req_state import PrefillReq, PrefillState
from prefill_node.request import Req
from tests.support.generate_req import generate_req

S = PrefillState
LEGAL = {
    (S.BOOTSTRAP, S.WAITING),
    (S.BOOTSTRAP, S.GRAMMAR),
    (S.BOOTSTRAP, S.FAILED),
    (S.GRAMMAR, S.WAITING),
    (S.GRAMMAR, S.FAILED),
    (S.WAITING, S.PREFILLING),
    (S.WAITING, S.FAILED),
    (S.PREFILLING, S.WAITING),
    (S.PREFILLING, S.TRANSFERRING),
    (S.PREFILLING, S.FAILED),
    (S.TRANSFERRING, S.FINISHED),
    (S.TRANSFERRING, S.FAILED),
}


def _req(rid: str = "x", state: PrefillState = S.BOOTSTRAP) -> PrefillReq:
    g = generate_req(rid=rid, room=7)
    sender: Any = object()  # the state machine never touches its sender
    r = PrefillReq(
        Req(rid=rid, room=7, origin_input_ids=[1, 2, 3], max_new_tokens=1),
        g,
        SamplingParams(),
        sender,
    )
    r.state = state
    return r


def test_a_new_request_starts_in_bootstrap_and_passes_every_stage_to_finished():
    r = _req()
    assert r.state is S.BOOTSTRAP and (r.rid, r.room) == ("x", 7)
    for state in (S.WAITING, S.PREFILLING, S.WAITING, S.PREFILLING, S.TRANSFERRING, S.FINISHED):
        r.advance(state)
    assert r.state is S.FINISHED and r.state.is_terminal


@pytest.mark.parametrize("old,new", sorted(itertools.product(S, S), key=str))
def test_the_table_allows_exactly_the_drawn_moves(old: PrefillState, new: PrefillState):
    r = _req(state=old)
    if (old, new) in LEGAL:
        r.advance(new)
        assert r.state is new
    else:
        with pytest.raises(IllegalTransition, match=f"request x: {old.name} -> {new.name}"):
            r.advance(new)
        assert r.state is old  # a refused move changes nothing


def test_every_live_state_can_fail_and_no_terminal_state_can_be_left():
    for state in S:
        assert state.is_terminal == (state in (S.FINISHED, S.FAILED))
        if not state.is_terminal:
            r = _req(state=state)
            r.advance(S.FAILED)
            assert r.state is S.FAILED
