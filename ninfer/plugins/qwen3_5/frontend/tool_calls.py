"""Qwen XML tool calls: the declared tool set, an incremental parser of the tool-call region, and the typed
conversion of parameter text into JSON arguments.

The region grammar (whitespace ``WS`` = space, tab, CR, LF; any amount is accepted between tags)::

    region := CALL (WS CALL)* WS*                       # runs to the end of the output
    CALL   := "<tool_call>" WS "<function=" NAME ">" (WS PARAM)* WS "</function>" WS "</tool_call>"
    PARAM  := "<parameter=" PNAME ">" VALUE "</parameter>"

A VALUE ends at the first ``</parameter>`` that is not balanced by a nested ``<parameter=`` opener inside the value;
nested balanced markup and ``<tool_call>``/``<function=`` text stay value bytes. The value is the text between the
tags with exactly one leading and one trailing newline removed (when present).
"""

from __future__ import annotations

import enum
import json
import re
from typing import Any, Container, Iterable, Mapping, Sequence

import attrs

from ninfer.core.errors import InvalidRequestError
from ninfer.core.json_input import GENERATED_VALUE_LIMITS, JsonInputError, parse_json

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

# A function or parameter name longer than this (without its closing ">") is not a name.
MAX_NAME_LENGTH = 256

_WHITESPACE = " \t\r\n"
# Characters that end a tag name early: the tag can no longer be a well-formed name tag.
_NAME_BREAK = re.compile(r"[\s<]")
# What an undeclared tool name must look like to count as a name at all (else: invalid_tool_name).
_TOOL_NAME_SYNTAX = re.compile(r"[\w.:\-]+")
# A value can end in a partial marker of at most this many characters (a prefix of "</parameter>").
_PARTIAL_MARKER = len(PARAMETER_CLOSE) - 1

_PRIMITIVE_TYPES = frozenset({"string", "integer", "number", "boolean", "null"})
_JSON_TYPES = _PRIMITIVE_TYPES | {"object", "array"}


class FallbackReason(enum.StrEnum):
    """Why tool-call markup was returned to the client as ordinary text (stable request-log values)."""

    NONE = "none"
    MALFORMED_STRUCTURE = "malformed_structure"
    DUPLICATE_PARAMETER = "duplicate_parameter"
    INVALID_TOOL_NAME = "invalid_tool_name"
    UNDECLARED_TOOL = "undeclared_tool"
    TRAILING_CONTENT = "trailing_content"


# ---------------------------------------------------------------------------------------------------------------
# The declared tool set
# ---------------------------------------------------------------------------------------------------------------


