"""The Qwen output decoder: splits generated text into reasoning, content and structured tool calls, streaming.

It is protocol-neutral: Chat Completions, Responses and Anthropic adapters all render its :data:`OutputEvent`\\ s.
The engine feeds committed text deltas (UTF-8 safe, stop strings already removed) with the number of tokens they
came from; the decoder holds back only what it must:

- reasoning: a trailing run of ``"\\n"`` (it may be the run before ``</think>``), a partial ``</think>`` and (tools
  declared) a partial ``<tool_call>``; once ``<tool_call>`` is seen, the pending call region until it resolves;
- content: a suffix that could start ``<tool_call>``; once ``<tool_call>`` is seen (tools declared), the whole
  tool-call region until it resolves (see :class:`~ninfer.plugins.qwen3_5.frontend.tool_calls.ToolCallRegionParser`).

Newline rules: the reasoning returned equals ``reasoning.strip("\\n")`` and the content ``content.lstrip("\\n")``,
which is what the chat template keeps, so replaying ``{reasoning_content, content, tool_calls}`` through the
template renders the tokens the model produced. There is at most one tool-call region per output: it starts at the
first ``<tool_call>`` of the content channel and runs to the end; once it resolves, everything after is content.

Calls inside an unclosed ``<think>``: models sometimes emit their tool calls without closing the thinking block. A
``<tool_call>`` in the reasoning channel (tools declared) therefore opens a pending region that is parsed strictly,
whatever ``tolerant`` says: it becomes structured calls only if it holds complete calls to declared tools and the
output ends after them; the reasoning then ends at the opener. Anything else (an undeclared name, malformed or
incomplete markup, more text after the calls, a ``</think>`` before the region resolves) makes the region reasoning
text again, byte for byte as if it had never been held, and leaves the parse report untouched: reasoning that merely
discusses a call is not a tool-call attempt.
"""

from __future__ import annotations

import secrets
import string
from typing import Mapping, Sequence

import attrs

