"""Anthropic ``context_management`` edits on the lowered history (``ninfer.protocols.anthropic.context``), without a
server: which tool results become the placeholder, which thinking is dropped, triggers, ``clear_at_least``, the
reported counts, and the 400s for bad configurations. The counter is a stand-in that counts characters of tool
result text, call inputs and reasoning, so every expected number below is written out by hand."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ninfer.core.conversation import Conversation, TextPart
from ninfer.core.errors import InvalidRequestError
from ninfer.protocols.anthropic.context import (
    CLEARED_TOOL_RESULT,
    ClearThinking,
    ClearToolUses,
    ContextManagement,
    apply_context_management,
)
from ninfer.protocols.anthropic.request import RequestSettings, parse_messages_request

SETTINGS = RequestSettings(vision=False, default_max_tokens=64, default_thinking=True)
PLACEHOLDER_CHARS = len(CLEARED_TOOL_RESULT)
THINKING = "clear_thinking_20251015"
TOOL_USES = "clear_tool_uses_20250919"


def chars(conversation: Conversation) -> int:
    """The stand-in prompt count: characters of tool result text, call inputs (as JSON) and reasoning."""
    total = 0
    for message in conversation.messages:
        total += len(message.reasoning or "")
        total += sum(len(json.dumps(call.arguments)) for call in message.tool_calls)
        if message.tool_result is not None:
            total += sum(len(part.text) for part in message.tool_result.parts if isinstance(part, TextPart))
    return total


class Counter:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, conversation: Conversation) -> int:
        self.calls += 1
        return chars(conversation)


def tool_loop(tools: list[str], result_chars: int = 100) -> list[dict[str, Any]]:
    """A user question, then one assistant turn per tool (thinking ``R<i>``, a call with input ``{"q": "<i>"}``)
    answered by a result of ``result_chars`` characters."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Go."}]
    for i, tool in enumerate(tools):
        messages.append({"role": "assistant", "content": [
            {"type": "thinking", "thinking": f"R{i}", "signature": "s"},
            {"type": "tool_use", "id": f"toolu_{i}", "name": tool, "input": {"q": str(i)}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": str(i) * result_chars}]})
    return messages


def parse(messages: list[dict[str, Any]], *edits: dict[str, Any], **fields: Any):
    body = {"model": "m", "messages": messages, "context_management": {"edits": list(edits)}, **fields}
    return parse_messages_request(body, SETTINGS)


def edit(messages: list[dict[str, Any]], *edits: dict[str, Any], count: Any = chars):
    request = parse(messages, *edits)
    assert request.context_management is not None
    return apply_context_management(request.conversation, request.context_management, count)


def results(conversation: Conversation) -> list[str]:
    return [message.tool_result.parts[0].text for message in conversation.messages if message.tool_result]


def inputs(conversation: Conversation) -> list[dict[str, Any]]:
    return [dict(call.arguments) for message in conversation.messages for call in message.tool_calls]


def reasoning(conversation: Conversation) -> list[str | None]:
    return [message.reasoning for message in conversation.messages if message.role == "assistant"]


# -- parsing -------------------------------------------------------------------------------------------


def test_defaults_follow_the_documented_values():
    config = parse(tool_loop(["a"]), {"type": THINKING}, {"type": TOOL_USES}).context_management
    assert config == ContextManagement((ClearThinking(keep_turns=1), ClearToolUses(
        trigger_kind="input_tokens", trigger_value=100_000, keep=3, clear_at_least=None, exclude_tools=frozenset(),
        clear_tool_inputs=False)))
    assert parse(tool_loop(["a"]), {"type": THINKING, "keep": "all"}).context_management.edits == (ClearThinking(None),)
    assert parse(tool_loop(["a"]), {"type": THINKING, "keep": {"type": "all"}}).context_management.edits == (
        ClearThinking(None),)
    assert parse(tool_loop(["a"])).context_management == ContextManagement(())
    assert parse_messages_request({"model": "m", "messages": tool_loop(["a"])}, SETTINGS).context_management is None


# -- clear_tool_uses -----------------------------------------------------------------------------------


def test_tool_uses_beyond_keep_become_the_placeholder_except_excluded_tools():
    edited = edit(tool_loop(["read", "read", "search", "read", "read"]),
                  {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses",
                                                                                             "value": 2},
                   "exclude_tools": ["search"]})
    # uses 0 and 1 are older than the last two and not excluded; use 2 (search) is excluded; 3 and 4 are kept
    assert results(edited.conversation) == [CLEARED_TOOL_RESULT, CLEARED_TOOL_RESULT, "2" * 100, "3" * 100, "4" * 100]
    assert inputs(edited.conversation) == [{"q": "0"}, {"q": "1"}, {"q": "2"}, {"q": "3"}, {"q": "4"}]  # inputs kept
    assert reasoning(edited.conversation) == ["R0", "R1", "R2", "R3", "R4"]
    assert [e.wire() for e in edited.applied] == [
        {"type": TOOL_USES, "cleared_tool_uses": 2, "cleared_input_tokens": 2 * (100 - PLACEHOLDER_CHARS)}]
    assert (edited.original_tokens, edited.tokens) == (5 * 100 + 5 * 10 + 5 * 2,
                                                       5 * 100 + 5 * 10 + 5 * 2 - 2 * (100 - PLACEHOLDER_CHARS))


def test_clear_tool_inputs_true_or_by_tool_name():
    loop = tool_loop(["read", "search", "read", "read"])
    every = edit(loop, {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 0},
                        "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": True})
    assert inputs(every.conversation) == [{}, {}, {}, {"q": "3"}]
    assert results(every.conversation) == [CLEARED_TOOL_RESULT] * 3 + ["3" * 100]
    # len('{"q": "0"}') == 10 for each cleared input, 100 - 33 for each cleared result
    assert every.applied[0].cleared_input_tokens == 3 * (100 - PLACEHOLDER_CHARS) + 3 * (10 - 2)
    named = edit(loop, {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 0},
                        "keep": {"type": "tool_uses", "value": 1}, "clear_tool_inputs": ["search"]})
    assert inputs(named.conversation) == [{"q": "0"}, {}, {"q": "2"}, {"q": "3"}]


def test_tool_uses_trigger_fires_only_above_its_value():
    loop = tool_loop(["a", "a", "a", "a"])
    at = edit(loop, {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 4}, "keep": {"type": "tool_uses",
                                                                                              "value": 1}})
    assert at.applied == () and results(at.conversation) == ["0" * 100, "1" * 100, "2" * 100, "3" * 100]
    above = edit(loop, {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 3}, "keep": {"type": "tool_uses",
                                                                                                 "value": 1}})
    assert results(above.conversation) == [CLEARED_TOOL_RESULT] * 3 + ["3" * 100]


