"""The Qwen output decoder: reasoning/content split, Qwen XML tool calls, typed arguments, streaming invariance.

Oracles: the newline rules of the chat template (``reasoning.strip("\\n")`` / ``content.lstrip("\\n")``), the exact
input bytes for every fallback, ``json.dumps(..., ensure_ascii=False)`` for arguments, and a replay of parsed output
through ninfer's Qwen chat templates, which must render the text the model produced.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, Iterator, Sequence

import pytest

from ninfer.core.errors import InvalidRequestError
from ninfer.core.frontend import ParseReport
from ninfer.plugins.qwen3_5.frontend.output_parser import (
    ContentDelta,
    OutputDecoderError,
    QwenOutputDecoder,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ToolCallStarted,
    thinking_budget_control_text,
)
from ninfer.plugins.qwen3_5.frontend.tool_calls import ToolSpec, convert_arguments, declared_types

WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
                                                                    "days": {"type": "integer"}}})
WRITE = ToolSpec("write_file", {"type": "object", "properties": {"path": {"type": "string"},
                                                                 "content": {"type": "string"}}})
TOOLS = [WEATHER, WRITE]
CALL_ID = re.compile(r"call_[A-Za-z0-9]{24}")
BUDGET_TEXT = ("\n\nConsidering the limited time by the user, I have to give the solution based on the thinking "
               "directly now.\n</think>\n\n")


def call(name: str, *params: tuple[str, str]) -> str:
    """A call exactly as the Qwen template renders it."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


PARIS = call("get_weather", ("city", "Paris"), ("days", "3"))
LONDON = call("get_weather", ("city", "London"))


# ---------------------------------------------------------------------------------------------------------------
# Driving the decoder
# ---------------------------------------------------------------------------------------------------------------


def run(chunks: Sequence[str], tools: Sequence[ToolSpec] = TOOLS, *, reasoning: bool = True,
        tolerant: bool = False) -> tuple[list[Any], QwenOutputDecoder]:
    decoder = QwenOutputDecoder(tools, starts_in_reasoning=reasoning, tolerant=tolerant)
    events: list[Any] = []
    for chunk in chunks:
        events += decoder.push(chunk)
    events += decoder.finish()
    return events, decoder


def summarize(events: Sequence[Any]) -> list[tuple]:
    """Adjacent deltas of one channel merged; each call as (call, name, namespace, arguments). Checks invariants."""
    summary: list[tuple] = []
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, (ReasoningDelta, ContentDelta)):
            kind = "reasoning" if isinstance(event, ReasoningDelta) else "content"
            assert event.text, "empty deltas are never emitted"
            if summary and summary[-1][0] == kind:
                summary[-1] = (kind, summary[-1][1] + event.text)
            else:
                summary.append((kind, event.text))
        elif isinstance(event, ToolCallStarted):
            assert event.index == len(calls) and CALL_ID.fullmatch(event.call_id)
            calls[event.index] = {"name": event.name, "namespace": event.namespace, "pieces": [], "done": False}
        elif isinstance(event, ToolCallArgumentsDelta):
            assert not calls[event.index]["done"]
            calls[event.index]["pieces"].append(event.text)
        else:
            assert isinstance(event, ToolCallFinished)
            state = calls[event.index]
            assert "".join(state["pieces"]) == event.arguments_json and not state["done"]
            state["done"] = True
            summary.append(("call", state["name"], state["namespace"], event.arguments_json))
    assert all(state["done"] for state in calls.values())
    return summary


