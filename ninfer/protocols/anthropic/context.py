"""Anthropic ``context_management``: server-side context editing of the lowered history, before the prompt renders.

Source: Anthropic's "Context editing" guide (platform.claude.com/docs/en/build-with-claude/context-editing) and the
official SDK's beta types (``BetaClearToolUses20250919EditParam``, ``BetaClearThinking20251015EditParam``,
``BetaContextManagementResponse``, ``BetaCountTokensContextManagementResponse``). The client keeps its full history;
edits change only the prompt of this request.

Request: ``context_management: {"edits": [...]}`` (``edits`` optional); unknown fields, unknown edit types, a
repeated type, and malformed parameters are 400s naming the field path. ``compact_20260112`` is rejected: it needs
a model-written summary, which ninfer does not produce. With several edits, ``clear_thinking_20251015`` must come
first; edits apply in the listed order, each to the result of the previous one.

``clear_thinking_20251015`` (requires thinking on for the request: ``thinking`` enabled/adaptive, or omitted with
the server default on): ``keep`` is ``{"type": "thinking_turns", "value": N}`` with N >= 1, or ``"all"`` (also
``{"type": "all"}``); omitted, ``{"type": "thinking_turns", "value": 1}`` (the guide's default for models that do
not keep every turn). The assistant turns that carry thinking are listed oldest first; every one but the last N
loses its thinking. ``"all"`` changes nothing. (The Qwen templates drop the reasoning of turns before the last user
message unless ``preserve_thinking``; the edit applies to the history either way, so it also holds with
``preserve_thinking``, inside a tool loop, and in the report.)

``clear_tool_uses_20250919``: a tool use is one ``tool_result`` (with its ``tool_use`` when the history holds it), in
chronological order.

- ``trigger``: ``{"type": "input_tokens", "value": N}`` (default N = 100000) fires when the prompt's token count
  exceeds N; ``{"type": "tool_uses", "value": N}`` when the history holds more than N tool uses.
- ``keep``: ``{"type": "tool_uses", "value": N}`` (default 3): the last N tool uses stay as they are.
- ``exclude_tools`` (default none): uses of these tool names are never cleared (a result whose call is not in the
  history has no name and is never excluded).
- Once fired, every older, non-excluded tool use is cleared: its result content becomes the one text
  :data:`CLEARED_TOOL_RESULT` (``is_error`` and a cache breakpoint on it are kept), and with ``clear_tool_inputs``
  ``true`` (or a list naming its tool) its call's input becomes ``{}``. The guide does not publish the API's
  placeholder wording; ninfer uses Claude Code's wording for a cleared result.
- ``clear_at_least``: ``{"type": "input_tokens", "value": N}`` (default none): if that clearing removes fewer than N
  prompt tokens, the edit is not applied at all.

Token counts are the frontend's exact prompt counts of the lowered conversation (system, tools and thinking mode
included), counted only where an edit needs them. An edit is reported only when it cleared something:
``{"type": ..., "cleared_tool_uses" | "cleared_thinking_turns": n, "cleared_input_tokens": before - after}`` (the
token difference can be 0 when the template would not have rendered the cleared thinking). A request that sent
``context_management`` gets ``context_management: {"applied_edits": [...]}`` on the message (streaming: on the
final ``message_delta``) and ``context_management: {"original_input_tokens": n}`` from count_tokens.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs

from ninfer.core.conversation import Conversation, Message, TextPart
from ninfer.protocols.fields import malformed, member_path, quoted, type_name, type_tag, unsupported

CLEAR_THINKING = "clear_thinking_20251015"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
COMPACT = "compact_20260112"
CLEARED_TOOL_RESULT = "[Old tool result content cleared]"
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3
DEFAULT_KEEP_THINKING_TURNS = 1

Count = Callable[[Conversation], int]


# -- the validated config --------------------------------------------------------------------------


@attrs.frozen
class ClearThinking:
    """Keep the thinking of the last ``keep_turns`` thinking turns (None: keep all)."""

    keep_turns: int | None = DEFAULT_KEEP_THINKING_TURNS
    type = CLEAR_THINKING


@attrs.frozen
class ClearToolUses:
    trigger_kind: str = "input_tokens"  # or "tool_uses"
    trigger_value: int = DEFAULT_TRIGGER_TOKENS
    keep: int = DEFAULT_KEEP_TOOL_USES
    clear_at_least: int | None = None
    exclude_tools: frozenset[str] = frozenset()
    clear_tool_inputs: bool | frozenset[str] = False  # a set: clear the inputs of these tools only
    type = CLEAR_TOOL_USES


Edit = ClearThinking | ClearToolUses


@attrs.frozen
class ContextManagement:
    edits: tuple[Edit, ...] = ()


# -- parsing ---------------------------------------------------------------------------------------


def _fields(raw: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in raw:
        if key not in allowed:
            raise malformed(member_path(where, key), f"unknown field (expected {', '.join(allowed)})")


def _amount(raw: Any, where: str, kinds: tuple[str, ...], minimum: int = 0) -> tuple[str, int]:
    """A ``{"type": kind, "value": N}`` object: its kind and its integer value (>= ``minimum``)."""
    if not isinstance(raw, dict):
        raise malformed(where, f"expected an object {{\"type\": ..., \"value\": N}}, got {type_name(raw)}")
    _fields(raw, ("type", "value"), where)
    kind = type_tag(raw, where)
    if kind not in kinds:
        raise malformed(f"{where}.type", f"expected {' or '.join(repr(k) for k in kinds)}, got {quoted(kind)}")
    value = raw.get("value")
    if isinstance(value, bool) or not isinstance(value, int):
        raise malformed(f"{where}.value", f"expected an integer, got {type_name(value)}")
    if value < minimum:
        raise malformed(f"{where}.value", f"must be at least {minimum}, got {value}")
    return kind, value


def _names(raw: Any, where: str) -> frozenset[str]:
    if not isinstance(raw, list) or not all(isinstance(name, str) and name for name in raw):
        raise malformed(where, "expected an array of tool names")
    return frozenset(raw)


def _clear_thinking(raw: Mapping[str, Any], where: str) -> ClearThinking:
    _fields(raw, ("type", "keep"), where)
    keep = raw.get("keep")
    if keep is None:
        return ClearThinking()
    if keep == "all" or keep == {"type": "all"}:
        return ClearThinking(None)
    _, value = _amount(keep, f"{where}.keep", ("thinking_turns",), minimum=1)
    return ClearThinking(value)


def _clear_tool_uses(raw: Mapping[str, Any], where: str) -> ClearToolUses:
    _fields(raw, ("type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"), where)
    edit = ClearToolUses()
    if raw.get("trigger") is not None:
        kind, value = _amount(raw["trigger"], f"{where}.trigger", ("input_tokens", "tool_uses"))
        edit = attrs.evolve(edit, trigger_kind=kind, trigger_value=value)
    if raw.get("keep") is not None:
        edit = attrs.evolve(edit, keep=_amount(raw["keep"], f"{where}.keep", ("tool_uses",))[1])
    if raw.get("clear_at_least") is not None:
        at_least = _amount(raw["clear_at_least"], f"{where}.clear_at_least", ("input_tokens",))[1]
        edit = attrs.evolve(edit, clear_at_least=at_least)
    if raw.get("exclude_tools") is not None:
        edit = attrs.evolve(edit, exclude_tools=_names(raw["exclude_tools"], f"{where}.exclude_tools"))
    inputs = raw.get("clear_tool_inputs")
    if inputs is not None:
        if not isinstance(inputs, (bool, list)):
            raise malformed(f"{where}.clear_tool_inputs", f"expected a boolean or an array of tool names, got "
                            f"{type_name(inputs)}")
        edit = attrs.evolve(edit, clear_tool_inputs=inputs if isinstance(inputs, bool)
                            else _names(inputs, f"{where}.clear_tool_inputs"))
    return edit


def parse_context_management(body: Mapping[str, Any], *, thinking_on: bool,
                             thinking_source: str = "") -> ContextManagement | None:
    """``body["context_management"]`` validated (None when absent). ``thinking_on`` is the request's effective
    thinking; ``thinking_source`` says why it is off, for the error."""
    raw = body.get("context_management")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise malformed("context_management", f"expected an object with an edits array, got {type_name(raw)}")
    _fields(raw, ("edits",), "context_management")
    edits_raw = raw.get("edits")
    if edits_raw is None:
        return ContextManagement()
    if not isinstance(edits_raw, list):
        raise malformed("context_management.edits", f"expected an array of edits, got {type_name(edits_raw)}")
    edits: list[Edit] = []
    for index, item in enumerate(edits_raw):
        where = f"context_management.edits.{index}"
        if not isinstance(item, dict):
            raise malformed(where, f"expected an edit object, got {type_name(item)}")
        kind = type_tag(item, where)
        if kind == COMPACT:
            raise unsupported(f"{where}.type", "server-side compaction replaces the history with a model-written "
                              "summary, which ninfer does not produce (compact on the client instead)")
        if kind not in (CLEAR_THINKING, CLEAR_TOOL_USES):
            raise malformed(f"{where}.type", f"unknown edit type {quoted(kind)} (expected {quoted(CLEAR_TOOL_USES)} "
                            f"or {quoted(CLEAR_THINKING)})")
        if any(edit.type == kind for edit in edits):
            raise malformed(f"{where}.type", f"duplicate edit type {quoted(kind)}")
        if kind == CLEAR_THINKING:
            if edits:
                raise malformed(f"{where}.type", f"{CLEAR_THINKING} must be listed first in edits")
            if not thinking_on:
                raise malformed(f"{where}.type", f"{CLEAR_THINKING} requires thinking to be enabled or adaptive"
                                + (f" ({thinking_source})" if thinking_source else ""))
            edits.append(_clear_thinking(item, where))
        else:
            edits.append(_clear_tool_uses(item, where))
    return ContextManagement(tuple(edits))


# -- the edits on the lowered history ----------------------------------------------------------------


def clear_thinking(messages: tuple[Message, ...], keep_turns: int | None) -> tuple[tuple[Message, ...], int]:
    """Drop the thinking of every assistant turn with thinking but the last ``keep_turns``; the number dropped."""
    if keep_turns is None:
        return messages, 0
    turns = [i for i, message in enumerate(messages) if message.role == "assistant" and message.reasoning is not None]
    cleared = turns[:max(len(turns) - keep_turns, 0)]
    edited = list(messages)
    for i in cleared:
        edited[i] = attrs.evolve(edited[i], reasoning=None)
    return tuple(edited), len(cleared)


@attrs.frozen
class ToolUse:
    """A tool result's position, the position of the assistant turn whose call it answers (if any), its tool."""

    result_at: int
    call_at: int | None
    name: str | None


