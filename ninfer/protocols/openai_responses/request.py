"""Responses request parsing: wire JSON -> canonical input Items -> one normalized :class:`Conversation`.

Validation follows the create field table of the spec: unknown top-level fields fail with ``unknown_parameter``,
recognized fields whose behaviour ninfer cannot provide fail with ``unsupported_parameter`` naming the field path,
malformed values with ``invalid_value``. Input Items are first canonicalized (ids kept or generated, string content
turned into parts) -- that canonical form is what the store keeps and ``input_items`` lists -- and then, together
with the replayed history of ``previous_response_id``, grouped into Conversation turns: contiguous assistant-owned
Items become one assistant turn (reasoning -> message content -> function calls, else
``invalid_assistant_history``) and function outputs are matched to the calls they answer and put in call order
(else ``invalid_tool_history``). ``instructions`` becomes a leading developer turn for this request only.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import attrs

from ninfer.core.conversation import (
    ContentPart,
    Conversation,
    GenerationOptions,
    ImagePart,
    Message,
    TextPart,
    ToolCall,
    ToolResult,
    VideoPart,
)
from ninfer.core.errors import InvalidRequestError
from ninfer.protocols.fields import (
    INVALID_VALUE,
    json_object_string,
    malformed,
    member_path,
    optional_bool,
    optional_int,
    optional_number,
    optional_object,
    optional_str,
    quoted,
    type_name,
    type_tag,
    unsupported,
)
from ninfer.protocols.openai_chat.request import CACHE_MODES, CACHE_RETENTIONS, check_model
from ninfer.protocols.openai_responses.items import CALL_TYPES, RESULT_TYPES, canonical_input
from ninfer.protocols.openai_responses.tools import FREEFORM_PARAMETER, HOSTED_IGNORE, parse_tool_choice, parse_tools
from ninfer.protocols.reasoning_codec import INCLUDE_ENCRYPTED_REASONING

UNKNOWN_PARAMETER = "unknown_parameter"
INVALID_ASSISTANT_HISTORY = "invalid_assistant_history"
INVALID_TOOL_HISTORY = "invalid_tool_history"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
METADATA_MAX_PAIRS, METADATA_MAX_KEY, METADATA_MAX_VALUE = 16, 64, 512

#: Fields ``POST /v1/responses/input_tokens`` accepts (the prompt-shaping subset of Create).
COUNT_FIELDS = frozenset({
    "model", "input", "instructions", "previous_response_id", "reasoning", "tools", "tool_choice",
    "parallel_tool_calls", "text", "truncation", "preserve_thinking", "chat_template_kwargs", "conversation",
    "personality",
})
#: Every top-level field Create recognizes (supported, neutral or explicitly unsupported).
CREATE_FIELDS = COUNT_FIELDS | frozenset({
    "max_output_tokens", "stream", "store", "temperature", "top_p", "metadata", "client_metadata",
    "max_tool_calls", "top_logprobs", "service_tier", "background", "background_options", "include",
    "stream_options", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "safety_identifier",
    "user", "prompt", "context_management", "moderation", "access_programs", "image",
})
#: Recognized fields naming a feature ninfer does not have: rejected whenever present with a non-null value.
UNSUPPORTED_FIELDS = {
    "conversation": "Conversations are not available; chain local Responses with previous_response_id",
    "prompt": "stored prompt templates are not available; send input and instructions directly",
    "context_management": "server-side context management (compaction) is not available",
    "moderation": "hosted moderation is not available",
    "access_programs": "programmatic tool callers are not available",
    "background_options": "background execution is not available",
    "image": "hosted image generation is not available",
    "personality": "model-owned style presets are not available",
}


# -- canonical Items -> conversation turns -------------------------------------------------------------------------


def _parts(parts: Sequence[Mapping[str, Any]], historical: bool) -> tuple[ContentPart, ...]:
    converted: list[ContentPart] = []
    for part in parts:
        marker = not historical and "prompt_cache_breakpoint" in part
        kind = part["type"]
        if kind == "input_image":
            converted.append(ImagePart(part["image_url"], marker))
        elif kind == "input_video":
            converted.append(VideoPart(part["video_url"], marker))
        else:
            converted.append(TextPart(part["refusal"] if kind == "refusal" else part["text"], marker))
    return tuple(converted)


def _history_error(param: str, code: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {problem}", param=param, code=code)


@attrs.define
class _AssistantTurn:
    """Contiguous assistant-owned Items: stage 1 reasoning, 2 message content, 3 function calls."""

    reasoning: str | None = None
    parts: list[ContentPart] = attrs.field(factory=list)
    calls: list[ToolCall] = attrs.field(factory=list)
    stage: int = 0

    def add(self, item: Mapping[str, Any], param: str, historical: bool) -> None:
        stage = 3 if item["type"] in CALL_TYPES else {"reasoning": 1, "message": 2}[item["type"]]
        if stage < self.stage or (stage == 1 and self.stage == 1):
            raise _history_error(param, INVALID_ASSISTANT_HISTORY, f"a {item['type']} Item cannot follow the "
                                 "assistant's earlier Items in one turn; the representable order is reasoning -> "
                                 "message content -> function calls")
        self.stage = stage
        if stage == 1:
            self.reasoning = "".join(part["text"] for part in item["content"])
        elif stage == 2:
            self.parts.extend(_parts(item["content"], historical))
        elif item["type"] == "custom_tool_call":
            self.calls.append(ToolCall(item["call_id"], item["name"], {FREEFORM_PARAMETER: item["input"]},
                                       item_id=item["id"]))
        else:
            self.calls.append(ToolCall(item["call_id"], item["name"], json_object_string(item["arguments"], param),
                                       namespace=item.get("namespace"), item_id=item["id"]))

    def message(self) -> Message:
        return Message("assistant", tuple(self.parts), reasoning=self.reasoning, tool_calls=tuple(self.calls))


class _TurnBuilder:
    """Groups canonical Items (each with its origin, for error paths) into Conversation messages."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.turn: _AssistantTurn | None = None
        self.answerable: tuple[ToolCall, ...] = ()  # calls of the assistant turn right before pending results
        self.results: list[tuple[Mapping[str, Any], str]] = []
        self.seen_call_ids: set[str] = set()
        self.seen_item_ids: set[str] = set()

    def add(self, item: Mapping[str, Any], param: str, historical: bool) -> None:
        if item["id"] in self.seen_item_ids:
            raise malformed(f"{param}.id", f"duplicate Item id {quoted(item['id'])} in the conversation")
        self.seen_item_ids.add(item["id"])
        kind = item["type"]
        if kind in RESULT_TYPES:
            self.close_turn()
            self.results.append((item, param))
            return
        if kind != "message" or item["role"] == "assistant":
            self._flush_results()
            if kind in CALL_TYPES:
                if item["call_id"] in self.seen_call_ids:
                    raise _history_error(f"{param}.call_id", INVALID_TOOL_HISTORY,
                                         f"duplicate call_id {quoted(item['call_id'])}")
                self.seen_call_ids.add(item["call_id"])
            self.turn = self.turn or _AssistantTurn()
            self.turn.add(item, param, historical)
            return
        self.close_turn()
        self._flush_results()
        self.answerable = ()
        self.messages.append(Message(item["role"], _parts(item["content"], historical)))

    def finish(self) -> tuple[Message, ...]:
        self.close_turn()
        self._flush_results()
        return tuple(self.messages)

    def close_turn(self) -> None:
        """End the open assistant turn (also called where a stored Response's output begins: it is a turn of its
        own even when it directly follows the parent's output, e.g. a reasoning-only parent continued without new
        input)."""
        if self.turn is not None:
            self.messages.append(self.turn.message())
            self.answerable = tuple(self.turn.calls)
            self.turn = None

    def _flush_results(self) -> None:
        if not self.results:
            return
        by_id: dict[str, Mapping[str, Any]] = {}
        calls = {call.call_id: call for call in self.answerable}
        for item, param in self.results:
            call = calls.get(item["call_id"])
            if call is None:
                raise _history_error(f"{param}.call_id", INVALID_TOOL_HISTORY,
                                     f"no function_call with call_id {quoted(item['call_id'])} directly precedes "
                                     "this result")
            if item["call_id"] in by_id:
                raise _history_error(f"{param}.call_id", INVALID_TOOL_HISTORY,
                                     f"duplicate result for call_id {quoted(item['call_id'])}")
            if item.get("name", call.name) != call.name or item.get("namespace", call.namespace) != call.namespace:
                raise _history_error(param, INVALID_TOOL_HISTORY, f"the result's name/namespace does not match call "
                                     f"{quoted(item['call_id'])} "
                                     f"({call.namespace + '.' if call.namespace else ''}{call.name})")
            by_id[item["call_id"]] = item
        if not all(call.call_id in by_id for call in self.answerable[: len(by_id)]):
            raise _history_error(self.results[0][1], INVALID_TOOL_HISTORY, "results answer a later call while an "
                                 "earlier call of the same turn has none; the prompt format identifies results only "
                                 "by their order")
        for call in self.answerable[: len(by_id)]:
            item = by_id[call.call_id]
            output = item["output"]
            parts = _parts(output, False) if isinstance(output, list) else ((TextPart(output),) if output else ())
            self.messages.append(Message("tool", tool_result=ToolResult(call.call_id, parts, name=call.name,
                                                                        namespace=call.namespace)))
        self.results.clear()
        self.answerable = ()