def _optional_name(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidRequestError(f"tool {attribute.name} must be a non-empty string", param="tools")


def _required_name(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"tool {attribute.name} must be a non-empty string", param="tools")


def _schema(_instance: Any, _attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, Mapping):
        raise InvalidRequestError("tool parameters must be a JSON schema object", param="tools")


@attrs.frozen
class ToolSpec:
    """A callable tool as the model sees it.

    ``name`` and ``namespace`` are the client's identity of the tool; ``internal_name`` is the distinct name the
    frontend renders into the prompt for a namespaced tool (required then; a plain tool is rendered as ``name``).
    ``parameters`` is the tool's JSON schema, used only to guide typed conversion of argument text.
    """

    name: str = attrs.field(validator=_required_name)
    parameters: Mapping[str, Any] | None = attrs.field(default=None, validator=_schema)
    namespace: str | None = attrs.field(default=None, validator=_optional_name)
    internal_name: str | None = attrs.field(default=None, validator=_optional_name)

    def __attrs_post_init__(self) -> None:
        if self.namespace is not None and self.internal_name is None:
            raise InvalidRequestError(
                f"namespaced tool {self.namespace}/{self.name} needs the internal name it is rendered under",
                param="tools")

    @property
    def prompt_name(self) -> str:
        """The name the model writes in ``<function=...>`` to call this tool."""
        return self.internal_name if self.internal_name is not None else self.name


class ToolIndex:
    """The declared tools by prompt name, with the explicit mapping prompt name -> (namespace, name)."""

    def __init__(self, tools: Iterable[ToolSpec]) -> None:
        self._specs: dict[str, ToolSpec] = {}
        for spec in tools:
            if not isinstance(spec, ToolSpec):
                raise InvalidRequestError(f"expected a ToolSpec, got {type(spec).__name__}", param="tools")
            if spec.prompt_name in self._specs:
                raise InvalidRequestError(f"two tools are rendered under the same name {spec.prompt_name!r}",
                                          param="tools", code="duplicate_tool_name")
            self._specs[spec.prompt_name] = spec
        self.identities: Mapping[str, tuple[str | None, str]] = {
            prompt_name: (spec.namespace, spec.name) for prompt_name, spec in self._specs.items()}

    def __bool__(self) -> bool:
        return bool(self._specs)

    def __contains__(self, prompt_name: object) -> bool:
        return prompt_name in self._specs

    def spec(self, prompt_name: str) -> ToolSpec:
        return self._specs[prompt_name]


# ---------------------------------------------------------------------------------------------------------------
# The incremental region parser
# ---------------------------------------------------------------------------------------------------------------


@attrs.frozen
class ParsedCall:
    """One complete, well-formed call to a declared tool: its prompt name and raw parameter texts, in order."""

    prompt_name: str
    parameters: tuple[tuple[str, str], ...]


@attrs.frozen
class RegionOutcome:
    """What one feed/close of the region parser releases.

    ``calls`` become structured calls now. When ``resolved``, the region is over: ``content`` is the text returned
    to the client as ordinary content (all of it, or in tolerant mode what follows the recovered calls) and
    ``fallback_reason`` says why it was returned.
    """

    calls: tuple[ParsedCall, ...] = ()
    resolved: bool = False
    fallback_reason: FallbackReason = FallbackReason.NONE
    content: str = ""


class _Malformed(Exception):
    def __init__(self, reason: FallbackReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class _State(enum.Enum):
    CALL_OPEN = enum.auto()          # expecting "<tool_call>" (or the end, after at least one call)
    FUNCTION_OPEN = enum.auto()      # expecting "<function=NAME>"
    PARAMETER_OR_END = enum.auto()   # expecting "<parameter=NAME>" or "</function>"
    VALUE = enum.auto()              # inside a parameter value
    AFTER_FUNCTION = enum.auto()     # expecting "</tool_call>"
    DONE = enum.auto()


class ToolCallRegionParser:
    """Parses the tool-call region (from the first ``<tool_call>`` to the end of the output) incrementally.

    Strict mode: any problem returns the whole region, byte for byte, as content; calls are released only when
    the output ends cleanly after them. Tolerant mode: each complete call to a declared tool is released as soon as
    its ``</function>`` arrives, and the first problem ends the region: the text from the end of the last
    recovered call onward is returned as content. So tolerant mode recovers complete calls despite a missing
    ``</tool_call>`` (before the end, before the next ``<tool_call>`` or before other text), despite a suffix after
    the last call (returned as content), and despite the output ending inside a later, incomplete call.
    """

    def __init__(self, declared: Container[str], *, tolerant: bool) -> None:
        self._declared = declared
        self._tolerant = tolerant
        self._raw: list[str] = []
        self._buffer = ""
        self._offset = 0               # region offset of self._buffer[0]
        self._good_end = 0             # region offset just after the last complete call
        self._state = _State.CALL_OPEN
        self._complete_calls = 0
        self._unreleased: list[ParsedCall] = []
        self._function_name = ""
        self._parameters: list[tuple[str, str]] = []
        self._parameter_name = ""
        self._value_parts: list[str] = []
        self._depth = 0

    @property
    def resolved(self) -> bool:
        return self._state is _State.DONE

    def feed(self, text: str) -> RegionOutcome:
        """Consume more region text (the first feed starts with ``<tool_call>``)."""
        self._check_open()
        self._raw.append(text)
        self._buffer += text
        try:
            while self._step():
                pass
        except _Malformed as failure:
            return self._fail(failure.reason)
        return RegionOutcome(calls=self._release() if self._tolerant else ())

    def close(self) -> RegionOutcome:
        """The output ended: resolve the region."""
        self._check_open()
        state, rest = self._state, self._buffer
        if not rest and (state is _State.CALL_OPEN and self._complete_calls
                         or state is _State.AFTER_FUNCTION and self._tolerant):
            self._state = _State.DONE
            return RegionOutcome(calls=self._release(), resolved=True)
        if state is _State.CALL_OPEN and self._complete_calls:
            return self._fail(FallbackReason.TRAILING_CONTENT)  # a partial "<tool_call>" after the calls
        return self._fail(FallbackReason.MALFORMED_STRUCTURE)

    # -- resolution -------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state is _State.DONE:
            raise RuntimeError("the tool-call region is already resolved")

    def _release(self) -> tuple[ParsedCall, ...]:
        released = tuple(self._unreleased)
        self._unreleased.clear()
        return released

    def _fail(self, reason: FallbackReason) -> RegionOutcome:
        self._state = _State.DONE
        raw = "".join(self._raw)
        if not self._tolerant:
            return RegionOutcome(resolved=True, fallback_reason=reason, content=raw)
        return RegionOutcome(calls=self._release(), resolved=True, fallback_reason=reason,
                             content=raw[self._good_end:])

    # -- scanning ---------------------------------------------------------------------------------------------

    def _consume(self, count: int) -> None:
        self._buffer = self._buffer[count:]
        self._offset += count

    def _starts(self, marker: str) -> bool | None:
        """True if the buffer starts with ``marker``, None if it is a proper prefix of it, else False."""
        if self._buffer.startswith(marker):
            return True
        return None if marker.startswith(self._buffer) else False

    def _step(self) -> bool:
        """Advance one grammar element; False when more text is needed."""
        if self._state is _State.VALUE:
            return self._scan_value()
        stripped = self._buffer.lstrip(_WHITESPACE)
        self._consume(len(self._buffer) - len(stripped))
        if not self._buffer:
            return False
        if self._state is _State.CALL_OPEN:
            return self._expect_call_open()
        if self._state is _State.FUNCTION_OPEN:
            return self._expect_function_open()
        if self._state is _State.PARAMETER_OR_END:
            return self._expect_parameter_or_end()
        return self._expect_call_close()

    def _expect_call_open(self) -> bool:
        found = self._starts(TOOL_CALL_OPEN)
        if found:
            self._consume(len(TOOL_CALL_OPEN))
            self._state = _State.FUNCTION_OPEN
            return True
        if found is None:
            return False
        reason = FallbackReason.TRAILING_CONTENT if self._complete_calls else FallbackReason.MALFORMED_STRUCTURE
        raise _Malformed(reason)

    def _expect_function_open(self) -> bool:
        found = self._starts(FUNCTION_OPEN)
        if found is False:
            raise _Malformed(FallbackReason.MALFORMED_STRUCTURE)
        name = self._read_tag_name(FUNCTION_OPEN, FallbackReason.INVALID_TOOL_NAME) if found else None
        if name is None:
            return False
        if name not in self._declared:
            syntactic = _TOOL_NAME_SYNTAX.fullmatch(name) is not None
            raise _Malformed(FallbackReason.UNDECLARED_TOOL if syntactic else FallbackReason.INVALID_TOOL_NAME)
        self._function_name = name
        self._parameters = []
        self._state = _State.PARAMETER_OR_END
        return True

    def _expect_parameter_or_end(self) -> bool:
        if self._buffer.startswith(PARAMETER_OPEN):
            name = self._read_tag_name(PARAMETER_OPEN, FallbackReason.MALFORMED_STRUCTURE)
            if name is None:
                return False
            if any(existing == name for existing, _ in self._parameters):
                raise _Malformed(FallbackReason.DUPLICATE_PARAMETER)
            self._parameter_name = name
            self._value_parts = []
            self._depth = 0
            self._state = _State.VALUE
            return True
        if self._buffer.startswith(FUNCTION_CLOSE):
            self._consume(len(FUNCTION_CLOSE))
            self._unreleased.append(ParsedCall(self._function_name, tuple(self._parameters)))
            self._complete_calls += 1
            self._good_end = self._offset
            self._state = _State.AFTER_FUNCTION
            return True
        if PARAMETER_OPEN.startswith(self._buffer) or FUNCTION_CLOSE.startswith(self._buffer):
            return False
        raise _Malformed(FallbackReason.MALFORMED_STRUCTURE)

    def _expect_call_close(self) -> bool:
        found = self._starts(TOOL_CALL_CLOSE)
        if found:
            self._consume(len(TOOL_CALL_CLOSE))
            self._good_end = self._offset
        elif found is None:
            return False
        elif not self._tolerant:
            raise _Malformed(FallbackReason.MALFORMED_STRUCTURE)
        self._state = _State.CALL_OPEN  # tolerant: a missing "</tool_call>" is recovered
        return True

    def _read_tag_name(self, opener: str, invalid: FallbackReason) -> str | None:
        """Consume ``opener NAME>`` at the start of the buffer and return NAME; None while it is incomplete."""
        end = self._buffer.find(">", len(opener))
        name = self._buffer[len(opener):end if end >= 0 else len(self._buffer)]
        if _NAME_BREAK.search(name) or len(name) > MAX_NAME_LENGTH or (end >= 0 and not name):
            raise _Malformed(invalid)
        if end < 0:
            return None
        self._consume(end + 1)
        return name

    def _scan_value(self) -> bool:
        buffer = self._buffer
        opener = buffer.find(PARAMETER_OPEN)
        closer = buffer.find(PARAMETER_CLOSE)
        if opener < 0 and closer < 0:
            keep_from = len(buffer) - _PARTIAL_MARKER
            if keep_from > 0:
                self._value_parts.append(buffer[:keep_from])
                self._consume(keep_from)
            return False
        if opener >= 0 and (closer < 0 or opener < closer):
            self._take_value_text(opener + len(PARAMETER_OPEN))
            self._depth += 1
            return True
        if self._depth:
            self._take_value_text(closer + len(PARAMETER_CLOSE))
            self._depth -= 1
            return True
        self._take_value_text(closer)
        self._consume(len(PARAMETER_CLOSE))
        value = "".join(self._value_parts)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        self._parameters.append((self._parameter_name, value))
        self._value_parts = []
        self._state = _State.PARAMETER_OR_END
        return True

    def _take_value_text(self, count: int) -> None:
        self._value_parts.append(self._buffer[:count])
        self._consume(count)


# ---------------------------------------------------------------------------------------------------------------
# Typed argument conversion
# ---------------------------------------------------------------------------------------------------------------


@attrs.frozen
class ConvertedArguments:
    """A call's arguments in output order, plus how many were omitted (empty non-string) or schema-mismatched."""

    values: Mapping[str, Any]
    omitted_empty: int = 0
    schema_mismatched: int = 0


def declared_types(schema: Any) -> frozenset[str] | None:
    """The JSON types a property schema explicitly declares, or None when it declares none we support.

    Supported: a direct ``type`` (string or list of JSON type names) or an ``anyOf``/``oneOf`` whose every branch
    has an explicit primitive ``type``.
    """
    if not isinstance(schema, Mapping):
        return None
    if "type" in schema:
        return _type_names(schema["type"], _JSON_TYPES)
    for combinator in ("anyOf", "oneOf"):
        branches = schema.get(combinator)
        if isinstance(branches, Sequence) and not isinstance(branches, str) and branches:
            names: set[str] = set()
            for branch in branches:
                branch_types = _type_names(branch.get("type"), _PRIMITIVE_TYPES) if isinstance(
                    branch, Mapping) else None
                if branch_types is None:
                    return None
                names |= branch_types
            return frozenset(names)
    return None


def _type_names(value: Any, allowed: frozenset[str]) -> frozenset[str] | None:
    if isinstance(value, str):
        return frozenset({value}) if value in allowed else None
    if isinstance(value, Sequence) and value and all(isinstance(item, str) and item in allowed for item in value):
        return frozenset(value)
    return None


_MISSING = object()


def _parse_json(text: str) -> Any:
    """The JSON value ``text`` spells within the generated-value limits (no NaN/Infinity, no out-of-range or
    overlong numbers, nesting shallow enough to be replayed in a request), or ``_MISSING``."""
    try:
        return parse_json(text, limits=GENERATED_VALUE_LIMITS)
    except JsonInputError:
        return _MISSING


def _json_type_admitted(value: Any, types: frozenset[str]) -> bool:
    if value is None:
        return "null" in types
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return "integer" in types or "number" in types
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    if isinstance(value, str):
        return "string" in types
    if isinstance(value, list):
        return "array" in types
    return "object" in types


def convert_arguments(schema: Mapping[str, Any] | None, parameters: Sequence[tuple[str, str]]) -> ConvertedArguments:
    """Convert raw parameter texts to JSON values guided by the tool's schema (see the serving spec)."""
    properties = schema.get("properties") if isinstance(schema, Mapping) else None
    if not isinstance(properties, Mapping):
        properties = {}
    values: dict[str, Any] = {}
    omitted = mismatched = 0
    for name, text in parameters:
        types = declared_types(properties.get(name))
        if types is None:  # untyped inference
            parsed = _parse_json(text)
            values[name] = text if parsed is _MISSING else parsed
        elif "string" in types:
            values[name] = text
        elif text == "":
            omitted += 1
        elif "boolean" in types and text.strip().lower() in ("true", "false"):
            values[name] = text.strip().lower() == "true"
        else:
            parsed = _parse_json(text)
            if parsed is _MISSING or not _json_type_admitted(parsed, types):
                mismatched += 1
            values[name] = text if parsed is _MISSING else parsed
    return ConvertedArguments(values, omitted, mismatched)


def arguments_json_pieces(values: Mapping[str, Any]) -> list[str]:
    """``json.dumps(values, ensure_ascii=False)`` split into one piece per member plus the closing brace."""
    if not values:
        return ["{}"]
    pieces = [("{" if index == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
              + json.dumps(value, ensure_ascii=False) for index, (name, value) in enumerate(values.items())]
    pieces.append("}")
    return pieces