def tool_uses(messages: tuple[Message, ...]) -> list[ToolUse]:
    """The tool uses of the history, oldest first."""
    uses: list[ToolUse] = []
    calls: dict[str, tuple[int, str]] = {}  # call id -> (assistant position, tool name), latest turn wins
    for i, message in enumerate(messages):
        for call in message.tool_calls:
            calls[call.call_id] = (i, call.name)
        result = message.tool_result
        if result is not None:
            call_at, name = calls.get(result.call_id, (None, None))
            uses.append(ToolUse(i, call_at, result.name or name))
    return uses


def clear_tool_uses(messages: tuple[Message, ...], edit: ClearToolUses) -> tuple[tuple[Message, ...], int]:
    """Clear every non-excluded tool use older than the last ``edit.keep``; the number cleared (no trigger or
    clear_at_least check here)."""
    uses = tool_uses(messages)
    older = uses[:max(len(uses) - edit.keep, 0)]
    cleared = [use for use in older if use.name is None or use.name not in edit.exclude_tools]
    edited = list(messages)
    for use in cleared:
        result = edited[use.result_at].tool_result
        assert result is not None
        marker = any(part.cache_breakpoint for part in result.parts)
        placeholder = attrs.evolve(result, parts=(TextPart(CLEARED_TOOL_RESULT, marker),))
        edited[use.result_at] = attrs.evolve(edited[use.result_at], tool_result=placeholder)
        inputs = edit.clear_tool_inputs
        if use.call_at is not None and (inputs is True or (isinstance(inputs, frozenset) and use.name in inputs)):
            turn = edited[use.call_at]
            calls = tuple(attrs.evolve(call, arguments={}) if call.call_id == result.call_id else call
                          for call in turn.tool_calls)
            edited[use.call_at] = attrs.evolve(turn, tool_calls=calls)
    return tuple(edited), len(cleared)