def conversation_messages(history: Sequence[Mapping[str, Any]], items: Sequence[Mapping[str, Any]],
                          instructions: str | None, output_starts: frozenset[int] = frozenset()) -> tuple[Message, ...]:
    """The turns of ``history`` (replayed, marked as such in errors; a stored Response's output, starting at an
    index of ``output_starts``, opens its own turn) followed by this request's ``items``."""
    builder = _TurnBuilder()
    for index, item in enumerate(history):
        if index in output_starts:
            builder.close_turn()
        builder.add(item, "previous_response_id", True)
    for index, item in enumerate(items):
        builder.add(item, f"input[{index}]", False)
    messages = builder.finish()
    if instructions:
        messages = (Message("developer", (TextPart(instructions),)), *messages)
    return messages


# -- top-level fields ----------------------------------------------------------------------------------------------


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str]) -> None:
    for key in body:
        if key not in allowed:
            raise InvalidRequestError(f"unknown parameter {quoted(key)}", param=member_path("", key),
                                      code=UNKNOWN_PARAMETER)
    for key, guarantee in UNSUPPORTED_FIELDS.items():
        if body.get(key) is not None:
            raise unsupported(key, guarantee)


def _check_nested(value: Mapping[str, Any], path: str, allowed: Sequence[str]) -> None:
    for key in value:
        if key not in allowed:
            where = member_path(path, key)
            raise InvalidRequestError(f"unknown parameter {where}", param=where, code=UNKNOWN_PARAMETER)


