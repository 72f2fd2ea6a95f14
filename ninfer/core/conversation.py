"""The one normalized request model every protocol adapter produces and every model frontend consumes.

Adapters translate wire JSON into a :class:`Conversation` (ordered messages with typed parts, tools, thinking
options) plus :class:`GenerationOptions`; they never render prompts. A model family's frontend turns the
Conversation into prompt token ids. JSON objects (tool schemas, call arguments) keep their received member order.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Union

import attrs

Role = Literal["system", "developer", "user", "assistant", "tool"]


@attrs.frozen
class TextPart:
    text: str
    cache_breakpoint: bool = False  # an explicit prompt-cache write candidate ends after this part


@attrs.frozen
class ImagePart:
    url: str  # http(s) URL or data URI
    cache_breakpoint: bool = False


@attrs.frozen
class VideoPart:
    url: str
    cache_breakpoint: bool = False


ContentPart = Union[TextPart, ImagePart, VideoPart]


@attrs.frozen
class ToolCall:
    """A completed call in assistant history (or generated output).

    ``arguments`` is the decoded JSON object in received member order; ``arguments_json`` the exact wire text when
    the protocol carried a string (replayed verbatim where the model format allows).
    """

    call_id: str
    name: str
    arguments: Mapping[str, Any]
    namespace: str | None = None
    item_id: str | None = None
    cache_breakpoint: bool = False  # an explicit prompt-cache write candidate ends after this call's turn


@attrs.frozen
class ToolResult:
    call_id: str
    parts: tuple[ContentPart, ...]
    is_error: bool = False
    name: str | None = None
    namespace: str | None = None


@attrs.frozen
class Message:
    """One turn. ``reasoning`` and ``tool_calls`` only on assistant turns; ``tool_result`` only on tool turns."""

    role: Role
    parts: tuple[ContentPart, ...] = ()
    reasoning: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_result: ToolResult | None = None

    @property
    def text(self) -> str:
        """The concatenated text parts (adjacent parts joined without separators)."""
        return "".join(part.text for part in self.parts if isinstance(part, TextPart))

    @property
    def has_media(self) -> bool:
        return any(isinstance(part, (ImagePart, VideoPart)) for part in self.parts)


@attrs.frozen
class ToolDefinition:
    """A client-executed function tool. ``parameters`` is its JSON schema in received member order.

    A ``freeform`` tool (Responses ``custom``) is rendered as a function whose one string parameter is its input.
    """

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] | None = None
    namespace: str | None = None
    namespace_description: str | None = None
    wire_function: Mapping[str, Any] | None = None  # the received function object, member order kept, for rendering
    freeform: bool = False  # a custom tool: one string parameter "input" carries its raw input

    @property
    def key(self) -> tuple[str | None, str]:
        return (self.namespace, self.name)


@attrs.frozen
class Conversation:
    """A normalized chat request.

    ``tool_choice`` is "auto" or "none"; ``allowed_tools`` (namespace, name) pairs filter the callable set
    without changing declaration order. ``continue_final_message`` marks an assistant prefill that generation
    continues instead of opening a new turn. ``None`` thinking options mean "the server/template default".
    ``effort_selects_thinking`` is the OpenAI reading of an effort (a tier turns thinking on, "none" off); Anthropic's
    ``output_config.effort`` only shapes thinking that ``thinking`` (or the server default) enables.
    """

    messages: tuple[Message, ...]
    tools: tuple[ToolDefinition, ...] = ()
    tool_choice: Literal["auto", "none"] = "auto"
    allowed_tools: tuple[tuple[str | None, str], ...] | None = None
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None
    preserve_thinking: bool | None = None
    thinking_budget: int | None = None
    continue_final_message: bool = False
    tools_cache_breakpoint: bool = False  # a tool definition carries an explicit prompt-cache breakpoint
    effort_selects_thinking: bool = True  # False: the effort only picks the tier of thinking other fields enable
    ignored_tools: tuple[str, ...] = ()  # hosted tool types left out of the effective set (reported, never rendered)

    @property
    def callable_tools(self) -> tuple[ToolDefinition, ...]:
        """The tools whose calls may become structured output."""
        if self.tool_choice == "none":
            return ()
        if self.allowed_tools is None:
            return self.tools
        allowed = set(self.allowed_tools)
        return tuple(tool for tool in self.tools if tool.key in allowed)


@attrs.frozen
class GenerationOptions:
    """Per-request sampling and limits; ``None`` means "use the server default"."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def sampling_fields(self) -> dict[str, Any]:
        """The fields that resolve the request's sampling (``None``: not given)."""
        return {name: getattr(self, name) for name in (
            "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed", "max_tokens",
            "stop")}
