"""Lowering a normalized :class:`~ninfer.core.conversation.Conversation` into the inputs of a Qwen chat template.

The template sees Hugging Face-style dicts: ``messages`` (roles system/user/assistant/tool, string content or a list of
text/image/video items, ``reasoning_content``, ``tool_calls`` with ordered ``arguments``) and ``tools``
(``{"type": "function", "function": {...}}`` in received member order).

Representation choices this module makes (the official templates have no spelling for them):

- **Namespaced tools** (Responses) are rendered, called and replayed under the prompt name ``namespace.name``
  (:func:`prompt_tool_name`); the output decoder maps it back through ``ToolSpec.internal_name``.
- **System-class messages not at index 0** (system or developer) stay at their positions. The official templates
  reject them, so each is rendered as a placeholder user turn whose content is wrapped in ``<tool_response>`` tags
  (the templates skip such turns when they look for the last user query, so which assistant turns keep their
  reasoning does not change) and the placeholder turn is then replaced by ``<|im_start|>system\\n{text}<|im_end|>\\n``
  (text trimmed, as the templates trim a leading system message).
- **Failed tool results** (``ToolResult.is_error``) start with the line :data:`TOOL_ERROR_PREFIX` (``"Error:\\n"``).
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Mapping, Sequence

import attrs

from ninfer.core.conversation import (
    ContentPart,
    Conversation,
    ImagePart,
    Message,
    TextPart,
    ToolCall,
    ToolDefinition,
    VideoPart,
)
from ninfer.core.errors import InvalidRequestError
from ninfer.plugins.qwen3_5.frontend.tool_calls import MAX_NAME_LENGTH, ToolSpec

INVALID_PROMPT = "invalid_prompt"
TOOL_ERROR_PREFIX = "Error:\n"
SYSTEM_ROLES = frozenset({"system", "developer"})
_SYSTEM_BLOCK = "<|im_start|>system\n{text}<|im_end|>\n"
_USER_BLOCK = "<|im_start|>user\n{text}<|im_end|>\n"
# A name the decoder can read back from "<function=NAME>": no whitespace, no "<" and no ">".
_EMITTABLE_NAME = re.compile(r"[^\s<>]+")


def prompt_tool_name(namespace: str | None, name: str) -> str:
    """The name a tool is rendered, called and replayed under: ``name``, or ``namespace.name`` when namespaced."""
    return name if namespace is None else f"{namespace}.{name}"


def plain_json(value: Any) -> Any:
    """``value`` with every mapping turned into a dict and every sequence into a list, member order kept."""
    if isinstance(value, Mapping):
        return {key: plain_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(item) for item in value]
    return value


@attrs.frozen
class TemplateInput:
    """What one render needs: template ``messages`` and ``tools`` plus the placeholder turns to substitute.

    ``system_blocks`` maps each placeholder user block (exact rendered text) to the system block replacing it.
    ``media_items`` counts the image/video parts rendered.
    """

    messages: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...]
    system_blocks: Mapping[str, str]
    media_items: int

    def substitute_system_blocks(self, rendered: str) -> str:
        """Replace every placeholder turn by its system block (each must appear exactly once)."""
        for placeholder, block in self.system_blocks.items():
            if rendered.count(placeholder) != 1:
                raise InvalidRequestError(
                    "the chat template cannot render a system or developer message after the first message",
                    param="messages", code=INVALID_PROMPT)
            rendered = rendered.replace(placeholder, block)
        return rendered


def tool_specs(tools: Sequence[ToolDefinition]) -> tuple[ToolSpec, ...]:
    """The decoder's view of ``tools``: client identity, schema and (namespaced) prompt name."""
    return tuple(
        ToolSpec(name=tool.name, parameters=_schema_of(tool), namespace=tool.namespace,
                 internal_name=None if tool.namespace is None else prompt_tool_name(tool.namespace, tool.name))
        for tool in tools)


def lower(conversation: Conversation) -> TemplateInput:
    """The template input of ``conversation`` (see the module docstring for the representation rules)."""
    if not conversation.messages:
        raise InvalidRequestError("the conversation has no messages", param="messages", code=INVALID_PROMPT)
    nonce = secrets.token_hex(8)
    messages: list[Mapping[str, Any]] = []
    system_blocks: dict[str, str] = {}
    for index, message in enumerate(conversation.messages):
        if message.role in SYSTEM_ROLES:
            text = _system_text(message, index)
            if index == 0:
                messages.append({"role": "system", "content": text})
                continue
            placeholder = f"<tool_response>ninfer-system-{nonce}-{index}</tool_response>"
            system_blocks[_USER_BLOCK.format(text=placeholder)] = _SYSTEM_BLOCK.format(text=text.strip())
            messages.append({"role": "user", "content": placeholder})
        else:
            messages.append(_lower_message(message, index))
    media = sum(_media_count(part) for message in conversation.messages for part in _parts(message))
    return TemplateInput(tuple(messages), _lower_tools(conversation.tools), system_blocks, media)


