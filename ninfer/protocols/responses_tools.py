"""Responses function tools: direct function definitions, ``namespace`` groups, ``tool_choice``.

Each namespace/function pair is a distinct tool identity (``ToolDefinition.key``), so the same function name may
appear in different namespaces; the model frontend renders and parses a namespaced tool under its own prompt name.
Everything ninfer cannot honour is rejected with the field path: strict schemas, required/named choice, hosted,
MCP and custom tools, deferred loading, output schemas and callers that exclude direct invocation.
"""

from __future__ import annotations

from typing import Any, Mapping

from ninfer.core.conversation import ToolDefinition
from ninfer.protocols.openai_chat_messages import malformed, optional_bool, optional_list, optional_object, optional_str, \
    type_name, unsupported

NO_CONSTRAINED_DECODING = "ninfer does not constrain decoding"


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


def _hosted(kind: Any, param: str) -> Exception:
    return unsupported(f"{param}.type", f"{kind!r} tools need an executor or a grammar ninfer does not have; only "
                       "client-executed function tools (direct or in a namespace) are supported")


def parse_tools(body: Mapping[str, Any]) -> tuple[ToolDefinition, ...]:
    """The request's tools in declaration order (namespace members in place of their group)."""
    raw = optional_list(body, "tools")
    tools: list[ToolDefinition] = []
    for index, tool in enumerate(raw):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise malformed(where, f"expected a tool object, got {type_name(tool)}")
        kind = tool.get("type")
        if kind == "function":
            declared = [(_function(tool, where, None, None), where)]
        elif kind == "namespace":
            declared = _namespace(tool, where)
        else:
            raise _hosted(kind, where)
        for definition, param in declared:
            if any(existing.key == definition.key for existing in tools):
                shown = ".".join(part for part in definition.key if part)
                raise malformed(f"{param}.name", f"duplicate tool {shown!r}")
            tools.append(definition)
    return tuple(tools)


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
        if member.get("type") != "function":
            raise _hosted(member.get("type"), where)
        declared.append((_function(member, where, name, description), where))
    return declared


def _allowed_tools(choice: Mapping[str, Any], tools: tuple[ToolDefinition, ...]) -> tuple[tuple[str | None, str], ...]:
    mode = choice.get("mode", "auto")
    if mode == "required":
        raise unsupported("tool_choice.mode", f"forcing a tool call needs constrained decoding; {NO_CONSTRAINED_DECODING}"
                          " (use 'auto')")
    if mode != "auto":
        raise malformed("tool_choice.mode", f"expected 'auto', got {mode!r}")
    listed = choice.get("tools")
    if not isinstance(listed, list):
        raise malformed("tool_choice.tools", f"expected an array, got {type_name(listed)}")
    declared = {tool.key for tool in tools}
    allowed: list[tuple[str | None, str]] = []
    for index, entry in enumerate(listed):
        where = f"tool_choice.tools[{index}]"
        if not isinstance(entry, dict) or entry.get("type") != "function":
            raise unsupported(f"{where}.type", "only function tools can be allowed")
        key = (entry.get("namespace"), entry.get("name"))
        if key not in declared:
            shown = ".".join(str(part) for part in key if part)
            raise malformed(f"{where}.name", f"{shown!r} is not a declared function tool")
        allowed.append(key)
    return tuple(allowed)


def parse_tool_choice(body: Mapping[str, Any], tools: tuple[ToolDefinition, ...]) -> tuple[str, Any]:
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
        kind = choice.get("type")
        if kind == "allowed_tools":
            return "auto", _allowed_tools(choice, tools)
        if isinstance(kind, str):
            raise unsupported("tool_choice", f"a {kind!r} tool choice forces a specific tool, which needs constrained "
                              f"decoding; {NO_CONSTRAINED_DECODING} (use 'auto', 'none' or allowed_tools)")
    raise malformed("tool_choice", f"expected 'auto', 'none' or an allowed_tools object, got {choice!r}")
