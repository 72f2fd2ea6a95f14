"""Chat Completions messages and tools: wire JSON -> :class:`Message` s, :class:`ToolDefinition` s, tool choice.

Every problem is an :class:`InvalidRequestError` whose ``param`` is the exact field path
(``messages[2].content[0].image_url.detail``), built with the shared readers of :mod:`ninfer.protocols.fields`.
"""

from __future__ import annotations

from typing import Any, Mapping

from ninfer.core.conversation import (
    ContentPart,
    ImagePart,
    Message,
    TextPart,
    ToolCall,
    ToolDefinition,
    ToolResult,
    VideoPart,
)
from ninfer.core.errors import InvalidRequestError
from ninfer.protocols.fields import (
    cache_breakpoint,
    json_object_string,
    malformed,
    optional_bool,
    optional_list,
    optional_object,
    optional_str,
    quoted,
    type_name,
    type_tag,
    unsupported,
    vision_disabled,
)

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


# -- content parts ---------------------------------------------------------------------------------


def _media_url(part: Mapping[str, Any], key: str, param: str) -> tuple[str, Mapping[str, Any]]:
    """The URL of an ``image_url``/``video_url`` part (object or string form) and the object itself."""
    source = part.get(key)
    if isinstance(source, str):
        return source, {}
    if not isinstance(source, dict):
        raise malformed(f"{param}.{key}", f"expected an object with a url (or a url string), got {type_name(source)}")
    url = source.get("url")
    if not isinstance(url, str) or not url:
        raise malformed(f"{param}.{key}.url", "expected a non-empty http(s) URL or data URI")
    return url, source


def _check_media_url(url: str, param: str) -> None:
    lowered = url[:8].lower()
    if not (lowered.startswith("http://") or lowered.startswith("https://") or lowered.startswith("data:")):
        raise InvalidRequestError(
            f"{param}: media sources must be http(s) URLs or data URIs", param=param, code="invalid_media"
        )


def _media_part(part: Mapping[str, Any], kind: str, param: str, vision: bool) -> ContentPart:
    key = f"{kind}_url"
    url, source = _media_url(part, key, param)
    if kind == "image":
        detail = source.get("detail")
        if detail is not None and detail != "auto":
            if detail in ("low", "high"):
                raise unsupported(
                    f"{param}.image_url.detail",
                    f"explicit {quoted(detail)} image detail cannot be honored; images are encoded at their native "
                    "resolution (omit detail or use 'auto')",
                )
            raise malformed(f"{param}.image_url.detail", f"expected 'auto', 'low' or 'high', got {quoted(detail)}")
    _check_media_url(url, f"{param}.{key}.url" if source else f"{param}.{key}")
    if not vision:
        raise vision_disabled(param, kind)
    breakpoint_ = cache_breakpoint(part, param)
    return ImagePart(url, breakpoint_) if kind == "image" else VideoPart(url, breakpoint_)


def content_parts(content: Any, role: str, param: str, vision: bool) -> tuple[ContentPart, ...]:
    """Parse ``content`` (a string or an ordered part list) of a message with ``role``; adjacency is preserved."""
    if isinstance(content, str):
        return (TextPart(content),) if content else ()
    if not isinstance(content, list):
        raise malformed(param, f"expected a string or an array of content parts, got {type_name(content)}")
    parts: list[ContentPart] = []
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        if not isinstance(part, dict):
            raise malformed(where, f"expected a content part object, got {type_name(part)}")
        kind = type_tag(part, where)
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise malformed(f"{where}.text", f"expected a string, got {type_name(text)}")
            parts.append(TextPart(text, cache_breakpoint(part, where)))
        elif kind == "refusal":
            if role != "assistant":
                raise malformed(f"{where}.type", f"refusal parts are only valid in assistant messages, not {role}")
            text = part.get("refusal")
            if not isinstance(text, str):
                raise malformed(f"{where}.refusal", f"expected a string, got {type_name(text)}")
            parts.append(TextPart(text, cache_breakpoint(part, where)))
        elif kind in ("image_url", "video_url"):
            allowed = ("user", "tool") if kind == "image_url" else ("user",)
            if role not in allowed:
                raise malformed(f"{where}.type", f"{kind} parts are not valid in {role} messages")
            parts.append(_media_part(part, kind.removesuffix("_url"), where, vision))
        elif kind in ("input_audio", "audio", "file", "input_file"):
            raise unsupported(f"{where}.type", f"{kind} input cannot be processed; this server accepts text, image "
                              "and video input only")
        else:
            raise malformed(f"{where}.type", f"unknown content part type {quoted(kind)}")
    return tuple(parts)


# -- messages --------------------------------------------------------------------------------------


