"""Tests for StopChecker: token finish conditions and text stop strings."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from common.stop import FinishKind, FinishReason, StopChecker

EOS = 2


def _checker(**kwargs: object) -> StopChecker:
    return StopChecker(SamplingParams(**kwargs), eos_token_ids={EOS})  # type: ignore[arg-type]


def _feed_all(checker: StopChecker, pieces: list[str]) -> tuple[list[str], bool]:
    emitted = []
    matched = False
    for piece in pieces:
        text, matched = checker.feed(piece)
        emitted.append(text)
        if matched:
            break
    return emitted, matched


# --- token conditions -------------------------------------------------------------------


def test_eos_stops_with_the_token() -> None:
    reason = _checker().check_token(EOS, num_generated=3)
    assert reason == FinishReason.stop(EOS)
    assert reason is not None and reason.kind == "stop" and reason.matched == EOS


def test_ignore_eos_keeps_going_but_stop_token_ids_still_apply() -> None:
    checker = _checker(ignore_eos=True, stop_token_ids=(7,))
    assert checker.check_token(EOS, num_generated=1) is None
    assert checker.check_token(7, num_generated=2) == FinishReason.stop(7)


def test_length_when_max_new_tokens_reached() -> None:
    checker = _checker(max_new_tokens=3)
    assert checker.check_token(11, num_generated=2) is None
    assert checker.check_token(11, num_generated=3) == FinishReason.length()
    # A stop token on the last allowed step is reported as stop, like OpenAI.
    assert checker.check_token(EOS, num_generated=3) == FinishReason.stop(EOS)


def test_finish_reason_values_match_openai() -> None:
    assert [k.value for k in FinishKind] == ["stop", "length", "abort"]
    assert FinishReason.abort().kind == "abort" and FinishReason.abort().matched is None
    assert FinishReason.stop("###").matched == "###"
    with pytest.raises(ValueError):
        FinishReason(FinishKind.STOP)
    with pytest.raises(ValueError):
        FinishReason(FinishKind.LENGTH, matched=3)


# --- stop strings -----------------------------------------------------------------------


def test_no_stop_strings_pass_text_through() -> None:
    checker = _checker()
    assert checker.feed("Hello, ") == ("Hello, ", False)
    assert checker.feed("world") == ("world", False)
    assert checker.flush() == ""


def test_stop_string_arriving_whole() -> None:
    checker = _checker(stop=("STOP",))
    assert checker.feed("Hello STOP world") == ("Hello ", True)
    assert checker.matched_stop == "STOP"


def test_stop_string_split_across_feeds() -> None:
    checker = _checker(stop=("STOP",))
    emitted, matched = _feed_all(checker, ["Hel", "lo S", "T", "OP and more"])
    assert matched
    assert emitted == ["Hel", "lo ", "", ""]
    assert "".join(emitted) == "Hello "
    assert checker.flush() == ""


def test_partial_stop_never_reaches_the_client() -> None:
    checker = _checker(stop=("</answer>",))
    text, matched = checker.feed("42</ans")
    assert (text, matched) == ("42", False)
    text, matched = checker.feed("wer>")
    assert (text, matched) == ("", True)


def test_stop_string_at_the_very_start() -> None:
    checker = _checker(stop=("\n\n",))
    assert checker.feed("\n") == ("", False)
    assert checker.feed("\nrest") == ("", True)


def test_earliest_occurrence_wins_over_list_order() -> None:
    for stop in (("world", "lo"), ("lo", "world")):
        checker = _checker(stop=stop)
        assert checker.feed("hello world") == ("hel", True)
        assert checker.matched_stop == "lo"


def test_earliest_occurrence_wins_across_feeds() -> None:
    checker = _checker(stop=("xyz", "bc"))
    assert checker.feed("axy") == ("a", False)  # "xy" could start "xyz"
    assert checker.feed("zbc") == ("", True)
    assert checker.matched_stop == "xyz"


def test_false_alarm_is_released_when_text_diverges() -> None:
    checker = _checker(stop=("STOP",))
    assert checker.feed("ST") == ("", False)
    assert checker.feed("ART here") == ("START here", False)


def test_flush_releases_held_back_text() -> None:
    checker = _checker(stop=("</end>",))
    assert checker.feed("abc</e") == ("abc", False)
    assert checker.flush() == "</e"
    assert checker.flush() == ""


def test_feed_after_match_emits_nothing() -> None:
    checker = _checker(stop=("!",))
    assert checker.feed("hi! there") == ("hi", True)
    assert checker.feed("more") == ("", True)
    assert checker.flush() == ""