from ninfer.core.errors import NinferError
from ninfer.core.frontend import (
    ContentDelta,
    OutputEvent,
    ParseReport,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from ninfer.plugins.qwen3_5.frontend.tool_calls import (
    TOOL_CALL_OPEN,
    FallbackReason,
    ParsedCall,
    RegionOutcome,
    ToolCallRegionParser,
    ToolIndex,
    ToolSpec,
    arguments_json_pieces,
    convert_arguments,
)

THINK_CLOSE = "</think>"

THINKING_BUDGET_CONTROL_TEXT = (
    "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking directly "
    "now.\n</think>\n\n")

_CALL_ID_ALPHABET = string.ascii_letters + string.digits
_CALL_ID_LENGTH = 24


def thinking_budget_control_text() -> str:
    """Qwen's canonical early-close text the engine inserts when the thinking budget is spent (ends the channel)."""
    return THINKING_BUDGET_CONTROL_TEXT


class OutputDecoderError(NinferError):
    """The decoder was driven against its contract (a push after finish, a bad argument)."""

    code = "output_decoder_misuse"


# ---------------------------------------------------------------------------------------------------------------
# Events and the parse report
# ---------------------------------------------------------------------------------------------------------------


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _new_call_id() -> str:
    """``call_`` + 24 random alphanumerics."""
    return "call_" + "".join(secrets.choice(_CALL_ID_ALPHABET) for _ in range(_CALL_ID_LENGTH))


# ---------------------------------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------------------------------


class QwenOutputDecoder:
    """Incremental reasoning/content/tool-call decoder for one generation.

    ``tools`` is the effective callable set (empty: nothing is ever a call). ``starts_in_reasoning``: the prompt
    ended inside ``<think>`` (thinking enabled). ``tolerant`` selects ``--tolerant-tool-calls`` recovery.
    ``continues_content``: the output continues an assistant prefill's text, so its leading newlines are content
    (they are kept instead of stripped); it cannot be combined with ``starts_in_reasoning``.
    """

    def __init__(self, tools: Sequence[ToolSpec], *, starts_in_reasoning: bool, tolerant: bool = False,
                 continues_content: bool = False) -> None:
        if starts_in_reasoning and continues_content:
            raise OutputDecoderError("an output cannot both start in reasoning and continue prefilled content")
        self._tools = ToolIndex(tools)
        self._tolerant = tolerant
        self._in_reasoning = bool(starts_in_reasoning)
        self._held_newlines = 0         # a trailing "\n" run of reasoning (maybe the run before "</think>")
        self._held_partial = ""         # a partial "</think>" after that run
        self._reasoning_started = False
        self._content_started = bool(continues_content)  # a started content channel keeps leading newlines
        self._content_held = ""         # a partial "<tool_call>" (tools declared, before the region)
        self._marker_tail = ""          # last characters of content, to see the marker when no tools are declared
        self._region: ToolCallRegionParser | None = None
        self._reasoning_region: ToolCallRegionParser | None = None  # a call region opened inside reasoning
        self._reasoning_region_text = ""  # its raw text, replayed as reasoning if it falls back
        self._reasoning_region_tokens = 0  # tokens pushed while it is pending (reasoning tokens if it falls back)
        self._calls_emitted = 0
        self._finished = False
        self._report = ParseReport()
        self._reasoning_tokens = 0

    @property
    def tool_identities(self) -> Mapping[str, tuple[str | None, str]]:
        """Prompt (internal) tool name -> (namespace, name)."""
        return self._tools.identities

    @property
    def in_reasoning(self) -> bool:
        """True while the output is still inside the thinking block."""
        return self._in_reasoning

    @property
    def reasoning_tokens(self) -> int:
        """Tokens pushed while in the reasoning channel (from ``token_count``, never by re-tokenizing)."""
        return self._reasoning_tokens

    @property
    def parse_report(self) -> ParseReport:
        """Tool-call parse diagnostics so far (final after :meth:`finish`)."""
        return self._report

    def push(self, text: str, *, token_count: int = 1) -> list[OutputEvent]:
        """Feed the text of ``token_count`` newly committed tokens; returns the events it releases.

        All tokens of a push that starts in the reasoning channel count as reasoning tokens, except that a push
        leaving a call region pending there counts toward that region (reasoning again only if it falls back); so
        push one token's text at a time (or never let a push cross ``</think>`` or ``<tool_call>``) for exact counts.
        """
        if self._finished:
            raise OutputDecoderError("push() after finish(): the output is already complete")
        if not isinstance(text, str):
            raise OutputDecoderError(f"push() expects text, got {type(text).__name__}")
        if isinstance(token_count, bool) or not isinstance(token_count, int) or token_count < 0:
            raise OutputDecoderError(f"token_count must be a non-negative integer, got {token_count!r}")
        events: list[OutputEvent] = []
        if self._in_reasoning:
            text = self._push_reasoning(text, events)
            if self._reasoning_region is not None:
                self._reasoning_region_tokens += token_count
            else:
                self._reasoning_tokens += token_count
        if not self._in_reasoning and text:
            self._push_content(text, events)
        return events

    def finish(self) -> list[OutputEvent]:
        """The output ended: flush everything held and resolve a pending tool-call region."""
        if self._finished:
            raise OutputDecoderError("finish() called twice")
        self._finished = True
        events: list[OutputEvent] = []
        while self._reasoning_region is not None:
            outcome = self._reasoning_region.close()
            if outcome.fallback_reason is FallbackReason.NONE:
                self._end_reasoning_with_calls(outcome, events)
                return events
            rest = self._push_reasoning(self._reasoning_region_fallback(events), events)
            if rest:
                self._push_content(rest, events)
        if self._in_reasoning:
            self._emit_reasoning_after_newlines(self._held_partial, events)
        elif self._region is not None and not self._region.resolved:
            self._apply_region(self._region.close(), events)
        elif self._content_held:
            self._emit_content(self._content_held, events)
            self._content_held = ""
        return events

    # -- reasoning channel ------------------------------------------------------------------------------------

    def _push_reasoning(self, text: str, events: list[OutputEvent]) -> str:
        """Consume reasoning text; returns the text after ``</think>`` (empty while still reasoning).

        What is held is ``"\\n" * self._held_newlines + self._held_partial`` (a partial marker), or, while a call
        region is pending, that run plus the region text; the run is kept as a count so that a long run of
        newlines costs nothing per push.
        """
        while True:
            if self._reasoning_region is not None:
                if self._feed_reasoning_region(text):
                    return ""
                text = self._reasoning_region_fallback(events)
                continue
            buffer = self._held_partial + text
            close = buffer.find(THINK_CLOSE)
            opener = buffer.find(TOOL_CALL_OPEN) if self._tools else -1
            if opener >= 0 and (close < 0 or opener < close):
                self._hold_reasoning(buffer[:opener], "", events)
                self._reasoning_region = ToolCallRegionParser(self._tools, tolerant=False)
                text = buffer[opener:]
                continue
            if close >= 0:
                self._emit_reasoning_after_newlines(buffer[:close].rstrip("\n"), events)
                self._held_newlines, self._held_partial = 0, ""
                self._in_reasoning = False
                return buffer[close + len(THINK_CLOSE):]
            partial = _partial_suffix(buffer, THINK_CLOSE)
            if self._tools:
                partial = max(partial, _partial_suffix(buffer, TOOL_CALL_OPEN))
            self._hold_reasoning(buffer[:len(buffer) - partial], buffer[len(buffer) - partial:], events)
            return ""

    def _hold_reasoning(self, body: str, partial: str, events: list[OutputEvent]) -> None:
        """Emit ``body`` up to its trailing newline run, which is added to the held run, and hold ``partial``."""
        visible = body.rstrip("\n")
        if visible:
            self._emit_reasoning_after_newlines(visible, events)
            self._held_newlines = 0
        self._held_newlines += len(body) - len(visible)
        self._held_partial = partial

    def _feed_reasoning_region(self, text: str) -> bool:
        """Feed the pending reasoning call region; True while it is still pending, False once it has fallen back
        (malformed, or a ``</think>``: it ends reasoning as always)."""
        assert self._reasoning_region is not None
        window = self._reasoning_region_text[-(len(THINK_CLOSE) - 1):] + text
        self._reasoning_region_text += text
        return THINK_CLOSE not in window and not self._reasoning_region.feed(text).resolved

    def _reasoning_region_fallback(self, events: list[OutputEvent]) -> str:
        """Return the pending region to reasoning: emit its opener, and return the text after it to rescan."""
        text = self._reasoning_region_text
        self._reasoning_region, self._reasoning_region_text = None, ""
        self._reasoning_tokens += self._reasoning_region_tokens
        self._reasoning_region_tokens = 0
        self._emit_reasoning_after_newlines(TOOL_CALL_OPEN, events)
        self._held_newlines = 0
        return text[len(TOOL_CALL_OPEN):]

    def _end_reasoning_with_calls(self, outcome: RegionOutcome, events: list[OutputEvent]) -> None:
        """The output ended with complete calls inside reasoning: the reasoning ends at their opener."""
        self._reasoning_region, self._reasoning_region_text = None, ""
        self._in_reasoning = False
        self._held_newlines = 0
        self._report = attrs.evolve(self._report, marker_seen=True)
        self._apply_region(outcome, events)

    def _emit_reasoning_after_newlines(self, text: str, events: list[OutputEvent]) -> None:
        """Emit ``text`` preceded by the held newline run (nothing when ``text`` is empty: the run is trailing)."""
        if text:
            self._emit_reasoning("\n" * self._held_newlines + text, events)

    def _emit_reasoning(self, text: str, events: list[OutputEvent]) -> None:
        if not self._reasoning_started:
            text = text.lstrip("\n")
        if text:
            self._reasoning_started = True
            events.append(ReasoningDelta(text))

    # -- content channel --------------------------------------------------------------------------------------

    def _push_content(self, text: str, events: list[OutputEvent]) -> None:
        if self._region is not None:
            if self._region.resolved:
                self._emit_content(text, events)
            else:
                self._apply_region(self._region.feed(text), events)
            return
        if not self._tools:
            self._note_marker_without_tools(text)
            self._emit_content(text, events)
            return
        buffer = self._content_held + text
        start = buffer.find(TOOL_CALL_OPEN)
        if start < 0:
            cut = len(buffer) - _partial_suffix(buffer, TOOL_CALL_OPEN)
            self._emit_content(buffer[:cut], events)
            self._content_held = buffer[cut:]
            return
        self._emit_content(buffer[:start], events)
        self._content_held = ""
        self._report = attrs.evolve(self._report, marker_seen=True)
        self._region = ToolCallRegionParser(self._tools, tolerant=self._tolerant)
        self._apply_region(self._region.feed(buffer[start:]), events)

    def _note_marker_without_tools(self, text: str) -> None:
        """With no tools declared markup is plain content; still record that a call marker was returned."""
        window = self._marker_tail + text
        if not self._report.marker_seen and TOOL_CALL_OPEN in window:
            self._report = attrs.evolve(self._report, marker_seen=True)
            self._record_fallback(FallbackReason.UNDECLARED_TOOL)
        self._marker_tail = window[-(len(TOOL_CALL_OPEN) - 1):]

    def _emit_content(self, text: str, events: list[OutputEvent]) -> None:
        if not self._content_started:
            text = text.lstrip("\n")
        if text:
            self._content_started = True
            events.append(ContentDelta(text))

    # -- tool calls -------------------------------------------------------------------------------------------

    def _apply_region(self, outcome: RegionOutcome, events: list[OutputEvent]) -> None:
        for call in outcome.calls:
            self._emit_call(call, events)
        if outcome.resolved:
            if outcome.fallback_reason is not FallbackReason.NONE:
                self._record_fallback(outcome.fallback_reason)
            if outcome.content.strip():
                self._emit_content(outcome.content, events)

    def _record_fallback(self, reason: FallbackReason) -> None:
        if self._report.fallback_reason == FallbackReason.NONE:
            self._report = attrs.evolve(self._report, fallback_reason=reason.value)

    def _emit_call(self, call: ParsedCall, events: list[OutputEvent]) -> None:
        spec = self._tools.spec(call.prompt_name)
        converted = convert_arguments(spec.parameters, call.parameters)
        index = self._calls_emitted
        self._calls_emitted += 1
        events.append(ToolCallStarted(index, _new_call_id(), spec.name, spec.namespace))
        pieces = arguments_json_pieces(converted.values)
        events.extend(ToolCallArgumentsDelta(index, piece) for piece in pieces)
        events.append(ToolCallFinished(index, "".join(pieces)))
        report = self._report
        self._report = attrs.evolve(
            report, calls=report.calls + 1,
            omitted_empty_arguments=report.omitted_empty_arguments + converted.omitted_empty,
            schema_mismatched_arguments=report.schema_mismatched_arguments + converted.schema_mismatched)
