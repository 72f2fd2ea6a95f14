"""Anthropic Messages request validation and lowering: wire JSON -> :class:`Conversation` + :class:`GenerationOptions`.

Top-level fields (model label, limits, sampling, thinking, effort, tools, tool choice, cache markers) are checked
here, ``context_management`` by :mod:`ninfer.protocols.anthropic.context`; the ordered ``system``/``messages``
history is lowered by :mod:`ninfer.protocols.anthropic.history`. Every problem is a field-specific
:class:`InvalidRequestError` (rendered in Anthropic's error shape by the server); features whose constraint or
executor ninfer does not have are rejected naming the missing capability.
Advisory fields (metadata, service tier, inference geography, speed, diagnostics) and unknown fields are ignored.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from ninfer.core.conversation import Conversation, GenerationOptions, ToolDefinition
from ninfer.core.errors import InvalidRequestError
from ninfer.protocols.anthropic.context import ContextManagement, parse_context_management
from ninfer.protocols.anthropic.history import CachePlan, lower_history, plan_cache
from ninfer.protocols.fields import (
    malformed,
    optional_bool,
    optional_int,
    optional_list,
    optional_number,
    optional_object,
    optional_str,
    quoted,
    type_name,
    type_tag,
    unsupported,
)

MIN_THINKING_BUDGET = 1024
MAX_STOP_SEQUENCES = 4
TOP_K_MAX = 20
ANTHROPIC_EFFORTS = ("low", "medium", "high", "xhigh", "max")
THINKING_DISPLAYS = ("summarized", "omitted")
CUSTOM_TOOL_TYPES = (None, "custom")
NO_EXECUTOR = "ninfer executes no tools itself, so it has no executor for"


@attrs.frozen
class RequestSettings:
    """Server facts request validation depends on."""

    vision: bool
    default_max_tokens: int
    default_thinking: bool


@attrs.frozen
class MessagesRequest:
    """A validated Messages (or count_tokens) request.

    ``model`` is the client's label, echoed back. ``cache_breakpoints`` are the accepted distinct breakpoints
    (block-level plus a request-level one that did not merge), of which those in representable positions are
    marked on the conversation's parts. ``omit_thinking`` (``thinking.display: "omitted"``) returns thinking
    blocks with empty text and the signature that restores them. ``context_management`` (None when the request sent
    none) is applied to the conversation by
    :func:`ninfer.protocols.anthropic.context.apply_context_management`, which needs token counts.
    """

    model: str
    conversation: Conversation
    options: GenerationOptions
    stream: bool = False
    cache_breakpoints: int = 0
    context_management: ContextManagement | None = None
    omit_thinking: bool = False


# -- top-level scalars -----------------------------------------------------------------------------


def parse_model(body: Mapping[str, Any]) -> str:
    """Any non-empty label: the resident artifact serves every request, the label is echoed."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        shown = "missing" if model is None else f"{type_name(model)} {quoted(model)}"
        raise InvalidRequestError(f"model: a non-empty model label is required (got {shown})", param="model",
                                  code="missing_required_parameter" if model is None else "invalid_value")
    return model


def parse_max_tokens(body: Mapping[str, Any]) -> int | None:
    max_tokens = optional_int(body, "max_tokens", 0)
    if max_tokens == 0:
        raise unsupported("max_tokens", "0 would ask for a completed zero-output cache prewarm, which ninfer does not "
                          "expose; send a positive output budget or omit max_tokens for the server default")
    return max_tokens


def parse_stop_sequences(body: Mapping[str, Any]) -> tuple[str, ...]:
    raw = body.get("stop_sequences")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise malformed("stop_sequences", f"expected an array of strings, got {type_name(raw)}")
    for index, value in enumerate(raw):
        if not isinstance(value, str) or not value:
            raise malformed(f"stop_sequences.{index}", f"expected a non-empty string, got {quoted(value)}")
    if len(raw) > MAX_STOP_SEQUENCES:
        raise unsupported("stop_sequences", f"the engine matches at most {MAX_STOP_SEQUENCES} stop sequences per "
                          f"request, got {len(raw)}")
    return tuple(raw)


def parse_sampling(body: Mapping[str, Any], max_tokens: int | None) -> GenerationOptions:
    top_k = optional_int(body, "top_k", 0)
    if top_k is not None and top_k > TOP_K_MAX:
        raise unsupported("top_k", f"the sampler considers at most {TOP_K_MAX} candidates; send top_k <= {TOP_K_MAX}")
    return GenerationOptions(
        max_tokens=max_tokens,
        temperature=optional_number(body, "temperature", 0.0, 1.0),
        top_p=optional_number(body, "top_p", 0.0, 1.0),
        top_k=top_k,
        stop=parse_stop_sequences(body),
    )