# -- applying a config -------------------------------------------------------------------------------


@attrs.frozen
class AppliedEdit:
    type: str
    cleared: int  # thinking turns or tool uses
    cleared_input_tokens: int

    def wire(self) -> dict[str, Any]:
        key = "cleared_thinking_turns" if self.type == CLEAR_THINKING else "cleared_tool_uses"
        return {"type": self.type, key: self.cleared, "cleared_input_tokens": self.cleared_input_tokens}


@attrs.frozen
class EditedConversation:
    """The edited conversation, the edits that cleared something, and the prompt counts taken on the way (None
    where no edit needed one)."""

    conversation: Conversation
    applied: tuple[AppliedEdit, ...]
    original_tokens: int | None
    tokens: int | None

    def response_field(self) -> dict[str, Any]:
        return {"applied_edits": [edit.wire() for edit in self.applied]}


class _Editing:
    """The conversation under edit and its prompt count, counted at most once per state."""

    def __init__(self, conversation: Conversation, count: Count) -> None:
        self.conversation = conversation
        self.count = count
        self.tokens: int | None = None
        self.original_tokens: int | None = None
        self.applied: list[AppliedEdit] = []

    def measure(self) -> int:
        if self.tokens is None:
            self.tokens = self.count(self.conversation)
            if not self.applied:
                self.original_tokens = self.tokens
        return self.tokens

    def apply(self, kind: str, messages: tuple[Message, ...], cleared: int, at_least: int | None = None) -> None:
        before = self.measure()
        candidate = attrs.evolve(self.conversation, messages=messages)
        after = self.count(candidate)
        if at_least is not None and before - after < at_least:
            return
        self.conversation, self.tokens = candidate, after
        self.applied.append(AppliedEdit(kind, cleared, before - after))


def apply_context_management(conversation: Conversation, config: ContextManagement,
                             count: Count) -> EditedConversation:
    """Apply ``config``'s edits in order (see the module docstring); ``count`` gives a conversation's prompt
    tokens."""
    state = _Editing(conversation, count)
    for edit in config.edits:
        messages = state.conversation.messages
        if isinstance(edit, ClearThinking):
            edited, cleared = clear_thinking(messages, edit.keep_turns)
            if cleared:
                state.apply(edit.type, edited, cleared)
            continue
        if edit.trigger_kind == "tool_uses":
            fired = len(tool_uses(messages)) > edit.trigger_value
        else:
            fired = state.measure() > edit.trigger_value
        if not fired:
            continue
        edited, cleared = clear_tool_uses(messages, edit)
        if cleared:
            state.apply(edit.type, edited, cleared, edit.clear_at_least)
    return EditedConversation(state.conversation, tuple(state.applied), state.original_tokens, state.tokens)