def test_input_tokens_trigger_fires_when_the_prompt_exceeds_it():
    loop = tool_loop(["a", "a"])  # 2 * 100 result chars + 2 * 10 input chars + 2 * 2 reasoning chars = 224
    keep_none = {"type": "tool_uses", "value": 0}
    at = edit(loop, {"type": TOOL_USES, "trigger": {"type": "input_tokens", "value": 224}, "keep": keep_none})
    assert at.applied == () and at.original_tokens == 224 and at.tokens == 224
    above = edit(loop, {"type": TOOL_USES, "trigger": {"type": "input_tokens", "value": 223}, "keep": keep_none})
    assert results(above.conversation) == [CLEARED_TOOL_RESULT, CLEARED_TOOL_RESULT]
    assert [e.wire() for e in above.applied] == [{"type": TOOL_USES, "cleared_tool_uses": 2,
                                                  "cleared_input_tokens": 2 * (100 - PLACEHOLDER_CHARS)}]
    # the default trigger (100000 input tokens) is not reached by this history
    assert edit(loop, {"type": TOOL_USES}).applied == ()


def test_clear_at_least_unmet_applies_no_clearing():
    loop = tool_loop(["a", "a", "a"])
    edit_with = {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 0}, "keep": {"type": "tool_uses",
                                                                                          "value": 1}}
    clearable = 2 * (100 - PLACEHOLDER_CHARS)  # the two older results
    met = edit(loop, {**edit_with, "clear_at_least": {"type": "input_tokens", "value": clearable}})
    assert results(met.conversation) == [CLEARED_TOOL_RESULT, CLEARED_TOOL_RESULT, "2" * 100]
    unmet = edit(loop, {**edit_with, "clear_at_least": {"type": "input_tokens", "value": clearable + 1}})
    assert unmet.applied == () and results(unmet.conversation) == ["0" * 100, "1" * 100, "2" * 100]


def test_results_without_their_call_are_tool_uses_without_a_name():
    imported = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "x" * 50},
                                             {"type": "text", "text": "Go on."}]},
                *tool_loop(["search"])[1:]]
    edited = edit(imported, {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 0},
                             "keep": {"type": "tool_uses", "value": 0}, "exclude_tools": ["search"],
                             "clear_tool_inputs": True})
    assert results(edited.conversation) == [CLEARED_TOOL_RESULT, "0" * 100]
    assert inputs(edited.conversation) == [{"q": "0"}]


