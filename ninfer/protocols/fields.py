"""The field readers and error constructors every wire protocol shares.

Every problem is an :class:`InvalidRequestError` whose ``param`` is the exact field path
(``messages[2].content[0].image_url.detail``). Malformed values use ``invalid_value``, a value of the wrong JSON
type included: every reader checks the type before the value is used. A field asking for behaviour ninfer cannot
provide uses ``unsupported_parameter`` with a message naming the guarantee. Client values appear in messages only
through :func:`~ninfer.core.errors.quoted` and client member names in paths only through :func:`member_path`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from ninfer.core.errors import InvalidRequestError, quoted
from ninfer.core.json_input import member_path, parse_json

INVALID_VALUE = "invalid_value"
UNSUPPORTED = "unsupported_parameter"
VISION_DISABLED = "vision_disabled"

__all__ = ["member_path", "quoted"]  # re-exported for the protocol parsers


# -- errors and field readers ----------------------------------------------------------------------------------------


def malformed(param: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {problem}", param=param, code=INVALID_VALUE)


def unsupported(param: str, guarantee: str) -> InvalidRequestError:
    """A capability rejection: the field asks for behaviour ninfer cannot guarantee."""
    return InvalidRequestError(f"{param} is not supported: {guarantee}", param=param, code=UNSUPPORTED)


def vision_disabled(param: str, kind: str) -> InvalidRequestError:
    """Media input on a server started without ``--vision``. The message carries the code too: Anthropic error
    bodies have no code field of their own."""
    return InvalidRequestError(f"{param}: {kind} input requires the server to be started with --vision "
                               f"({VISION_DISABLED})", param=param, code=VISION_DISABLED)


# -- scalar readers --------------------------------------------------------------------------------


def type_name(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def type_tag(value: Mapping[str, Any], param: str, key: str = "type") -> str | None:
    """The discriminator string at ``key`` (``type``, ``role``, ``mode``) of an object, None when absent or null;
    any other JSON type is malformed here, so callers may look the tag up in sets and mappings."""
    tag = value.get(key)
    if tag is not None and not isinstance(tag, str):
        raise malformed(f"{param}.{key}" if param else key, f"expected a string, got {type_name(tag)}")
    return tag


def optional_bool(body: Mapping[str, Any], key: str, param: str | None = None) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise malformed(param or key, f"expected a boolean, got {type_name(value)}")
    return value


def optional_str(body: Mapping[str, Any], key: str, param: str | None = None) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise malformed(param or key, f"expected a string, got {type_name(value)}")
    return value


def optional_object(body: Mapping[str, Any], key: str, param: str | None = None) -> Mapping[str, Any] | None:
    value = body.get(key)
    if value is not None and not isinstance(value, dict):
        raise malformed(param or key, f"expected an object, got {type_name(value)}")
    return value


def optional_list(body: Mapping[str, Any], key: str, param: str | None = None) -> list[Any]:
    """The array at ``key`` ([] when absent or null)."""
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise malformed(param or key, f"expected an array, got {type_name(value)}")
    return value


def is_finite_number(value: Any) -> bool:
    """A JSON number (not a boolean) that is finite; integers of any size qualify without a float conversion."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or isinstance(value, float) and math.isfinite(value)


def optional_number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_finite_number(value):
        raise malformed(key, f"expected a finite number, got {quoted(value)}")
    if not low <= value <= high:
        raise malformed(key, f"{quoted(value)} is out of range [{low:g}, {high:g}]")
    return float(value)


def optional_int(body: Mapping[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise malformed(key, f"expected an integer, got {quoted(value)}")
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise malformed(key, f"{value} is out of range (expected {bound})")
    return value


def cache_breakpoint(part: Mapping[str, Any], param: str) -> bool:
    """A content part's ``prompt_cache_breakpoint``: ``{"mode": "explicit"}`` marks an explicit write candidate."""
    marker = part.get("prompt_cache_breakpoint")
    if marker is None:
        return False
    if not isinstance(marker, dict):
        raise malformed(f"{param}.prompt_cache_breakpoint", f"expected an object, got {type_name(marker)}")
    mode = marker.get("mode")
    if mode != "explicit":
        raise malformed(f"{param}.prompt_cache_breakpoint.mode", f"expected 'explicit', got {quoted(mode)}")
    return True


def json_object_string(raw: Any, param: str) -> dict[str, Any]:
    """A JSON-object string (tool-call arguments; member order kept), parsed within the JSON input limits."""
    if not isinstance(raw, str):
        raise malformed(param, f"expected a JSON object string, got {type_name(raw)}")
    value = parse_json(raw, param=param, code=INVALID_VALUE)
    if not isinstance(value, dict):
        raise malformed(param, f"expected a JSON object, got {type_name(value)}")
    return value
