"""The field readers and error constructors every wire protocol shares.

Every problem is an :class:`InvalidRequestError` whose ``param`` is the exact field path
(``messages[2].content[0].image_url.detail``). Malformed values use ``invalid_value``; a field asking for behaviour
ninfer cannot provide uses ``unsupported_parameter`` with a message naming the guarantee.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping

from ninfer.core.errors import InvalidRequestError

INVALID_VALUE = "invalid_value"
UNSUPPORTED = "unsupported_parameter"
VISION_DISABLED = "vision_disabled"


# -- errors and field readers ----------------------------------------------------------------------------------------


def malformed(param: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {problem}", param=param, code=INVALID_VALUE)


def unsupported(param: str, guarantee: str) -> InvalidRequestError:
    """A capability rejection: the field asks for behaviour ninfer cannot guarantee."""
    return InvalidRequestError(f"{param} is not supported: {guarantee}", param=param, code=UNSUPPORTED)


# -- scalar readers --------------------------------------------------------------------------------


def type_name(value: Any) -> str:
    return "null" if value is None else {dict: "object", list: "array", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


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


def optional_number(body: Mapping[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise malformed(key, f"expected a finite number, got {value!r}")
    if not low <= value <= high:
        raise malformed(key, f"{value!r} is out of range [{low:g}, {high:g}]")
    return float(value)


def optional_int(body: Mapping[str, Any], key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise malformed(key, f"expected an integer, got {value!r}")
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
        raise malformed(f"{param}.prompt_cache_breakpoint.mode", f"expected 'explicit', got {mode!r}")
    return True


def json_object_string(raw: Any, param: str) -> dict[str, Any]:
    """A JSON-object string (tool-call arguments; member order kept)."""
    if not isinstance(raw, str):
        raise malformed(param, f"expected a JSON object string, got {type_name(raw)}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise malformed(param, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise malformed(param, f"expected a JSON object, got {type_name(value)}")
    return value