def test_a_cleared_result_keeps_its_error_flag_and_cache_breakpoint():
    loop = tool_loop(["a", "a"])
    loop[2]["content"][0].update(is_error=True, cache_control={"type": "ephemeral"})
    edited = edit(loop, {"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 0},
                         "keep": {"type": "tool_uses", "value": 1}})
    result = edited.conversation.messages[2].tool_result
    assert result.parts == (TextPart(CLEARED_TOOL_RESULT, cache_breakpoint=True),) and result.is_error


# -- clear_thinking ------------------------------------------------------------------------------------


def test_thinking_of_turns_older_than_the_last_n_thinking_turns_is_dropped():
    history = [{"role": "user", "content": "Q1"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "R1", "signature": "s"},
                                                 {"type": "text", "text": "A1"}]},
               {"role": "user", "content": "Q2"},
               {"role": "assistant", "content": "A2 without thinking"},
               {"role": "user", "content": "Q3"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "R3", "signature": "s"},
                                                 {"type": "text", "text": "A3"}]},
               {"role": "user", "content": "Q4"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "R4", "signature": "s"},
                                                 {"type": "text", "text": "A4"}]},
               {"role": "user", "content": "Q5"}]
    one = edit(history, {"type": THINKING})
    assert reasoning(one.conversation) == [None, None, None, "R4"]
    assert [e.wire() for e in one.applied] == [{"type": THINKING, "cleared_thinking_turns": 2,
                                                "cleared_input_tokens": 4}]
    two = edit(history, {"type": THINKING, "keep": {"type": "thinking_turns", "value": 2}})
    assert reasoning(two.conversation) == [None, None, "R3", "R4"]
    assert [e.wire() for e in two.applied] == [{"type": THINKING, "cleared_thinking_turns": 1,
                                                "cleared_input_tokens": 2}]
    many = edit(history, {"type": THINKING, "keep": {"type": "thinking_turns", "value": 3}})
    assert many.applied == () and reasoning(many.conversation) == ["R1", None, "R3", "R4"]


def test_keep_all_changes_nothing_and_counts_nothing():
    counter = Counter()
    edited = edit(tool_loop(["a", "a"]), {"type": THINKING, "keep": "all"}, count=counter)
    assert edited.applied == () and reasoning(edited.conversation) == ["R0", "R1"]
    assert counter.calls == 0 and edited.original_tokens is None and edited.tokens is None


def test_edits_apply_in_order_and_the_tool_trigger_sees_the_thinking_edit():
    loop = tool_loop(["a", "a", "a"], result_chars=40)  # 3 * 40 + 3 * 10 + 3 * 2 = 156; thinking edit leaves 152
    edits = ({"type": THINKING}, {"type": TOOL_USES, "trigger": {"type": "input_tokens", "value": 152},
                                  "keep": {"type": "tool_uses", "value": 2}})
    assert [e.type for e in edit(loop, *edits).applied] == [THINKING]
    counter = Counter()
    fired = edit(loop, edits[0], {**edits[1], "trigger": {"type": "input_tokens", "value": 151}}, count=counter)
    assert reasoning(fired.conversation) == [None, None, "R2"]
    assert results(fired.conversation) == [CLEARED_TOOL_RESULT, "1" * 40, "2" * 40]
    assert [e.wire() for e in fired.applied] == [
        {"type": THINKING, "cleared_thinking_turns": 2, "cleared_input_tokens": 4},
        {"type": TOOL_USES, "cleared_tool_uses": 1, "cleared_input_tokens": 40 - PLACEHOLDER_CHARS}]
    assert (fired.original_tokens, fired.tokens) == (156, 152 - (40 - PLACEHOLDER_CHARS))
    assert counter.calls == 3  # the original, after the thinking edit, after the tool edit
    assert fired.response_field() == {"applied_edits": [e.wire() for e in fired.applied]}


# -- bad configurations --------------------------------------------------------------------------------

