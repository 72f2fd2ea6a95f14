"""Stop-string matching across token boundaries and the llama.cpp timings zero-rate rules."""

from __future__ import annotations

import json
import math

from ninfer.engine.stops import OutputText, StopStringMatcher
from ninfer.engine.timings import RequestTimings


def feed(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    return [matcher.push(piece) for piece in pieces]


def test_stop_string_split_across_pieces_is_withheld():
    matcher = StopStringMatcher(["</end>"])
    emitted = feed(matcher, ["hello </", "en", "d> tail"])
    assert emitted == ["hello ", "", ""]
    assert matcher.matched == "</end>"
    assert matcher.flush() == ""


def test_possible_prefix_is_held_until_disambiguated():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("abc ST") == "abc "
    assert matcher.push("O") == ""
    assert matcher.push("P!") == ""
    assert matcher.matched == "STOP"

    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("abc ST") == "abc "
    assert matcher.push("ILL") == "STILL"
    assert matcher.matched is None


def test_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.push("hello world") == "hel"
    assert matcher.matched == "lo w"


def test_flush_releases_an_unfinished_prefix():
    matcher = StopStringMatcher(["###"])
    assert matcher.push("a ##") == "a "
    assert matcher.flush() == "##"


def test_no_stops_passes_text_through():
    matcher = StopStringMatcher([])
    assert feed(matcher, ["a", "b"]) == ["a", "b"]


class _Detok:
    def __init__(self, pieces: dict[int, str]) -> None:
        self.pieces = pieces

    def push(self, token_id: int) -> str:
        return self.pieces[token_id]

    def flush(self) -> str:
        return ""


def test_output_text_combines_detokenizer_and_matcher():
    text = OutputText(_Detok({1: "The an", 2: "swer: ", 3: "42\n\nEND", 4: "more"}), ["\n\nEND"])
    assert [text.push(t) for t in (1, 2, 3)] == ["The an", "swer: ", "42"]
    assert text.matched_stop == "\n\nEND"


def test_timings_rates_and_intervals():
    timings = RequestTimings(
        submitted_at=10.0, admitted_at=10.5, first_token_at=11.0, last_token_at=13.0, cache_n=100, prompt_n=400, predicted_n=5
    )
    data = timings.timings_dict()
    assert data["cache_n"] == 100 and data["prompt_n"] == 400 and data["predicted_n"] == 5
    assert math.isclose(data["prompt_ms"], 500.0)
    assert math.isclose(data["prompt_per_token_ms"], 1.25)
    assert math.isclose(data["prompt_per_second"], 800.0)
    assert math.isclose(data["predicted_ms"], 2000.0)
    assert math.isclose(data["predicted_per_token_ms"], 500.0)  # 4 intervals, not 5 tokens
    assert math.isclose(data["predicted_per_second"], 2.0)
    assert math.isclose(timings.queue_wait_s, 0.5)


def _finite_zero_rates(data: dict) -> None:
    json.dumps(data, allow_nan=False)  # no NaN / infinity anywhere
    for key in ("prompt_per_token_ms", "prompt_per_second", "predicted_per_token_ms", "predicted_per_second"):
        assert isinstance(data[key], float)


def test_zero_token_request_reports_finite_zeros():
    data = RequestTimings(submitted_at=1.0, admitted_at=1.0, prompt_done_at=1.2, prompt_n=10).timings_dict()
    _finite_zero_rates(data)
    assert data["predicted_n"] == 0 and data["predicted_ms"] == 0.0 and data["predicted_per_second"] == 0.0
    assert math.isclose(data["prompt_ms"], 200.0)


def test_one_token_request_has_no_decode_interval():
    data = RequestTimings(submitted_at=1.0, admitted_at=1.0, first_token_at=1.1, last_token_at=1.1, prompt_n=3, predicted_n=1).timings_dict()
    _finite_zero_rates(data)
    assert data["predicted_per_token_ms"] == 0.0 and data["predicted_per_second"] == 0.0


def test_exact_cache_hit_and_zero_duration_report_zero_rates():
    data = RequestTimings(
        submitted_at=1.0, admitted_at=2.0, first_token_at=2.0, last_token_at=2.0, cache_n=64, prompt_n=0, predicted_n=3
    ).timings_dict()
    _finite_zero_rates(data)
    assert data["prompt_per_token_ms"] == data["prompt_per_second"] == 0.0
    assert data["predicted_per_token_ms"] == data["predicted_per_second"] == 0.0


def test_never_admitted_request_reports_zeros():
    data = RequestTimings(submitted_at=1.0, finished_at=2.0).timings_dict()
    _finite_zero_rates(data)
    assert data["prompt_ms"] == 0.0