def _reasoning_effort(body: Mapping[str, Any]) -> str | None:
    reasoning = optional_object(body, "reasoning") or {}
    _check_nested(reasoning, "reasoning", ("effort", "summary", "generate_summary"))
    effort = optional_str(reasoning, "effort", "reasoning.effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise malformed("reasoning.effort", f"expected one of {', '.join(REASONING_EFFORTS)}, got {quoted(effort)}")
    for key in ("summary", "generate_summary"):
        summary = reasoning.get(key)
        if summary in ("concise", "detailed"):
            raise unsupported(f"reasoning.{key}", "reasoning summaries are not generated; the raw reasoning_text is "
                              "returned instead (omit the field or use 'auto')")
        if summary not in (None, "auto"):
            raise malformed(f"reasoning.{key}", f"expected 'auto', 'concise' or 'detailed', got {quoted(summary)}")
    return effort


def _preserve_thinking(body: Mapping[str, Any]) -> bool | None:
    kwargs = optional_object(body, "chat_template_kwargs") or {}
    for key, value in kwargs.items():
        if key != "preserve_thinking" and value is not None:
            raise unsupported(member_path("chat_template_kwargs", key), "only preserve_thinking may be passed to "
                              "the chat template in Responses (use reasoning.effort for thinking)")
    top = optional_bool(body, "preserve_thinking")
    nested = optional_bool(kwargs, "preserve_thinking", "chat_template_kwargs.preserve_thinking")
    if top is not None and nested is not None and top != nested:
        raise InvalidRequestError("preserve_thinking and chat_template_kwargs.preserve_thinking disagree",
                                  param="chat_template_kwargs.preserve_thinking", code="conflicting_template_option")
    return top if top is not None else nested


def _check_text_and_truncation(body: Mapping[str, Any]) -> None:
    text = optional_object(body, "text") or {}
    _check_nested(text, "text", ("format", "verbosity"))
    text_format = optional_object(text, "format", "text.format")
    if text_format is not None:
        kind = type_tag(text_format, "text.format")
        if kind in ("json_object", "json_schema"):
            raise unsupported("text.format", f"{kind} output needs constrained decoding, which ninfer does not perform")
        if kind != "text":
            raise malformed("text.format.type", f"expected 'text', got {quoted(kind)}")
    verbosity = text.get("verbosity")
    if verbosity in ("low", "high"):
        raise unsupported("text.verbosity", f"{quoted(verbosity)} verbosity cannot be controlled; only 'medium' is "
                                            "neutral")
    if verbosity not in (None, "medium"):
        raise malformed("text.verbosity", f"expected 'low', 'medium' or 'high', got {quoted(verbosity)}")
    truncation = body.get("truncation")
    if truncation == "auto":
        raise unsupported("truncation", "overlong input fails instead of silently dropping Items (use 'disabled')")
    if truncation not in (None, "disabled"):
        raise malformed("truncation", f"expected 'disabled' or 'auto', got {quoted(truncation)}")


def parse_include(include: Any, param: str) -> bool:
    """Whether ``include`` asks for ``reasoning.encrypted_content``, the one optional output this server has."""
    if include is None:
        return False
    if not isinstance(include, list):
        raise malformed(param, f"expected an array, got {type_name(include)}")
    for index, value in enumerate(include):
        if value != INCLUDE_ENCRYPTED_REASONING:
            raise unsupported(f"{param}[{index}]", f"{quoted(value)} cannot be included: only "
                              f"{quoted(INCLUDE_ENCRYPTED_REASONING)} is available (logprobs and hosted tool "
                              "results are not produced)")
    return bool(include)


def _check_create_controls(body: Mapping[str, Any]) -> None:
    metadata = optional_object(body, "metadata") or {}
    if len(metadata) > METADATA_MAX_PAIRS:
        raise malformed("metadata", f"at most {METADATA_MAX_PAIRS} pairs are allowed, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY:
            raise malformed("metadata", f"key {quoted(key[:16])}... is longer than {METADATA_MAX_KEY} characters")
        if not isinstance(value, str) or len(value) > METADATA_MAX_VALUE:
            raise malformed(member_path("metadata", key), f"expected a string of at most {METADATA_MAX_VALUE} "
                                                          "characters")
    optional_object(body, "client_metadata")
    optional_int(body, "max_tool_calls", 0)
    if optional_int(body, "top_logprobs", 0):
        raise unsupported("top_logprobs", "log probabilities are not reported")
    tier = body.get("service_tier")
    if tier in ("flex", "scale", "priority"):
        raise unsupported("service_tier", f"the {quoted(tier)} tier does not exist on a local server (use 'auto' or "
                                          "'default')")
    if tier not in (None, "auto", "default"):
        raise malformed("service_tier", f"expected 'auto' or 'default', got {quoted(tier)}")
    if optional_bool(body, "background"):
        raise unsupported("background", "background execution is not available")
    stream_options = optional_object(body, "stream_options") or {}
    _check_nested(stream_options, "stream_options", ("include_obfuscation",))
    optional_bool(stream_options, "include_obfuscation", "stream_options.include_obfuscation")
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        optional_str(body, key)
    retention = body.get("prompt_cache_retention")
    if retention is not None and retention not in CACHE_RETENTIONS:
        raise malformed("prompt_cache_retention", f"expected 'in_memory' or '24h', got {quoted(retention)}")
    cache_options = optional_object(body, "prompt_cache_options") or {}
    if cache_options.get("mode") is not None and cache_options["mode"] not in CACHE_MODES:
        raise malformed("prompt_cache_options.mode", f"expected 'implicit' or 'explicit', got "
                                                     f"{quoted(cache_options['mode'])}")


# -- the request ---------------------------------------------------------------------------------------------------


@attrs.frozen
class ParentContext:
    """What ``previous_response_id`` contributes: the stored Item history and resolved ``preserve_thinking``."""

    history: tuple[Mapping[str, Any], ...]
    preserve_thinking: bool | None
    segment: Any = None  # the store's ContextSegment, linked as the new segment's parent
    output_starts: frozenset[int] = frozenset()  # history indices where a stored Response's output begins


ParentLookup = Callable[[str], ParentContext]


@attrs.frozen
class ResponsesRequest:
    """A validated Create (or input-token count) request."""

    body: Mapping[str, Any]
    conversation: Conversation
    options: GenerationOptions
    input_items: tuple[dict[str, Any], ...]
    parent: ParentContext | None
    previous_response_id: str | None
    instructions: str | None
    stream: bool = False
    store: bool = True
    include_encrypted_reasoning: bool = False


def parse_responses_request(body: Mapping[str, Any], *, model_id: str, vision: bool, lookup: ParentLookup,
                            count_only: bool = False, hosted_tools: str = HOSTED_IGNORE) -> ResponsesRequest:
    """Validate a Create body (or, with ``count_only``, an input-token count body) and build its Conversation;
    ``hosted_tools`` is the ``--hosted-tools`` policy."""
    _check_fields(body, COUNT_FIELDS if count_only else CREATE_FIELDS)
    check_model(body, model_id)
    instructions = optional_str(body, "instructions")
    previous_id = optional_str(body, "previous_response_id")
    effort = _reasoning_effort(body)
    preserve = _preserve_thinking(body)
    _check_text_and_truncation(body)
    tools = parse_tools(body, hosted_tools)
    tool_choice, allowed = parse_tool_choice(body, tools)
    items = canonical_input(body.get("input"), vision)
    parent = lookup(previous_id) if previous_id is not None else None
    history = parent.history if parent is not None else ()
    if not items and not any(item["type"] == "message" and item["role"] == "user" for item in history):
        raise InvalidRequestError("input: at least one input Item is required unless previous_response_id already "
                                  "supplies a user query", param="input",
                                  code="missing_required_parameter" if body.get("input") is None else INVALID_VALUE)
    if preserve is None and parent is not None:
        preserve = parent.preserve_thinking
    starts = parent.output_starts if parent is not None else frozenset()
    conversation = Conversation(messages=conversation_messages(history, items, instructions, starts),
                                tools=tools.tools, ignored_tools=tools.ignored, tool_choice=tool_choice,
                                allowed_tools=allowed, reasoning_effort=effort,
                                preserve_thinking=preserve)
    if optional_bool(body, "parallel_tool_calls") is False and conversation.callable_tools:
        raise unsupported("parallel_tool_calls", "limiting the model to one call per turn needs constrained decoding; "
                          "send true or disable tools")
    options = GenerationOptions()
    stream = store = include = False
    if not count_only:
        _check_create_controls(body)
        include = parse_include(body.get("include"), "include")
        options = GenerationOptions(max_tokens=optional_int(body, "max_output_tokens", 0),
                                    temperature=optional_number(body, "temperature", 0.0, 2.0),
                                    top_p=optional_number(body, "top_p", 0.0, 1.0))
        stream = bool(optional_bool(body, "stream"))
        store = optional_bool(body, "store") is not False
    return ResponsesRequest(body=body, conversation=conversation, options=options, input_items=items, parent=parent,
                            previous_response_id=previous_id, instructions=instructions, stream=stream, store=store,
                            include_encrypted_reasoning=include)