EDITS = "context_management.edits"
BAD = [
    # (id, context_management, extra body fields, the field named)
    ("not_object", ["x"], {}, "context_management"),
    ("unknown_field", {"edits": [], "mode": "x"}, {}, "context_management.mode"),
    ("edits_not_array", {"edits": {"type": THINKING}}, {}, EDITS),
    ("edit_not_object", {"edits": ["clear"]}, {}, f"{EDITS}.0"),
    ("unknown_type", {"edits": [{"type": "clear_everything"}]}, {}, f"{EDITS}.0.type"),
    ("missing_type", {"edits": [{}]}, {}, f"{EDITS}.0.type"),
    ("compaction", {"edits": [{"type": "compact_20260112"}]}, {}, f"{EDITS}.0.type"),
    ("duplicate", {"edits": [{"type": TOOL_USES}, {"type": TOOL_USES}]}, {}, f"{EDITS}.1.type"),
    ("thinking_not_first", {"edits": [{"type": TOOL_USES}, {"type": THINKING}]}, {}, f"{EDITS}.1.type"),
    ("thinking_disabled", {"edits": [{"type": THINKING}]}, {"thinking": {"type": "disabled"}}, f"{EDITS}.0.type"),
    ("thinking_keep_tool_uses", {"edits": [{"type": THINKING, "keep": {"type": "tool_uses", "value": 1}}]}, {},
     f"{EDITS}.0.keep.type"),
    ("thinking_keep_zero", {"edits": [{"type": THINKING, "keep": {"type": "thinking_turns", "value": 0}}]}, {},
     f"{EDITS}.0.keep.value"),
    ("thinking_keep_string", {"edits": [{"type": THINKING, "keep": "some"}]}, {}, f"{EDITS}.0.keep"),
    ("thinking_unknown_field", {"edits": [{"type": THINKING, "trigger": {"type": "input_tokens", "value": 1}}]}, {},
     f"{EDITS}.0.trigger"),
    ("tool_keep_thinking_turns", {"edits": [{"type": TOOL_USES, "keep": {"type": "thinking_turns", "value": 1}}]},
     {}, f"{EDITS}.0.keep.type"),
    ("tool_keep_negative", {"edits": [{"type": TOOL_USES, "keep": {"type": "tool_uses", "value": -1}}]}, {},
     f"{EDITS}.0.keep.value"),
    ("trigger_negative", {"edits": [{"type": TOOL_USES, "trigger": {"type": "input_tokens", "value": -5}}]}, {},
     f"{EDITS}.0.trigger.value"),
    ("trigger_kind", {"edits": [{"type": TOOL_USES, "trigger": {"type": "messages", "value": 5}}]}, {},
     f"{EDITS}.0.trigger.type"),
    ("trigger_string_value", {"edits": [{"type": TOOL_USES, "trigger": {"type": "input_tokens", "value": "5"}}]}, {},
     f"{EDITS}.0.trigger.value"),
    ("trigger_bool_value", {"edits": [{"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": True}}]}, {},
     f"{EDITS}.0.trigger.value"),
    ("trigger_extra", {"edits": [{"type": TOOL_USES, "trigger": {"type": "tool_uses", "value": 1, "x": 1}}]}, {},
     f"{EDITS}.0.trigger.x"),
    ("clear_at_least_negative", {"edits": [{"type": TOOL_USES, "clear_at_least": {"type": "input_tokens",
                                                                                   "value": -1}}]}, {},
     f"{EDITS}.0.clear_at_least.value"),
    ("clear_at_least_kind", {"edits": [{"type": TOOL_USES, "clear_at_least": {"type": "tool_uses", "value": 1}}]},
     {}, f"{EDITS}.0.clear_at_least.type"),
    ("exclude_tools", {"edits": [{"type": TOOL_USES, "exclude_tools": "search"}]}, {}, f"{EDITS}.0.exclude_tools"),
    ("clear_tool_inputs", {"edits": [{"type": TOOL_USES, "clear_tool_inputs": "yes"}]}, {},
     f"{EDITS}.0.clear_tool_inputs"),
    ("tool_unknown_field", {"edits": [{"type": TOOL_USES, "keep_latest": 2}]}, {}, f"{EDITS}.0.keep_latest"),
]


@pytest.mark.parametrize(("config", "fields", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_configurations_name_the_field(config, fields, param):
    body = {"model": "m", "messages": tool_loop(["a"]), "context_management": config, **fields}
    with pytest.raises(InvalidRequestError) as raised:
        parse_messages_request(body, SETTINGS)
    assert raised.value.param == param and str(raised.value).startswith(param), str(raised.value)


def test_clear_thinking_needs_thinking_on_which_the_server_default_can_provide():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "context_management": {"edits": [{"type": THINKING, "keep": "all"}]}}
    assert parse_messages_request(body, SETTINGS).context_management.edits == (ClearThinking(None),)
    with pytest.raises(InvalidRequestError, match="requires thinking to be enabled or adaptive .thinking is off by "
                                                  "server default"):
        parse_messages_request(body, RequestSettings(vision=False, default_max_tokens=64, default_thinking=False))
    enabled = parse_messages_request({**body, "thinking": {"type": "adaptive"}},
                                     RequestSettings(vision=False, default_max_tokens=64, default_thinking=False))
    assert enabled.context_management.edits == (ClearThinking(None),)
