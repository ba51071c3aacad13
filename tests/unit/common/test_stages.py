"""TTFT stages from request marks (common/stages.py)."""

from __future__ import annotations

import math

from common import stages


def _marks(start: float = 1000.0) -> dict[str, float]:
    """Every mark, 10 ms apart along the chain; decode's own beside prefill's."""
    chain = [
        stages.RECEIVED,
        stages.PARSED,
        stages.TOKENIZED,
        stages.DISPATCHED,
        stages.PREFILL_BOOTSTRAPPED,
        stages.PREFILL_SCHEDULED,
        stages.PREFILL_COMPUTED,
        stages.DECODE_TRANSFERRED,
        stages.FIRST_TOKEN,
        stages.FIRST_BYTE,
    ]
    marks = {name: start + 0.01 * i for i, name in enumerate(chain)}
    marks[stages.PREFILL_RECEIVED] = marks[stages.DISPATCHED] + 0.001
    marks[stages.DECODE_RECEIVED] = marks[stages.DISPATCHED] + 0.002
    marks[stages.DECODE_PREALLOCATED] = marks[stages.DISPATCHED] + 0.004
    return marks


def test_the_chain_is_contiguous_from_first_byte_in_to_first_byte_out():
    assert stages.CHAIN[0][1] == stages.RECEIVED and stages.CHAIN[-1][2] == stages.FIRST_BYTE
    for (_, _, end), (_, start, _) in zip(stages.CHAIN, stages.CHAIN[1:]):
        assert end == start
    assert len(set(stages.STAGES)) == len(stages.STAGES)


def test_chain_stages_add_up_to_the_whole_and_parallel_ones_sit_beside():
    marks = _marks()
    seconds = stages.stage_seconds(marks)
    assert set(seconds) == set(stages.STAGES)
    chain = sum(seconds[name] for name, _, _ in stages.CHAIN)
    assert math.isclose(chain, marks[stages.FIRST_BYTE] - marks[stages.RECEIVED], rel_tol=1e-9)
    assert math.isclose(seconds["decode_prealloc_queue"], 0.002, rel_tol=1e-6)
    assert math.isclose(
        seconds["decode_transfer_queue"],
        marks[stages.DECODE_TRANSFERRED] - marks[stages.DECODE_PREALLOCATED],
        rel_tol=1e-9,
    )


def test_missing_marks_leave_their_stages_out_and_skew_never_goes_negative():
    marks = _marks()
    del marks[stages.FIRST_BYTE]  # a request answered whole, at the end
    marks[stages.PREFILL_BOOTSTRAPPED] = marks[stages.DISPATCHED] - 0.5  # a clock behind
    seconds = stages.stage_seconds(marks)
    assert "first_byte" not in seconds
    assert seconds["prefill_bootstrap_queue"] == 0.0
    assert all(v >= 0 for v in seconds.values())


def test_node_views_use_only_their_own_marks():
    marks = _marks()
    prefill = stages.stage_seconds(marks, stages.PREFILL_STAGES)
    assert set(prefill) == {"prefill_bootstrap_queue", "prefill_waiting_queue", "prefill_compute"}
    assert math.isclose(
        prefill["prefill_bootstrap_queue"],
        marks[stages.PREFILL_BOOTSTRAPPED] - marks[stages.PREFILL_RECEIVED],
    )
    assert set(stages.stage_seconds(marks, stages.DECODE_STAGES)) == {
        "decode_prealloc_queue",
        "decode_transfer_queue",
    }


def test_a_peers_marks_are_filtered_to_the_names_it_may_send():
    got = stages.forwarded(
        {
            stages.PREFILL_COMPUTED: 5.0,
            stages.FIRST_BYTE: 1.0,
            "x": 2.0,
            stages.PREFILL_RECEIVED: float("nan"),
            stages.PREFILL_SCHEDULED: float("inf"),
        },
        stages.PREFILL_MARKS,
    )
    assert got == {stages.PREFILL_COMPUTED: 5.0}
    assert stages.forwarded(None, stages.NODE_MARKS) == {}
    flood = {f"m{i}": 1.0 for i in range(stages.MAX_MARKS + 1)}
    assert stages.forwarded(flood, stages.NODE_MARKS) == {}