# -- messages -----------------------------------------------------------------------------------------------------


def _parts(message: Message) -> tuple[ContentPart, ...]:
    if message.role == "tool" and message.tool_result is not None:
        return message.tool_result.parts
    return message.parts


def _media_count(part: ContentPart) -> int:
    return 1 if isinstance(part, (ImagePart, VideoPart)) else 0


def _system_text(message: Message, index: int) -> str:
    if message.has_media:
        raise InvalidRequestError(f"messages[{index}]: a {message.role} message cannot contain images or videos",
                                  param="messages", code=INVALID_PROMPT)
    return message.text


def _lower_message(message: Message, index: int) -> Mapping[str, Any]:
    if message.role == "user":
        return {"role": "user", "content": _content(message.parts)}
    if message.role == "assistant":
        lowered: dict[str, Any] = {"role": "assistant", "content": _content(message.parts)}
        if message.reasoning is not None:
            lowered["reasoning_content"] = message.reasoning
        if message.tool_calls:
            lowered["tool_calls"] = [_lower_call(call) for call in message.tool_calls]
        return lowered
    if message.role == "tool":
        if message.tool_result is None:
            raise InvalidRequestError(f"messages[{index}]: a tool message needs its tool result",
                                      param="messages", code=INVALID_PROMPT)
        result = message.tool_result
        parts = ((TextPart(TOOL_ERROR_PREFIX),) if result.is_error else ()) + tuple(result.parts)
        return {"role": "tool", "content": _content(parts)}
    raise InvalidRequestError(f"messages[{index}]: unsupported role {message.role!r}", param="messages",
                              code=INVALID_PROMPT)


def _content(parts: Sequence[ContentPart]) -> str | list[Mapping[str, str]]:
    """Adjacent text parts joined without separators; a list of template items when media parts are present."""
    if not any(_media_count(part) for part in parts):
        return "".join(part.text for part in parts if isinstance(part, TextPart))
    items: list[Mapping[str, str]] = []
    for part in parts:
        if isinstance(part, ImagePart):
            items.append({"type": "image", "image": part.url})
        elif isinstance(part, VideoPart):
            items.append({"type": "video", "video": part.url})
        elif items and items[-1]["type"] == "text":
            items[-1] = {"type": "text", "text": items[-1]["text"] + part.text}
        else:
            items.append({"type": "text", "text": part.text})
    return items


def _lower_call(call: ToolCall) -> Mapping[str, Any]:
    return {"type": "function", "function": {"name": prompt_tool_name(call.namespace, call.name),
                                             "arguments": plain_json(call.arguments)}}


# -- tools --------------------------------------------------------------------------------------------------------


def _schema_of(tool: ToolDefinition) -> Mapping[str, Any] | None:
    if tool.parameters is not None:
        return tool.parameters
    wire = tool.wire_function
    return wire.get("parameters") if wire is not None else None


def _lower_tools(tools: Sequence[ToolDefinition]) -> tuple[Mapping[str, Any], ...]:
    rendered: list[Mapping[str, Any]] = []
    seen: set[str] = set()
    for tool in tools:
        name = prompt_tool_name(tool.namespace, tool.name)
        if not (_EMITTABLE_NAME.fullmatch(name) and len(name) <= MAX_NAME_LENGTH):
            raise InvalidRequestError(
                f"tool name {name!r} cannot be called by the model: a Qwen tool name must be 1..{MAX_NAME_LENGTH} "
                "characters without whitespace, '<' or '>'", param="tools", code="invalid_tool_name")
        if name in seen:
            raise InvalidRequestError(f"two tools are rendered under the same name {name!r}", param="tools",
                                      code="duplicate_tool_name")
        seen.add(name)
        rendered.append({"type": "function", "function": _function_object(tool, name)})
    return tuple(rendered)


def _function_object(tool: ToolDefinition, prompt_name: str) -> Mapping[str, Any]:
    """The received function object (member order kept) under its prompt name, or {name, description?, parameters?}."""
    if tool.wire_function is not None:
        function = plain_json(tool.wire_function)
        if "name" in function:
            function["name"] = prompt_name
            return function
        return {"name": prompt_name, **function}
    function = {"name": prompt_name}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.parameters is not None:
        function["parameters"] = plain_json(tool.parameters)
    return function