def _check_name(message: Mapping[str, Any], role: str, param: str) -> None:
    name = message.get("name")
    if name is None:
        return
    if not isinstance(name, str):
        raise malformed(f"{param}.name", f"expected a string, got {type_name(name)}")
    if name and role not in ("tool", "function"):
        raise unsupported(
            f"{param}.name",
            "participant names cannot be represented by the loaded chat template and would be silently dropped",
        )


def _arguments(raw: Any, param: str) -> Mapping[str, Any]:
    """Tool-call arguments: a JSON-object string (member order kept), an object, or empty."""
    if isinstance(raw, dict):
        return raw
    if raw is None or raw == "":
        return {}
    return json_object_string(raw, param)


def _function_name(function: Any, param: str) -> str:
    if not isinstance(function, dict):
        raise malformed(param, f"expected an object, got {type_name(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise malformed(f"{param}.name", "expected a non-empty function name")
    return name


def _history_tool_calls(message: Mapping[str, Any], param: str) -> list[ToolCall]:
    raw = optional_list(message, "tool_calls", f"{param}.tool_calls")
    calls = []
    for index, call in enumerate(raw):
        where = f"{param}.tool_calls[{index}]"
        if not isinstance(call, dict):
            raise malformed(where, f"expected a tool call object, got {type_name(call)}")
        kind = type_tag(call, where) if "type" in call else "function"
        if kind != "function":
            raise unsupported(f"{where}.type", f"{quoted(kind)} tool calls cannot be represented; only function "
                                               "calls are")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise malformed(f"{where}.id", "expected a non-empty tool call id")
        function = call.get("function")
        name = _function_name(function, f"{where}.function")
        calls.append(ToolCall(call_id, name, _arguments(function.get("arguments"), f"{where}.function.arguments")))
    return calls


def _reasoning(message: Mapping[str, Any], param: str) -> str | None:
    """``reasoning_content`` or its alias ``reasoning``; both present must agree."""
    values = {}
    for key in ("reasoning_content", "reasoning"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise malformed(f"{param}.{key}", f"expected a string, got {type_name(value)}")
            values[key] = value
    if len(set(values.values())) > 1:
        raise malformed(f"{param}.reasoning", "reasoning and reasoning_content are aliases and must be equal")
    return next(iter(values.values()), None)


class MessageParser:
    """Parses the ``messages`` array; pairs legacy ``function_call``/``function`` history by synthesized ids."""

    def __init__(self, vision: bool) -> None:
        self.vision = vision
        self.open_legacy_calls: list[ToolCall] = []
        self.legacy_count = 0

    def parse(self, messages: Any) -> tuple[Message, ...]:
        if not isinstance(messages, list):
            raise malformed("messages", f"expected an array of messages, got {type_name(messages)}")
        if not messages:
            raise malformed("messages", "at least one message is required")
        return tuple(self.message(message, f"messages[{index}]") for index, message in enumerate(messages))

    def message(self, message: Any, param: str) -> Message:
        if not isinstance(message, dict):
            raise malformed(param, f"expected a message object, got {type_name(message)}")
        role = type_tag(message, param, "role")
        if role not in ROLES:
            raise malformed(f"{param}.role", f"expected one of {', '.join(ROLES)}, got {quoted(role)}")
        _check_name(message, role, param)
        if role == "assistant":
            return self.assistant(message, param)
        if role == "tool":
            return self.tool(message, param)
        if role == "function":
            return self.function_result(message, param)
        if "content" not in message or message["content"] is None:
            raise malformed(f"{param}.content", f"{role} messages require content (a string or content parts)")
        return Message(role, content_parts(message["content"], role, f"{param}.content", self.vision))

    def assistant(self, message: Mapping[str, Any], param: str) -> Message:
        if message.get("audio") is not None:
            raise unsupported(f"{param}.audio", "audio output history cannot be represented; send its transcript as text")
        content = message.get("content")
        parts = () if content is None else content_parts(content, "assistant", f"{param}.content", self.vision)
        refusal = optional_str(message, "refusal", f"{param}.refusal")
        if refusal:
            parts = (*parts, TextPart(refusal))
        calls = _history_tool_calls(message, param)
        legacy = message.get("function_call")
        if legacy is not None:
            name = _function_name(legacy, f"{param}.function_call")
            self.legacy_count += 1
            call = ToolCall(
                f"call_legacy_{self.legacy_count}", name, _arguments(legacy.get("arguments"), f"{param}.function_call.arguments")
            )
            calls.append(call)
            self.open_legacy_calls.append(call)
        return Message("assistant", parts, reasoning=_reasoning(message, param), tool_calls=tuple(calls))

    def tool(self, message: Mapping[str, Any], param: str) -> Message:
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise malformed(f"{param}.tool_call_id", "tool messages require the id of the call they answer")
        content = message.get("content")
        if content is None:
            raise malformed(f"{param}.content", "tool messages require content (a string or content parts)")
        parts = content_parts(content, "tool", f"{param}.content", self.vision)
        return Message("tool", tool_result=ToolResult(call_id, parts))

    def function_result(self, message: Mapping[str, Any], param: str) -> Message:
        name = message.get("name")
        if not isinstance(name, str) or not name:
            raise malformed(f"{param}.name", "function messages require the name of the function that ran")
        content = message.get("content")
        parts = () if content is None else content_parts(content, "tool", f"{param}.content", self.vision)
        match = next((call for call in self.open_legacy_calls if call.name == name), None)
        if match is not None:
            self.open_legacy_calls.remove(match)
            call_id = match.call_id
        else:
            self.legacy_count += 1
            call_id = f"call_legacy_{self.legacy_count}"
        return Message("tool", tool_result=ToolResult(call_id, parts, name=name))


# -- tools -----------------------------------------------------------------------------------------


def parse_tools(body: Mapping[str, Any]) -> tuple[ToolDefinition, ...]:
    raw = optional_list(body, "tools")
    tools: list[ToolDefinition] = []
    for index, tool in enumerate(raw):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise malformed(where, f"expected a tool object, got {type_name(tool)}")
        kind = type_tag(tool, where)
        if kind != "function":
            raise unsupported(
                f"{where}.type",
                f"{quoted(kind)} tools need an executor or a grammar ninfer does not have; only client-executed "
                "function tools are supported",
            )
        function = tool.get("function")
        name = _function_name(function, f"{where}.function")
        description = optional_str(function, "description", f"{where}.function.description")
        parameters = optional_object(function, "parameters", f"{where}.function.parameters")
        strict = optional_bool(function, "strict", f"{where}.function.strict")
        if strict:
            raise unsupported(f"{where}.function.strict", "strict schema adherence needs constrained decoding, which "
                              "ninfer does not perform (use strict: false)")
        if any(existing.name == name for existing in tools):
            raise malformed(f"{where}.function.name", f"duplicate tool name {quoted(name)}")
        tools.append(ToolDefinition(name, description, parameters, wire_function=function))
    return tuple(tools)


def _allowed_tools(choice: Mapping[str, Any], tools: tuple[ToolDefinition, ...]) -> tuple[tuple[None, str], ...]:
    spec = choice.get("allowed_tools")
    if not isinstance(spec, dict):
        raise malformed("tool_choice.allowed_tools", f"expected an object, got {type_name(spec)}")
    mode = spec.get("mode", "auto")
    if mode == "required":
        raise unsupported("tool_choice.allowed_tools.mode", "forcing a tool call needs constrained decoding; use 'auto'")
    if mode != "auto":
        raise malformed("tool_choice.allowed_tools.mode", f"expected 'auto', got {quoted(mode)}")
    listed = spec.get("tools")
    if not isinstance(listed, list):
        raise malformed("tool_choice.allowed_tools.tools", f"expected an array, got {type_name(listed)}")
    declared = {tool.name for tool in tools}
    allowed: list[tuple[None, str]] = []
    for index, entry in enumerate(listed):
        where = f"tool_choice.allowed_tools.tools[{index}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise unsupported(f"{where}.type", "only function tools can be allowed")
        name = entry["function"].get("name") if isinstance(entry.get("function"), dict) else entry.get("name")
        if not isinstance(name, str) or name not in declared:
            raise malformed(f"{where}.function.name", f"{quoted(name)} is not a declared tool")
        allowed.append((None, name))
    return tuple(allowed)


def parse_tool_choice(body: Mapping[str, Any], tools: tuple[ToolDefinition, ...]) -> tuple[str, Any]:
    """``(tool_choice, allowed_tools)`` for the Conversation."""
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return "auto", None
    if choice == "none":
        return "none", None
    if choice == "required":
        raise unsupported("tool_choice", "forcing a tool call needs constrained decoding; use 'auto' or 'none'")
    if isinstance(choice, dict):
        kind = type_tag(choice, "tool_choice")
        if kind == "allowed_tools":
            return "auto", _allowed_tools(choice, tools)
        if kind in ("function", "custom"):
            raise unsupported("tool_choice", "forcing a named tool needs constrained decoding; use 'auto' or 'none'")
    raise malformed("tool_choice", f"expected 'auto', 'none' or an allowed_tools object, got {quoted(choice)}")


def check_legacy_tool_controls(body: Mapping[str, Any]) -> None:
    functions = body.get("functions")
    if functions is not None:
        if not isinstance(functions, list):
            raise malformed("functions", f"expected an array, got {type_name(functions)}")
        if functions:
            raise unsupported("functions", "legacy function definitions are not rendered; declare them in tools")
    control = body.get("function_call")
    if control is None or control in ("none", "auto"):
        return
    if isinstance(control, dict):
        raise unsupported("function_call", "forcing a named function needs constrained decoding")
    raise malformed("function_call", f"expected 'none' or 'auto', got {quoted(control)}")
