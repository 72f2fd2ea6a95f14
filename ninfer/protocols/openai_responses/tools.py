"""Responses tools: direct function definitions, ``namespace`` groups, freeform ``custom`` tools, ``tool_choice``.

Each namespace/function pair is a distinct tool identity (``ToolDefinition.key``), so the same function name may
appear in different namespaces; the model frontend renders and parses a namespaced tool under its own prompt name.
A ``custom`` (freeform) tool is offered to the model as a function with one string parameter, ``input``; its
grammar is shown to the model but not enforced (there is no constrained decoding). OpenAI-hosted tools
(:data:`HOSTED_TOOL_TYPES`) have no executor here: under ``--hosted-tools ignore`` (the default) they are left out
of the effective tool set, never rendered, and reported; under ``reject`` they fail the request. Everything else
ninfer cannot honour is rejected with the field path: strict schemas, required/named choice, client-executed
built-in tool types, deferred loading, output schemas and callers that exclude direct invocation.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from ninfer.core.conversation import ToolDefinition
from ninfer.protocols.fields import (
    malformed,
    optional_bool,
    optional_list,
    optional_object,
    optional_str,
    quoted,
    type_name,
    type_tag,
    unsupported,
)

NO_CONSTRAINED_DECODING = "ninfer does not constrain decoding"
#: OpenAI-hosted tool types: the provider runs them, so a local server has no executor.
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26", "file_search",
    "code_interpreter", "image_generation", "mcp", "tool_search",
})
HOSTED_IGNORE = "ignore"  # the --hosted-tools default; any other policy rejects them
FREEFORM_PARAMETER = "input"


@attrs.frozen
class ParsedTools:
    """The effective tools in declaration order and the types of the hosted tools left out (in order)."""

    tools: tuple[ToolDefinition, ...]
    ignored: tuple[str, ...] = ()


def _function(tool: Mapping[str, Any], param: str, namespace: str | None,
              namespace_description: str | None) -> ToolDefinition:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise malformed(f"{param}.name", "expected a non-empty function name")
    description = optional_str(tool, "description", f"{param}.description")
    parameters = optional_object(tool, "parameters", f"{param}.parameters")
    if optional_bool(tool, "strict", f"{param}.strict"):
        raise unsupported(f"{param}.strict", f"strict schema adherence needs constrained decoding; "
                          f"{NO_CONSTRAINED_DECODING} (use strict: false)")
    if optional_bool(tool, "defer_loading", f"{param}.defer_loading"):
        raise unsupported(f"{param}.defer_loading", "deferred tool loading needs a hosted tool search, which is not "
                          "available; declare the tool directly")
    if tool.get("output_schema") is not None:
        raise unsupported(f"{param}.output_schema", "tool output schemas cannot be enforced on client-executed results")
    callers = tool.get("allowed_callers")
    if callers is not None:
        if not isinstance(callers, list):
            raise malformed(f"{param}.allowed_callers", f"expected an array, got {type_name(callers)}")
        if "direct" not in callers:
            raise unsupported(f"{param}.allowed_callers", "the model can only call tools directly; a tool that "
                              "excludes direct invocation cannot be offered")
    wire = {key: value for key, value in tool.items() if key not in ("type", "defer_loading", "allowed_callers")}
    return ToolDefinition(name, description, parameters, namespace=namespace,
                          namespace_description=namespace_description, wire_function=wire)


def _custom(tool: Mapping[str, Any], param: str) -> ToolDefinition:
    """A freeform tool as the function the model sees: one string parameter carrying the raw input."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise malformed(f"{param}.name", "expected a non-empty tool name")
    description = optional_str(tool, "description", f"{param}.description")
    input_description = "The tool's raw input text."
    tool_format = optional_object(tool, "format", f"{param}.format")
    if tool_format is not None:
        kind = type_tag(tool_format, f"{param}.format")
        if kind == "grammar":
            syntax = optional_str(tool_format, "syntax", f"{param}.format.syntax")
            definition = tool_format.get("definition")
            if not isinstance(definition, str) or not definition:
                raise malformed(f"{param}.format.definition", "expected a non-empty grammar definition")
            input_description += f" It must match this {syntax or 'grammar'} grammar:\n{definition}"
        elif kind != "text":
            raise malformed(f"{param}.format.type", f"expected 'text' or 'grammar', got {quoted(kind)}")
    parameters = {"type": "object", "properties": {FREEFORM_PARAMETER: {"type": "string",
                                                                         "description": input_description}},
                  "required": [FREEFORM_PARAMETER]}
    wire: dict[str, Any] = {"name": name}
    if description is not None:
        wire["description"] = description
    wire["parameters"] = parameters
    return ToolDefinition(name, description, parameters, wire_function=wire, freeform=True)