# -- thinking and effort ---------------------------------------------------------------------------


@attrs.frozen
class ThinkingChoice:
    """The request's thinking switch (None: the server default), its optional budget, and whether the thinking
    text is omitted from the output (``display: "omitted"``: only the restoring signature is returned)."""

    enabled: bool | None
    budget: int | None = None
    omitted: bool = False


def parse_thinking(body: Mapping[str, Any], max_tokens: int | None) -> ThinkingChoice:
    """``thinking``: disabled / adaptive / enabled (``budget_tokens`` >= 1024 and < ``max_tokens``)."""
    config = optional_object(body, "thinking")
    if config is None:
        return ThinkingChoice(None)
    kind = type_tag(config, "thinking")
    if kind not in ("disabled", "adaptive", "enabled"):
        raise malformed("thinking.type", f"expected 'disabled', 'adaptive' or 'enabled', got {quoted(kind)}")
    if kind == "disabled":
        return ThinkingChoice(False)
    display = optional_str(config, "display", "thinking.display")
    if display is not None and display not in THINKING_DISPLAYS:
        raise malformed("thinking.display", f"expected 'summarized' or 'omitted', got {quoted(display)}")
    omitted = display == "omitted"
    if kind == "adaptive":
        return ThinkingChoice(True, omitted=omitted)
    budget = config.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise malformed("thinking.budget_tokens", f"expected an integer, got {quoted(budget)}")
    if budget < MIN_THINKING_BUDGET:
        raise malformed("thinking.budget_tokens", f"must be at least {MIN_THINKING_BUDGET}, got {budget}")
    if max_tokens is not None and budget >= max_tokens:
        raise malformed("thinking.budget_tokens", f"must be less than max_tokens ({max_tokens}), got {budget}")
    return ThinkingChoice(True, budget, omitted)


def parse_effort(body: Mapping[str, Any]) -> str | None:
    """``output_config.effort`` (the frontend maps it onto the loaded template's tiers); other output_config
    rejected."""
    config = optional_object(body, "output_config")
    if config is None:
        return None
    if config.get("format") is not None:
        raise unsupported("output_config.format", "structured outputs need constrained decoding, which ninfer does "
                          "not perform")
    effort = optional_str(config, "effort", "output_config.effort")
    if effort is not None and effort not in ANTHROPIC_EFFORTS:
        raise malformed("output_config.effort", f"expected one of {', '.join(ANTHROPIC_EFFORTS)}, got "
                                                f"{quoted(effort)}")
    return effort


# -- tools -----------------------------------------------------------------------------------------


def _tool(tool: Any, where: str) -> ToolDefinition:
    if not isinstance(tool, dict):
        raise malformed(where, f"expected a tool object, got {type_name(tool)}")
    kind = type_tag(tool, where)
    if kind not in CUSTOM_TOOL_TYPES:
        raise unsupported(f"{where}.type", f"{quoted(kind)} is an Anthropic-provided, server or MCP tool type; "
                          f"{NO_EXECUTOR} it (only user-defined tools are supported)")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise malformed(f"{where}.name", "expected a non-empty tool name")
    description = optional_str(tool, "description", f"{where}.description")
    schema = tool.get("input_schema")
    if not isinstance(schema, dict):
        raise malformed(f"{where}.input_schema", f"expected a JSON schema object, got {type_name(schema)}")
    if schema.get("type", "object") != "object":
        raise malformed(f"{where}.input_schema.type", f"expected 'object', got {quoted(schema.get('type'))}")
    if optional_bool(tool, "strict", f"{where}.strict"):
        raise unsupported(f"{where}.strict", "strict schema adherence needs constrained decoding, which ninfer "
                          "does not perform (use strict: false)")
    optional_bool(tool, "defer_loading", f"{where}.defer_loading")
    callers = tool.get("allowed_callers")
    if callers is not None:
        if not isinstance(callers, list) or not all(isinstance(caller, str) for caller in callers):
            raise malformed(f"{where}.allowed_callers", "expected an array of strings")
        if "direct" not in callers:
            raise unsupported(f"{where}.allowed_callers", "a tool the model may not call directly needs a code "
                              "execution container, which ninfer does not have")
    optional_bool(tool, "eager_input_streaming", f"{where}.eager_input_streaming")
    examples = tool.get("input_examples")
    if examples is not None and (not isinstance(examples, list) or not all(isinstance(e, dict) for e in examples)):
        raise malformed(f"{where}.input_examples", "expected an array of input objects")
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = schema
    if examples:
        function["input_examples"] = examples
    return ToolDefinition(name, description, schema, wire_function=function)