def chunkings(text: str, seed: int = 0, random_count: int = 12) -> Iterator[list[str]]:
    """The whole text, one character at a time, every two-piece split, and random chunkings."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(random_count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def decode(text: str, tools: Sequence[ToolSpec] = TOOLS, *, reasoning: bool = True,
           tolerant: bool = False) -> tuple[list[tuple], QwenOutputDecoder]:
    """Decode ``text`` under every chunking; all must give the same summary and report. Returns one of them."""
    reference = None
    for chunks in chunkings(text):
        events, decoder = run(chunks, tools, reasoning=reasoning, tolerant=tolerant)
        outcome = (summarize(events), decoder.parse_report)
        if reference is None:
            reference = outcome
        assert outcome == reference, f"chunking {chunks!r} differs"
    assert reference is not None
    return reference[0], decoder


def arguments(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------------------------
# Reasoning / content split
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, reasoning, content", [
    ("Let me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("\n\nA\n\nB\n\n\n</think>\n\n\nC\n\nD\n", "A\n\nB", "C\n\nD\n"),
    ("</think>\n\nOnly content", None, "Only content"),
    ("Unfinished thought\n\n", "Unfinished thought", None),
    ("Partial close </thi", "Partial close </thi", None),
    ("a </thinking> b\n</think>x</think>", "a </thinking> b", "x</think>"),
    ("<think>nested</think>\n<think>not special", "<think>nested", "<think>not special"),
])
def test_reasoning_and_content_newline_rules(text: str, reasoning: str | None, content: str | None):
    expected = [item for item in (("reasoning", reasoning), ("content", content)) if item[1] is not None]
    assert decode(text, [])[0] == expected


def test_random_texts_follow_the_template_newline_oracle():
    rng = random.Random(7)
    pieces = ["\n", "\n\n", "a", "b c", "<", "</", "</th", "</think", "think>", ">", " "]
    for _ in range(25):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        if rng.random() < 0.7:
            text += "</think>" + "".join(rng.choice(pieces) for _ in range(rng.randint(0, 8)))
        head, closed, tail = text.partition("</think>")
        expected = [("reasoning", head.strip("\n")), ("content", tail.lstrip("\n") if closed else "")]
        assert decode(text, [])[0] == [item for item in expected if item[1]], repr(text)


def test_reasoning_holds_back_only_a_newline_run_and_a_partial_close():
    decoder = QwenOutputDecoder([], starts_in_reasoning=True)
    assert decoder.push("\nabc\n\n") == [ReasoningDelta("abc")]
    assert decoder.push("def") == [ReasoningDelta("\n\ndef")]
    assert decoder.push("\n</thi") == []
    assert decoder.push("s") == [ReasoningDelta("\n</this")]
    assert decoder.push("\n</think>\n") == []
    assert not decoder.in_reasoning
    assert decoder.push("\nAnswer") == [ContentDelta("Answer")]
    assert decoder.finish() == []


def test_thinking_disabled_means_everything_is_content():
    summary, decoder = decode("\n\nHello </think> and <think>x", [], reasoning=False)
    assert summary == [("content", "Hello </think> and <think>x")]
    assert decoder.reasoning_tokens == 0


def test_reasoning_tokens_are_counted_from_token_counts():
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=True)
    decoder.push("Hmm", token_count=2)
    decoder.push("", token_count=1)           # a token whose text is still an incomplete UTF-8 sequence
    decoder.push(" ok\n</think>", token_count=3)
    decoder.push("\n\nAnswer", token_count=4)
    decoder.finish()
    assert decoder.reasoning_tokens == 6


def test_thinking_budget_control_text_closes_reasoning_like_a_natural_close():
    assert thinking_budget_control_text() == BUDGET_TEXT
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=True)
    events = decoder.push("First I will", token_count=3)
    events += decoder.push(thinking_budget_control_text(), token_count=24)
    assert not decoder.in_reasoning
    events += decoder.push("The answer.", token_count=3) + decoder.finish()
    assert summarize(events) == [
        ("reasoning", "First I will\n\nConsidering the limited time by the user, I have to give the solution based "
                      "on the thinking directly now."),
        ("content", "The answer.")]
    assert decoder.reasoning_tokens == 27


def test_tool_call_markup_inside_reasoning_stays_reasoning():
    summary, decoder = decode(f"Maybe {PARIS}\n</think>\n\nDone.")
    assert summary == [("reasoning", f"Maybe {PARIS}"), ("content", "Done.")]
    assert decoder.parse_report.marker_seen is False and decoder.parse_report.calls == 0


# ---------------------------------------------------------------------------------------------------------------
# Tool calls inside an unclosed thinking block
# ---------------------------------------------------------------------------------------------------------------

PARIS_CALL = ("call", "get_weather", None, arguments({"city": "Paris", "days": 3}))
LONDON_CALL = ("call", "get_weather", None, arguments({"city": "London"}))

REASONING_CALLS = [
    ("after reasoning", "I need the weather.\n\n" + PARIS, [("reasoning", "I need the weather."), PARIS_CALL]),
    ("at the start", "\n" + PARIS + "\n", [PARIS_CALL]),
    ("parallel", "Two cities.\n" + PARIS + "\n" + LONDON, [("reasoning", "Two cities."), PARIS_CALL, LONDON_CALL]),
    ("after a mentioned marker", "Use <tool_call> markup.\n" + PARIS,
     [("reasoning", "Use <tool_call> markup."), PARIS_CALL]),
    ("after a rejected call", "Not " + call("get_time") + " but\n" + LONDON,
     [("reasoning", "Not " + call("get_time") + " but"), LONDON_CALL]),
]


@pytest.mark.parametrize("tolerant", [False, True])
@pytest.mark.parametrize("text, expected", [case[1:] for case in REASONING_CALLS],
                         ids=[case[0] for case in REASONING_CALLS])
def test_a_complete_call_ending_unclosed_reasoning_is_a_structured_call(text: str, expected: list[tuple],
                                                                         tolerant: bool):
    summary, decoder = decode(text, tolerant=tolerant)
    assert summary == expected
    calls = sum(item[0] == "call" for item in expected)
    assert decoder.parse_report == ParseReport(marker_seen=True, calls=calls)
    assert not decoder.in_reasoning


REASONING_TEXT = [
    ("undeclared tool", "Maybe " + call("get_time", ("zone", "UTC"))),
    ("truncated", "Maybe " + PARIS[:60]),
    ("missing </tool_call>", PARIS.removesuffix("</tool_call>")),
    ("bare marker", "Use <tool_call>"),
    ("more reasoning after the call", "Like " + PARIS + "\n\nbut first more thought\n\n"),
    ("closed after the call", "Like " + PARIS + "\n</think>\n\nDone."),
    ("think close inside a value", "X\n\n" + call("write_file", ("content", "a\n</think>\n\nb"))),
    ("unmatched nested opener", call("write_file", ("content", "a <parameter=x> b"))),
    ("standalone closer", call("write_file", ("content", "a\n</parameter>\nb"))),
    ("duplicate parameter", call("get_weather", ("city", "A"), ("city", "B"))),
    ("json instead of xml", 'Hm\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'),
]


@pytest.mark.parametrize("tolerant", [False, True])
@pytest.mark.parametrize("text", [case[1] for case in REASONING_TEXT], ids=[case[0] for case in REASONING_TEXT])
def test_other_markup_inside_reasoning_stays_reasoning_byte_for_byte(text: str, tolerant: bool):
    head, closed, tail = text.partition("</think>")
    expected = [("reasoning", head.strip("\n")), ("content", tail.lstrip("\n") if closed else "")]
    summary, decoder = decode(text, tolerant=tolerant)
    assert summary == [item for item in expected if item[1]]
    assert decoder.parse_report == ParseReport()  # reasoning text is not a tool-call attempt
    assert decoder.in_reasoning is not closed


def test_without_declared_tools_a_call_in_reasoning_stays_reasoning():
    summary, decoder = decode("Need it.\n" + PARIS, [])
    assert summary == [("reasoning", "Need it.\n" + PARIS)]
    assert decoder.parse_report == ParseReport()


def test_a_call_in_unclosed_reasoning_is_held_and_released_once_at_the_end():
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=True)
    assert decoder.push("Need it.\n") == [ReasoningDelta("Need it.")]
    assert decoder.push("<tool_") == []
    assert decoder.push("call>\n<function=get_weather>\n") == []
    assert decoder.push("<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>") == []
    assert summarize(decoder.finish()) == [("call", "get_weather", None, arguments({"city": "Paris"}))]
    assert not decoder.in_reasoning


def test_reasoning_releases_a_partial_opener_that_is_not_one():
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=True)
    assert decoder.push("Plan <tool_") == [ReasoningDelta("Plan ")]
    assert decoder.push("box") == [ReasoningDelta("<tool_box")]


CALL_TOKENS = [("<tool_call>", 1), ("\n<function=get_weather>\n", 3), ("<parameter=city>\nParis\n</parameter>\n", 5),
               ("</function>\n</tool_call>", 2)]


@pytest.mark.parametrize("suffix, reasoning_tokens", [([], 3), ([("\nActually no.", 3)], 3 + 11 + 3)])
def test_tokens_of_a_call_in_reasoning_count_as_reasoning_only_if_it_falls_back(suffix: list, reasoning_tokens: int):
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=True)
    for text, count in [("Need", 1), (" it.\n\n", 2), *CALL_TOKENS, *suffix]:
        decoder.push(text, token_count=count)
    decoder.finish()
    assert decoder.reasoning_tokens == reasoning_tokens
    assert decoder.parse_report.calls == (0 if suffix else 1)


# ---------------------------------------------------------------------------------------------------------------
# Tool calls
# ---------------------------------------------------------------------------------------------------------------


def test_single_call_with_leading_text():
    summary, decoder = decode(f"Check.\n</think>\n\nLet me look.\n\n{PARIS}")
    assert summary == [("reasoning", "Check."), ("content", "Let me look.\n\n"),
                       ("call", "get_weather", None, arguments({"city": "Paris", "days": 3}))]
    report = decoder.parse_report
    assert (report.marker_seen, report.calls, report.fallback_reason) == (True, 1, "none")


def test_parallel_calls_and_whitespace_between_them():
    text = "</think>\n\n" + PARIS + "\n" + LONDON + "\n\n " + call("write_file", ("path", "a.txt"),
                                                                      ("content", "x")) + "\n"
    summary, decoder = decode(text)
    assert summary == [("call", "get_weather", None, arguments({"city": "Paris", "days": 3})),
                       ("call", "get_weather", None, arguments({"city": "London"})),
                       ("call", "write_file", None, arguments({"path": "a.txt", "content": "x"}))]
    assert decoder.parse_report.calls == 3


def test_call_without_parameters_and_value_newline_stripping():
    text = ("<tool_call>\n<function=write_file>\n</function>\n</tool_call>\n<tool_call><function=write_file>"
            "<parameter=path>\n\nlead\n\n</parameter><parameter=content>bare</parameter>"
            "<parameter=extra>\n</parameter></function></tool_call>")
    summary, _ = decode(text, reasoning=False)
    assert summary == [("call", "write_file", None, "{}"),
                       ("call", "write_file", None, arguments({"path": "\nlead\n", "content": "bare", "extra": ""}))]


def test_ordinary_text_before_a_call_streams_immediately():
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=False)
    assert decoder.push("Sure, checking. ") == [ContentDelta("Sure, checking. ")]
    assert decoder.push("Now <tool") == [ContentDelta("Now ")]
    assert decoder.push("_call>\n<function=get_weather>\n<parameter=city>\nParis") == []
    assert decoder.push("\n</parameter>\n</function>\n</tool_call>") == []
    final = decoder.finish()
    assert summarize(final) == [("call", "get_weather", None, arguments({"city": "Paris"}))]


def test_a_partial_marker_that_is_not_a_marker_is_released_at_once():
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=False)
    assert decoder.push("a <to") == [ContentDelta("a ")]
    assert decoder.push("day") == [ContentDelta("<today")]


def test_tool_call_prefix_at_the_end_is_flushed_by_finish():
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=False)
    assert decoder.push("Answer <tool_ca") == [ContentDelta("Answer ")]
    assert decoder.finish() == [ContentDelta("<tool_ca")]
    assert decoder.parse_report.marker_seen is False and decoder.parse_report.fallback_reason == "none"


def test_a_bare_marker_at_the_end_is_malformed_content():
    summary, decoder = decode("Text <tool_call>", reasoning=False)
    assert summary == [("content", "Text <tool_call>")]
    assert (decoder.parse_report.marker_seen, decoder.parse_report.fallback_reason) == (True, "malformed_structure")


def test_nested_balanced_parameter_text_and_markers_are_value_bytes():
    value = ("usage: <parameter=x>\ninner\n</parameter> then <tool_call><function=f></function></tool_call>\n"
             "<parameter=a><parameter=b>deep</parameter></parameter>")
    summary, _ = decode(call("write_file", ("path", "doc.md"), ("content", value)), reasoning=False)
    assert summary == [("call", "write_file", None, arguments({"path": "doc.md", "content": value}))]


MARKUP_VALUES = [
    ("html", '<div class="x">a</div>\n<p>b &amp; c</p>'),
    ("code fence", "```python\ndef f(x):\n    return f'<tool_call>{x}</tool_call>'\n```"),
    ("call markup", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>"),
    ("balanced nested parameters", "doc: <parameter=x>\n<b>v</b>\n</parameter> and <parameter=y></parameter>"),
    ("look-alike tags", "</parameters> <parameter_list> </param> </function> <function=f> </tool_call>"),
]


@pytest.mark.parametrize("tolerant", [False, True])
@pytest.mark.parametrize("closed", [True, False], ids=["after_reasoning", "in_unclosed_reasoning"])
@pytest.mark.parametrize("value", [case[1] for case in MARKUP_VALUES], ids=[case[0] for case in MARKUP_VALUES])
def test_markup_like_values_stream_only_as_arguments(value: str, closed: bool, tolerant: bool):
    """The value bytes reach the arguments exactly; every delta/chunking invariant is checked by ``decode``."""
    markup = call("write_file", ("path", "x.md"), ("content", value))
    if closed:
        text, lead = "Plan.\n</think>\n\nWriting it.\n\n" + markup, [("reasoning", "Plan."), ("content", "Writing it.\n\n")]
    else:
        text, lead = "Plan. Writing it.\n\n" + markup, [("reasoning", "Plan. Writing it.")]
    summary, decoder = decode(text, tolerant=tolerant)
    assert summary == [*lead, ("call", "write_file", None, arguments({"path": "x.md", "content": value}))]
    assert json.loads(summary[-1][3])["content"] == value
    assert decoder.parse_report == ParseReport(marker_seen=True, calls=1)


FALLBACKS = [
    ("unmatched nested opener", call("write_file", ("content", "a <parameter=x> b")), "malformed_structure"),
    ("standalone closer", call("write_file", ("content", "a\n</parameter>\nb")), "malformed_structure"),
    ("duplicate parameter", call("get_weather", ("city", "A"), ("city", "B")), "duplicate_parameter"),
    ("undeclared tool", call("get_time", ("zone", "UTC")), "undeclared_tool"),
    ("invalid tool name", call("get weather", ("city", "Paris")), "invalid_tool_name"),
    ("empty tool name", call("", ("city", "Paris")), "invalid_tool_name"),
    ("odd tool name", call("get_weather!", ("city", "Paris")), "invalid_tool_name"),
    ("trailing content", PARIS + "\nI hope that helps.", "trailing_content"),
    ("partial marker after calls", PARIS + "\n<tool_", "trailing_content"),
    ("missing </tool_call>", PARIS.removesuffix("</tool_call>"), "malformed_structure"),
    ("truncated inside a value", PARIS[:60], "malformed_structure"),
    ("json instead of xml", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
     "malformed_structure"),
    ("bad parameter name", "<tool_call>\n<function=get_weather>\n<parameter=a b>\nx\n</parameter>\n</function>\n"
                           "</tool_call>", "malformed_structure"),
    ("text inside function", "<tool_call>\n<function=get_weather>\ncity: Paris\n</function>\n</tool_call>",
     "malformed_structure"),
    ("second call broken", PARIS + "\n" + call("get_time"), "undeclared_tool"),
]


@pytest.mark.parametrize("markup, reason", [case[1:] for case in FALLBACKS], ids=[case[0] for case in FALLBACKS])
def test_strict_fallback_returns_every_byte_as_content(markup: str, reason: str):
    summary, decoder = decode("Thinking.\n</think>\n\nBefore. " + markup)
    assert summary == [("reasoning", "Thinking."), ("content", "Before. " + markup)]
    report = decoder.parse_report
    assert (report.marker_seen, report.calls, report.fallback_reason) == (True, 0, reason)


def test_text_after_a_fallback_streams_as_content():
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=False)
    assert decoder.push("<tool_call>\n<function=nope>") == [ContentDelta("<tool_call>\n<function=nope>")]
    assert decoder.push(f"\nthen {PARIS}") == [ContentDelta(f"\nthen {PARIS}")]
    assert decoder.finish() == []
    assert decoder.parse_report.fallback_reason == "undeclared_tool"


def test_strict_mode_releases_calls_only_when_the_output_ends():
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=False)
    assert decoder.push(PARIS) == []
    assert [type(event) for event in decoder.finish()][:1] == [ToolCallStarted]


TOLERANT = [
    ("missing close at the end", PARIS.removesuffix("</tool_call>") + "\n",
     [("call", "get_weather", None, arguments({"city": "Paris", "days": 3}))], "none"),
    ("missing close between calls", PARIS.removesuffix("</tool_call>") + "\n" + LONDON,
     [("call", "get_weather", None, arguments({"city": "Paris", "days": 3})),
      ("call", "get_weather", None, arguments({"city": "London"}))], "none"),
    ("suffix after the last call", PARIS + "\n\nDone, see above.",
     [("call", "get_weather", None, arguments({"city": "Paris", "days": 3})),
      ("content", "Done, see above.")], "trailing_content"),  # content as a whole is lstrip("\n")-ed
    ("text after a missing close", PARIS.removesuffix("</tool_call>") + "oops",
     [("call", "get_weather", None, arguments({"city": "Paris", "days": 3})), ("content", "oops")],
     "trailing_content"),
    ("output ends inside the next call", PARIS + "\n" + LONDON[:40],
     [("call", "get_weather", None, arguments({"city": "Paris", "days": 3})), ("content", LONDON[:40])],
     "malformed_structure"),
    ("undeclared first call", call("get_time") + "\n" + LONDON,
     [("content", call("get_time") + "\n" + LONDON)], "undeclared_tool"),
]


@pytest.mark.parametrize("markup, expected, reason", [case[1:] for case in TOLERANT],
                         ids=[case[0] for case in TOLERANT])
def test_tolerant_mode_recovers_complete_calls(markup: str, expected: list[tuple], reason: str):
    summary, decoder = decode("Go.\n</think>\n\n" + markup, tolerant=True)
    assert summary == [("reasoning", "Go."), *expected]
    assert decoder.parse_report.fallback_reason == reason
    assert decoder.parse_report.calls == sum(item[0] == "call" for item in expected)


def test_tolerant_mode_releases_a_call_when_its_function_closes():
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=False, tolerant=True)
    assert decoder.push(PARIS[:-len("\n</tool_call>")]) != []
    assert decoder.push("\n</tool_call>") == []
    assert decoder.finish() == []


def test_no_tools_declared_means_markup_is_content():
    summary, decoder = decode(f"Here: {PARIS}", [], reasoning=False)
    assert summary == [("content", f"Here: {PARIS}")]
    report = decoder.parse_report
    assert (report.marker_seen, report.calls, report.fallback_reason) == (True, 0, "undeclared_tool")
    streaming = QwenOutputDecoder([], starts_in_reasoning=False)
    assert streaming.push("a <tool") == [ContentDelta("a <tool")]


def test_namespaced_tools_map_back_to_namespace_and_name():
    weather = ToolSpec("get_current", namespace="mcp__weather", internal_name="mcp__weather__get_current")
    news = ToolSpec("get_current", {"type": "object", "properties": {"limit": {"type": "integer"}}},
                    namespace="mcp__news", internal_name="mcp__news__get_current")
    tools = [weather, news]
    summary, decoder = decode(call("mcp__news__get_current", ("limit", "5")) + "\n"
                              + call("mcp__weather__get_current", ("city", "Oslo")), tools, reasoning=False)
    assert summary == [("call", "get_current", "mcp__news", arguments({"limit": 5})),
                       ("call", "get_current", "mcp__weather", arguments({"city": "Oslo"}))]
    assert decoder.tool_identities == {"mcp__weather__get_current": ("mcp__weather", "get_current"),
                                       "mcp__news__get_current": ("mcp__news", "get_current")}
    summary, decoder = decode(call("get_current"), tools, reasoning=False)
    assert decoder.parse_report.fallback_reason == "undeclared_tool"


def test_tool_declarations_are_validated():
    with pytest.raises(InvalidRequestError, match="internal name"):
        ToolSpec("get_current", namespace="mcp__weather")
    with pytest.raises(InvalidRequestError, match="same name"):
        QwenOutputDecoder([WEATHER, WEATHER], starts_in_reasoning=False)
    with pytest.raises(InvalidRequestError, match="JSON schema"):
        ToolSpec("f", parameters=["not", "a", "schema"])  # type: ignore[arg-type]


def test_driving_the_decoder_against_its_contract_fails_clearly():
    decoder = QwenOutputDecoder(TOOLS, starts_in_reasoning=True)
    with pytest.raises(OutputDecoderError, match="token_count"):
        decoder.push("x", token_count=-1)
    decoder.finish()
    with pytest.raises(OutputDecoderError, match="after finish"):
        decoder.push("x")
    with pytest.raises(OutputDecoderError, match="twice"):
        decoder.finish()


# ---------------------------------------------------------------------------------------------------------------
# Typed parameter conversion
# ---------------------------------------------------------------------------------------------------------------

TYPED_SCHEMA = {"type": "object", "properties": {
    "s": {"type": "string"}, "i": {"type": "integer"}, "n": {"type": "number"}, "b": {"type": "boolean"},
    "z": {"type": "null"}, "o": {"type": "object"}, "a": {"type": "array"}, "in": {"type": ["integer", "null"]},
    "ib": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    "sn": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "nn": {"oneOf": [{"type": "number"}, {"type": "null"}]},
    "ref": {"anyOf": [{"$ref": "#/defs/x"}, {"type": "string"}]}, "free": {"description": "no type"}}}

CONVERSIONS = [
    ("s", "", "", 0, 0), ("s", "42", "42", 0, 0), ("s", " true ", " true ", 0, 0),
    ("i", "42", 42, 0, 0), ("i", "5.0", 5.0, 0, 0), ("i", "4.5", 4.5, 0, 1), ("i", "abc", "abc", 0, 1),
    ("i", "NaN", "NaN", 0, 1), ("i", '"7"', "7", 0, 1),
    ("n", "3.25", 3.25, 0, 0), ("n", "7", 7, 0, 0), ("n", "1e999", "1e999", 0, 1),
    ("b", "true", True, 0, 0), ("b", "TRUE", True, 0, 0), ("b", "False", False, 0, 0), ("b", "yes", "yes", 0, 1),
    ("z", "null", None, 0, 0), ("z", "nil", "nil", 0, 1),
    ("o", '{"k": [1, 2]}', {"k": [1, 2]}, 0, 0), ("o", "[1]", [1], 0, 1),
    ("a", '[1, "x"]', [1, "x"], 0, 0), ("a", "1, 2", "1, 2", 0, 1),
    ("in", "null", None, 0, 0), ("in", "8", 8, 0, 0),
    ("ib", "7", 7, 0, 0), ("ib", "True", True, 0, 0), ("ib", "x", "x", 0, 1),
    ("sn", "null", "null", 0, 0), ("sn", "", "", 0, 0),
    ("nn", "2.5", 2.5, 0, 0),
    ("ref", "[1]", [1], 0, 0), ("ref", "plain", "plain", 0, 0),
    ("free", "[1, 2]", [1, 2], 0, 0), ("free", "hello", "hello", 0, 0), ("free", "True", "True", 0, 0),
    ("free", '"quoted"', "quoted", 0, 0), ("free", "", "", 0, 0),
    ("undeclared", "12", 12, 0, 0), ("undeclared", "x y", "x y", 0, 0),
]


@pytest.mark.parametrize("name, text, value, omitted, mismatched", CONVERSIONS)
def test_typed_conversion(name: str, text: str, value: Any, omitted: int, mismatched: int):
    converted = convert_arguments(TYPED_SCHEMA, [(name, text)])
    assert converted.values == {name: value} and type(converted.values[name]) is type(value)
    assert (converted.omitted_empty, converted.schema_mismatched) == (omitted, mismatched)


@pytest.mark.parametrize("name", ["i", "n", "b", "z", "o", "a", "in", "ib", "nn"])
def test_empty_value_of_a_non_string_parameter_is_omitted(name: str):
    converted = convert_arguments(TYPED_SCHEMA, [(name, "")])
    assert (converted.values, converted.omitted_empty, converted.schema_mismatched) == ({}, 1, 0)


def test_declared_types():
    assert declared_types({"type": "string"}) == {"string"}
    assert declared_types({"type": ["integer", "null"]}) == {"integer", "null"}
    assert declared_types({"oneOf": [{"type": "number"}, {"type": ["boolean", "null"]}]}) == {
        "number", "boolean", "null"}
    assert declared_types({"anyOf": [{"type": "object"}, {"type": "null"}]}) is None  # not only primitives
    assert declared_types({"anyOf": [{"type": "string"}, {"enum": [1]}]}) is None
    assert declared_types({"type": "decimal"}) is None
    assert declared_types({"enum": ["a"]}) is None and declared_types(None) is None


def test_typed_arguments_through_the_decoder_keep_output_order_and_count():
    tool = ToolSpec("typed", TYPED_SCHEMA)
    text = call("typed", ("b", "TRUE"), ("s", "Zürich"), ("i", ""), ("o", '{"z": 1, "a": 2}'), ("i2", "x"),
                ("n", "oops"), ("a", "[]"))
    summary, decoder = decode(text, [tool], reasoning=False)
    expected = {"b": True, "s": "Zürich", "o": {"z": 1, "a": 2}, "i2": "x", "n": "oops", "a": []}
    assert summary == [("call", "typed", None, json.dumps(expected, ensure_ascii=False))]
    assert list(json.loads(summary[0][3])) == ["b", "s", "o", "i2", "n", "a"]
    report = decoder.parse_report
    assert (report.omitted_empty_arguments, report.schema_mismatched_arguments) == (1, 1)


def test_counters_only_count_returned_calls():
    tool = ToolSpec("typed", TYPED_SCHEMA)
    _, decoder = decode(call("typed", ("i", ""), ("n", "x")) + " trailing", [tool], reasoning=False)
    report = decoder.parse_report
    assert (report.calls, report.omitted_empty_arguments, report.schema_mismatched_arguments) == (0, 0, 0)


# ---------------------------------------------------------------------------------------------------------------
# Round trip through ninfer's Qwen chat templates
# ---------------------------------------------------------------------------------------------------------------


def _template(name: str):
    templates = pytest.importorskip("ninfer.plugins.qwen3_5.frontend.templates")
    from ninfer.core.chat_template import ChatTemplate

    return ChatTemplate(templates.template_source(name))


ROUND_TRIPS = [
    "I should check the weather.\n</think>\n\nLet me look that up.\n\n" + PARIS,
    "Two cities.\n</think>\n\n" + PARIS + "\n" + LONDON,
    "Just answer.\n</think>\n\nIt is sunny.",
    "Write it.\n</think>\n\n" + call("write_file", ("path", "a.md"),
                                     ("content", "# Doc\n<parameter=x>\nv\n</parameter>\n\nend\n")),
    "Typed.\n</think>\n\n" + call("typed", ("i", "3"), ("b", "true"), ("o", '{"k": [1, 2.5, null]}'),
                                  ("s", "text")),
]


@pytest.mark.parametrize("template_name", ["qwen3_6", "qwen3_8"])
@pytest.mark.parametrize("generated", ROUND_TRIPS, ids=["text_then_call", "parallel", "no_call", "nested_value",
                                                       "typed"])
def test_parsed_output_replays_to_the_generated_text(template_name: str, generated: str):
    template = _template(template_name)
    tools = [*TOOLS, ToolSpec("typed", TYPED_SCHEMA)]
    summary, _ = decode(generated, tools)
    message: dict[str, Any] = {"role": "assistant", "content": "", "reasoning_content": ""}
    for item in summary:
        if item[0] == "reasoning":
            message["reasoning_content"] = item[1]
        elif item[0] == "content":
            message["content"] = item[1]
        else:
            message.setdefault("tool_calls", []).append(
                {"type": "function", "function": {"name": item[1], "arguments": json.loads(item[3])}})
    wire_tools = [{"type": "function", "function": {"name": spec.name, "parameters": spec.parameters}}
                  for spec in tools]
    user = [{"role": "user", "content": "Question?"}]
    options = {"reasoning_effort": "medium"} if template_name == "qwen3_8" else {}
    prompt = template.render(user, tools=wire_tools, add_generation_prompt=True, **options)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    replay = template.render([*user, message], tools=wire_tools, add_generation_prompt=False, **options)
    assert replay == prompt + generated + "<|im_end|>\n"
