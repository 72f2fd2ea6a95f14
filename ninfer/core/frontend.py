"""The contract between protocol adapters and a model family's frontend.

A frontend turns a normalized :class:`~ninfer.core.conversation.Conversation` into prompt token ids
(:class:`PreparedPrompt`) and decodes the engine's committed text into protocol-neutral output events.
Adapters render these events in their wire format; only the family frontend knows the model's markup.
"""

from __future__ import annotations

from typing import Protocol, Union

import attrs

from ninfer.core.conversation import Conversation, GenerationOptions
from ninfer.core.descriptors import SamplingPreset


@attrs.frozen
class ReasoningDelta:
    text: str


@attrs.frozen
class ContentDelta:
    text: str


@attrs.frozen
class ToolCallStarted:
    index: int
    call_id: str
    name: str
    namespace: str | None


@attrs.frozen
class ToolCallArgumentsDelta:
    index: int
    text: str


@attrs.frozen
class ToolCallFinished:
    index: int
    arguments_json: str


OutputEvent = Union[ReasoningDelta, ContentDelta, ToolCallStarted, ToolCallArgumentsDelta, ToolCallFinished]


@attrs.frozen
class ParseReport:
    """Tool-call parse diagnostics for the request log: counters and a stable reason, never values or text.

    ``marker_seen``: a complete ``<tool_call>`` appeared in the content channel, or opened structured calls that
    end an unclosed reasoning block (markup that stays reasoning text is not recorded). ``calls``: structured calls
    returned. ``omitted_empty_arguments`` / ``schema_mismatched_arguments``: counted over returned calls.
    ``fallback_reason``: why markup was first returned as text (``none`` if never).
    """

    marker_seen: bool = False
    calls: int = 0
    omitted_empty_arguments: int = 0
    schema_mismatched_arguments: int = 0
    fallback_reason: str = "none"


@attrs.frozen
class PromptCapabilities:
    """What the loaded chat template supports, resolved once at startup from the template text."""

    effort_levels: tuple[str, ...] = ()
    default_effort: str | None = None
    supports_preserve_thinking: bool = False
    preserve_thinking_default: bool = False
    supports_enable_thinking: bool = False


@attrs.frozen
class PreparedPrompt:
    """A rendered, tokenized prompt plus everything generation and decoding need.

    ``thinking``: the resolved thinking mode (selects the sampling preset and the decoder's start channel).
    ``requested_effort``/``resolved_effort``: the client value and the effective tier (None when not tiered).
    ``budget_close`` is an engine ``BudgetClose`` (or None) implementing the thinking budget.
    ``checkpoint_offsets`` are prompt frontiers where the engine should capture reusable checkpoints.
    """

    token_ids: tuple[int, ...]
    thinking: bool
    preserve_thinking: bool
    requested_effort: str | None
    resolved_effort: str | None
    stop_token_ids: tuple[int, ...]
    sampling_preset: SamplingPreset | None
    budget_close: object | None = None
    conversation: Conversation | None = None
    checkpoint_offsets: tuple[int, ...] = ()  # exact token frontiers of explicit cache breakpoints


class OutputDecoder(Protocol):
    """Incremental decoder of one request's committed text into :data:`OutputEvent` s."""

    reasoning_tokens: int
    parse_report: ParseReport

    def push(self, text: str, *, token_count: int = 1) -> list[OutputEvent]: ...

    def finish(self) -> list[OutputEvent]: ...


class Frontend(Protocol):
    """What ``ModelFamily.build_frontend(artifact, config, tokenizer)`` returns."""

    capabilities: PromptCapabilities

    def prepare(self, conversation: Conversation, options: GenerationOptions) -> PreparedPrompt: ...

    def decoder(self, prepared: PreparedPrompt) -> OutputDecoder: ...