def _hosted(kind: Any, param: str) -> Exception:
    if kind in HOSTED_TOOL_TYPES:
        return unsupported(f"{param}.type", f"{quoted(kind)} is an OpenAI-hosted tool and this server has no "
                           "executor for it (start the server with --hosted-tools ignore to leave such tools out)")
    return unsupported(f"{param}.type", f"{quoted(kind)} tools need an executor or output Items ninfer does not "
                                        "have; only "
                       "client-executed function tools (direct or in a namespace) and custom tools are supported")


def parse_tools(body: Mapping[str, Any], hosted_tools: str = HOSTED_IGNORE) -> ParsedTools:
    """The request's tools in declaration order (namespace members in place of their group); ``hosted_tools`` is
    the ``--hosted-tools`` policy."""
    raw = optional_list(body, "tools")
    tools: list[ToolDefinition] = []
    ignored: list[str] = []
    for index, tool in enumerate(raw):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise malformed(where, f"expected a tool object, got {type_name(tool)}")
        kind = type_tag(tool, where)
        if kind == "function":
            declared = [(_function(tool, where, None, None), where)]
        elif kind == "namespace":
            declared = _namespace(tool, where)
        elif kind == "custom":
            declared = [(_custom(tool, where), where)]
        elif kind in HOSTED_TOOL_TYPES and hosted_tools == HOSTED_IGNORE:
            ignored.append(kind)
            continue
        else:
            raise _hosted(kind, where)
        for definition, param in declared:
            if any(existing.key == definition.key for existing in tools):
                shown = ".".join(part for part in definition.key if part)
                raise malformed(f"{param}.name", f"duplicate tool {quoted(shown)}")
            tools.append(definition)
    return ParsedTools(tuple(tools), tuple(ignored))


def _namespace(group: Mapping[str, Any], param: str) -> list[tuple[ToolDefinition, str]]:
    name = group.get("name")
    if not isinstance(name, str) or not name:
        raise malformed(f"{param}.name", "expected a non-empty namespace name")
    description = optional_str(group, "description", f"{param}.description")
    members = group.get("tools")
    if not isinstance(members, list) or not members:
        raise malformed(f"{param}.tools", "expected a non-empty array of function tools")
    declared = []
    for index, member in enumerate(members):
        where = f"{param}.tools[{index}]"
        if not isinstance(member, dict):
            raise malformed(where, f"expected a tool object, got {type_name(member)}")
        kind = type_tag(member, where)
        if kind != "function":
            raise _hosted(kind, where)
        declared.append((_function(member, where, name, description), where))
    return declared


def _allowed_tools(choice: Mapping[str, Any], tools: ParsedTools) -> tuple[tuple[str | None, str], ...]:
    mode = choice.get("mode", "auto")
    if mode == "required":
        raise unsupported("tool_choice.mode", f"forcing a tool call needs constrained decoding; {NO_CONSTRAINED_DECODING}"
                          " (use 'auto')")
    if mode != "auto":
        raise malformed("tool_choice.mode", f"expected 'auto', got {quoted(mode)}")
    listed = choice.get("tools")
    if not isinstance(listed, list):
        raise malformed("tool_choice.tools", f"expected an array, got {type_name(listed)}")
    declared = {tool.key for tool in tools.tools}
    allowed: list[tuple[str | None, str]] = []
    for index, entry in enumerate(listed):
        where = f"tool_choice.tools[{index}]"
        kind = type_tag(entry, where) if isinstance(entry, dict) else None
        if kind in tools.ignored:
            continue  # an ignored hosted tool: allowing it changes nothing
        if kind not in ("function", "custom"):
            raise unsupported(f"{where}.type", "only function and custom tools can be allowed")
        key = (optional_str(entry, "namespace", f"{where}.namespace"), optional_str(entry, "name", f"{where}.name"))
        if key not in declared:
            shown = ".".join(str(part) for part in key if part)
            raise malformed(f"{where}.name", f"{quoted(shown)} is not a declared function tool")
        allowed.append(key)
    return tuple(allowed)


def parse_tool_choice(body: Mapping[str, Any], tools: ParsedTools) -> tuple[str, Any]:
    """``(tool_choice, allowed_tools)`` for the Conversation."""
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return "auto", None
    if choice == "none":
        return "none", None
    if choice == "required":
        raise unsupported("tool_choice", f"forcing a tool call needs constrained decoding; {NO_CONSTRAINED_DECODING} "
                          "(use 'auto' or 'none')")
    if isinstance(choice, dict):
        kind = type_tag(choice, "tool_choice")
        if kind == "allowed_tools":
            return "auto", _allowed_tools(choice, tools)
        if isinstance(kind, str):
            raise unsupported("tool_choice", f"a {quoted(kind)} tool choice forces a specific tool, which needs "
                                             "constrained "
                              f"decoding; {NO_CONSTRAINED_DECODING} (use 'auto', 'none' or allowed_tools)")
    raise malformed("tool_choice", f"expected 'auto', 'none' or an allowed_tools object, got {quoted(choice)}")
