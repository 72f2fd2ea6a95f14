"""The contract between protocol adapters and a model family's frontend.

A frontend turns a normalized :class:`~ninfer.core.conversation.Conversation` into prompt token ids
(:class:`PreparedRequest`) and decodes the engine's committed text into protocol-neutral output events.
Adapters render these events in their wire format; only the family frontend knows the model's markup.
"""

from __future__ import annotations

from typing import Protocol, Union

import attrs

from ninfer.core.conversation import Conversation, GenerationOptions
from ninfer.core.descriptors import SamplingPreset
from ninfer.core.request import GenerationRequest


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
class PreparedRequest:
    """What :meth:`Frontend.prepare` returns: the request the engine executes and how it was rendered.

    ``request`` is resolved once, here: prompt token ids, sampling with the output limit and the model's stop ids,
    the thinking budget (``budget_close``) and the checkpoint frontiers of explicit cache breakpoints. The caller
    adds only its identity (request id, progress reports, reuse session). ``output_budget`` is the effective
    output limit (``max_tokens`` capped by the context). ``thinking``: the resolved thinking mode (it selected
    ``sampling_preset`` and the decoder's start channel); ``requested_effort``/``resolved_effort``: the client
    value and the effective tier (None when not tiered).
    """

    request: GenerationRequest
    output_budget: int
    thinking: bool
    preserve_thinking: bool
    requested_effort: str | None
    resolved_effort: str | None
    sampling_preset: SamplingPreset | None
    conversation: Conversation | None = None


class OutputDecoder(Protocol):
    """Incremental decoder of one request's committed text into :data:`OutputEvent` s."""

    reasoning_tokens: int
    parse_report: ParseReport

    def push(self, text: str, *, token_count: int = 1) -> list[OutputEvent]: ...

    def finish(self) -> list[OutputEvent]: ...


class Frontend(Protocol):
    """What ``ModelFamily.build_frontend(artifact, config, tokenizer)`` returns."""

    capabilities: PromptCapabilities

    def prepare(self, conversation: Conversation, options: GenerationOptions) -> PreparedRequest: ...

    def decoder(self, prepared: PreparedRequest) -> OutputDecoder: ...