def parse_tools(body: Mapping[str, Any]) -> tuple[ToolDefinition, ...]:
    """The tools the model is shown, in declaration order. A ``defer_loading`` tool is validated but left out: a
    deferred tool is not in the model's context until a tool search loads it, and ninfer has no tool search
    (a ``tool_reference`` result that would load one is rejected)."""
    raw = optional_list(body, "tools")
    tools: list[tuple[ToolDefinition, bool]] = []
    for index, tool in enumerate(raw):
        parsed = _tool(tool, f"tools.{index}")
        if any(existing.name == parsed.name for existing, _ in tools):
            raise malformed(f"tools.{index}.name", f"duplicate tool name {quoted(parsed.name)}")
        tools.append((parsed, tool.get("defer_loading") is True))
    return tuple(definition for definition, deferred in tools if not deferred)


def parse_tool_choice(body: Mapping[str, Any], tools: tuple[ToolDefinition, ...]) -> str:
    """``auto`` (default) or ``none``; forced/named choice and single-call enforcement are rejected."""
    choice = optional_object(body, "tool_choice")
    if choice is None:
        return "auto"
    kind = type_tag(choice, "tool_choice")
    if kind in ("any", "tool"):
        raise unsupported("tool_choice.type", f"{quoted(kind)} forces a tool call, which needs constrained "
                          "decoding; use 'auto' or 'none'")
    if kind not in ("auto", "none"):
        raise malformed("tool_choice.type", f"expected 'auto', 'none', 'any' or 'tool', got {quoted(kind)}")
    if optional_bool(choice, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use") and kind == "auto" \
            and tools:
        raise unsupported("tool_choice.disable_parallel_tool_use", "limiting the model to one call per turn needs "
                          "constrained decoding; leave it false or disable tools")
    return kind


def check_execution_features(body: Mapping[str, Any]) -> None:
    """Fields that ask for an executor, container or output constraint ninfer does not have."""
    servers = body.get("mcp_servers")
    if servers:
        raise unsupported("mcp_servers", f"{NO_EXECUTOR} remote MCP servers")
    if body.get("container") is not None:
        raise unsupported("container", "code-execution containers are not available")
    if body.get("output_format") is not None:
        raise unsupported("output_format", "structured outputs need constrained decoding, which ninfer does not "
                          "perform")


# -- the request -----------------------------------------------------------------------------------


def parse_messages_request(body: Mapping[str, Any], settings: RequestSettings, *,
                           count_only: bool = False) -> MessagesRequest:
    """Validate and lower a ``/v1/messages`` body (or, with ``count_only``, a ``count_tokens`` body: output-only
    sampling, limits and streaming fields are then ignored)."""
    model = parse_model(body)
    max_tokens = None if count_only else parse_max_tokens(body)
    effective_max = max_tokens if max_tokens is not None else settings.default_max_tokens
    thinking = parse_thinking(body, None if count_only else effective_max)
    effort = parse_effort(body)
    tools = parse_tools(body)
    tool_choice = parse_tool_choice(body, tools)
    check_execution_features(body)
    plan: CachePlan = plan_cache(body)
    history = lower_history(body, plan, vision=settings.vision)
    thinking_on = thinking.enabled if thinking.enabled is not None else settings.default_thinking
    if history.prefill and thinking_on:
        source = "the request enables thinking" if thinking.enabled else "thinking is on by server default (send " \
                 "thinking: {\"type\": \"disabled\"})"
        raise InvalidRequestError(f"messages: an assistant prefill cannot be continued while thinking is on: {source}",
                                  param="messages", code="invalid_prompt")
    context = parse_context_management(body, thinking_on=thinking_on, thinking_source="the request disables it"
                                       if thinking.enabled is False else "thinking is off by server default")
    preserve = optional_bool(body, "preserve_thinking")
    conversation = Conversation(
        messages=history.messages,
        tools=tools,
        tool_choice=tool_choice,  # type: ignore[arg-type]
        enable_thinking=thinking.enabled,
        reasoning_effort=effort,
        effort_selects_thinking=False,  # Anthropic effort shapes the thinking that `thinking` enables
        preserve_thinking=preserve,
        thinking_budget=thinking.budget,
        continue_final_message=history.prefill,
        tools_cache_breakpoint=any(path[0] == "tools" for path in plan.marked),
    )
    options = GenerationOptions() if count_only else parse_sampling(body, max_tokens)
    stream = False if count_only else bool(optional_bool(body, "stream"))
    return MessagesRequest(model, conversation, options, stream, plan.breakpoints, context,
                           omit_thinking=thinking.omitted)
