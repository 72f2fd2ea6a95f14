"""Responses input Items in canonical form: ids kept or generated, string content turned into parts.

The canonical form is what the store keeps, what ``input_items`` lists and what the request parser groups into
conversation turns.
"""

from __future__ import annotations

import secrets
from typing import Any, Mapping

from ninfer.core.errors import InvalidRequestError
from ninfer.protocols.fields import (
    cache_breakpoint,
    json_object_string,
    malformed,
    optional_str,
    quoted,
    type_name,
    type_tag,
    unsupported,
    vision_disabled,
)
from ninfer.protocols.reasoning_codec import decode_reasoning

MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def _generated_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


# -- canonical input Items -----------------------------------------------------------------------------------------


def _text_value(part: Mapping[str, Any], key: str, param: str) -> str:
    value = part.get(key)
    if not isinstance(value, str):
        raise malformed(f"{param}.{key}", f"expected a string, got {type_name(value)}")
    return value


def _check_media_source(url: Any, param: str) -> str:
    if not isinstance(url, str) or not url:
        raise malformed(param, "expected a non-empty http(s) URL or data URI")
    head = url[:8].lower()
    if not (head.startswith("http://") or head.startswith("https://") or head.startswith("data:")):
        raise InvalidRequestError(f"{param}: media sources must be http(s) URLs or data URIs", param=param,
                                  code="invalid_media")
    return url


def _media_part(part: Mapping[str, Any], kind: str, param: str, vision: bool) -> dict[str, Any]:
    if kind == "input_image":
        if part.get("file_id") is not None:
            raise unsupported(f"{param}.file_id", "uploaded files are not available; send an image_url (http(s) or "
                              "data URI)")
        detail = part.get("detail")
        if detail not in (None, "auto"):
            if detail in ("low", "high", "original"):
                raise unsupported(f"{param}.detail", f"explicit {quoted(detail)} image detail cannot be honored; "
                                  "images are encoded at their native resolution (omit detail or use 'auto')")
            raise malformed(f"{param}.detail", f"expected 'auto', 'low' or 'high', got {quoted(detail)}")
        canonical = {"type": kind, "image_url": _check_media_source(part.get("image_url"), f"{param}.image_url"),
                     "detail": "auto"}
    else:
        canonical = {"type": kind, "video_url": _check_media_source(part.get("video_url"), f"{param}.video_url")}
    if not vision:
        raise vision_disabled(param, kind.removeprefix("input_"))
    return canonical


def _content_part(part: Any, role: str, param: str, vision: bool) -> dict[str, Any]:
    if not isinstance(part, dict):
        raise malformed(param, f"expected a content part object, got {type_name(part)}")
    kind = type_tag(part, param)
    if kind == "input_text":
        canonical: dict[str, Any] = {"type": kind, "text": _text_value(part, "text", param)}
    elif kind in ("output_text", "refusal"):
        if role != "assistant":
            raise malformed(f"{param}.type", f"{kind} parts are only valid in assistant messages, not {role}")
        key = "text" if kind == "output_text" else "refusal"
        canonical = {"type": kind, key: _text_value(part, key, param)}
        if kind == "output_text":
            canonical["annotations"] = []
    elif kind in ("input_image", "input_video"):
        if role not in ("user", "assistant"):
            raise malformed(f"{param}.type", f"{kind} parts are not valid in {role} messages")
        canonical = _media_part(part, kind, param, vision)
    elif kind in ("input_file", "input_audio"):
        raise unsupported(f"{param}.type", f"{kind} content cannot be processed; text, image and video input only")
    else:
        raise malformed(f"{param}.type", f"unknown content part type {quoted(kind)}")
    if cache_breakpoint(part, param):
        canonical["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return canonical


def _message_item(item: Mapping[str, Any], param: str, vision: bool) -> dict[str, Any]:
    role = type_tag(item, param, "role")
    if role not in MESSAGE_ROLES:
        raise malformed(f"{param}.role", f"expected one of {', '.join(MESSAGE_ROLES)}, got {quoted(role)}")
    content = item.get("content")
    if isinstance(content, str):
        parts = [{"type": "output_text", "text": content, "annotations": []} if role == "assistant"
                 else {"type": "input_text", "text": content}]
    elif isinstance(content, list):
        parts = [_content_part(part, role, f"{param}.content[{index}]", vision) for index, part in enumerate(content)]
    else:
        raise malformed(f"{param}.content", f"expected a string or an array of content parts, got {type_name(content)}")
    for key in ("status", "phase"):  # accepted metadata without a prompt representation
        optional_str(item, key, f"{param}.{key}")
    return {"id": None, "type": "message", "role": role, "content": parts}


def _reasoning_item(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    """A reasoning Item with raw ``reasoning_text`` content, or with only this server's ``encrypted_content``
    (decoded back into that content)."""
    content = item.get("content")
    encrypted = optional_str(item, "encrypted_content", f"{param}.encrypted_content")
    if not content and encrypted is not None:
        content = [{"type": "reasoning_text", "text": decode_reasoning(encrypted, f"{param}.encrypted_content")}]
    if not content:
        raise unsupported(f"{param}.content", "reasoning replay needs the raw reasoning_text content or this "
                          "server's encrypted_content; a summary cannot be turned back into the model's thinking")
    if not isinstance(content, list):
        raise malformed(f"{param}.content", f"expected an array of reasoning_text parts, got {type_name(content)}")
    parts = []
    for index, part in enumerate(content):
        where = f"{param}.content[{index}]"
        if not isinstance(part, dict) or part.get("type") != "reasoning_text":
            raise malformed(f"{where}.type", "expected a reasoning_text part")
        parts.append({"type": "reasoning_text", "text": _text_value(part, "text", where)})
    summary = item.get("summary", [])
    if not isinstance(summary, list) or not all(isinstance(entry, dict) and entry.get("type") == "summary_text"
                                                and isinstance(entry.get("text"), str) for entry in summary):
        raise malformed(f"{param}.summary", "expected an array of summary_text parts")
    canonical = {"id": None, "type": "reasoning", "summary": [{"type": "summary_text", "text": entry["text"]}
                                                              for entry in summary], "content": parts}
    if encrypted is not None:
        canonical["encrypted_content"] = encrypted
    return canonical


def _check_completed(item: Mapping[str, Any], param: str) -> None:
    status = item.get("status")
    if status not in (None, "completed"):
        raise unsupported(f"{param}.status", f"a {quoted(status)} tool Item cannot be replayed; only completed "
                          "calls and results are representable")


def _name_fields(item: Mapping[str, Any], param: str, *, required: bool) -> dict[str, str]:
    fields = {}
    name = item.get("name")
    if name is not None or required:
        if not isinstance(name, str) or not name:
            raise malformed(f"{param}.name", "expected a non-empty function name")
        fields["name"] = name
    namespace = item.get("namespace")
    if namespace is not None:
        if not isinstance(namespace, str) or not namespace:
            raise malformed(f"{param}.namespace", "expected a non-empty namespace name")
        fields["namespace"] = namespace
    return fields


def _call_id(item: Mapping[str, Any], param: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise malformed(f"{param}.call_id", "expected a non-empty call_id")
    return call_id


def _function_call_item(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    _check_completed(item, param)
    call_id = _call_id(item, param)
    names = _name_fields(item, param, required=True)
    arguments = item.get("arguments")
    json_object_string(arguments, f"{param}.arguments")
    return {"id": None, "type": "function_call", "call_id": call_id, **names, "arguments": arguments,
            "status": "completed"}


def _custom_call_item(item: Mapping[str, Any], param: str) -> dict[str, Any]:
    _check_completed(item, param)
    call_id = _call_id(item, param)
    names = _name_fields(item, param, required=True)
    raw_input = item.get("input")
    if not isinstance(raw_input, str):
        raise malformed(f"{param}.input", f"expected a string, got {type_name(raw_input)}")
    return {"id": None, "type": "custom_tool_call", "call_id": call_id, **names, "input": raw_input,
            "status": "completed"}


def _function_output_item(item: Mapping[str, Any], param: str, vision: bool) -> dict[str, Any]:
    _check_completed(item, param)
    call_id = _call_id(item, param)
    names = _name_fields(item, param, required=False)
    output = item.get("output")
    if isinstance(output, list):
        if not output:
            raise malformed(f"{param}.output", "an output part array must not be empty")
        canonical_output: Any = []
        for index, part in enumerate(output):
            where = f"{param}.output[{index}]"
            if isinstance(part, dict) and part.get("type") not in ("input_text", "input_image"):
                raise unsupported(f"{where}.type", f"{quoted(part.get('type'))} tool output cannot be represented; "
                                  "use input_text or input_image parts")
            canonical_output.append(_content_part(part, "user", where, vision))
    elif isinstance(output, str):
        canonical_output = output
    else:
        raise malformed(f"{param}.output", f"expected a string or an array of content parts, got {type_name(output)}")
    return {"id": None, "type": item["type"], "call_id": call_id, **names, "output": canonical_output,
            "status": "completed"}


_ID_PREFIXES = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco",
                "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}
CALL_TYPES = ("function_call", "custom_tool_call")
RESULT_TYPES = ("function_call_output", "custom_tool_call_output")


def canonical_item(item: Any, param: str, vision: bool) -> dict[str, Any]:
    """Validate one input Item and return its canonical form (``id`` kept when supplied, generated otherwise)."""
    if not isinstance(item, dict):
        raise malformed(param, f"expected an Item object, got {type_name(item)}")
    kind = type_tag(item, param)
    if kind is None and "role" in item:
        kind = "message"
    if kind == "message":
        canonical = _message_item(item, param, vision)
    elif kind == "reasoning":
        canonical = _reasoning_item(item, param)
    elif kind == "function_call":
        canonical = _function_call_item(item, param)
    elif kind == "custom_tool_call":
        canonical = _custom_call_item(item, param)
    elif kind in RESULT_TYPES:
        canonical = _function_output_item(item, param, vision)
    elif isinstance(kind, str):
        raise unsupported(f"{param}.type", f"{quoted(kind)} Items cannot be represented; supported Items are "
                          "message, reasoning, function_call, function_call_output, custom_tool_call and "
                          "custom_tool_call_output")
    else:
        raise malformed(f"{param}.type", "expected an Item type (or a message role)")
    supplied = item.get("id")
    if supplied is not None and (not isinstance(supplied, str) or not supplied):
        raise malformed(f"{param}.id", "expected a non-empty string id")
    canonical["id"] = supplied or _generated_id(_ID_PREFIXES[canonical["type"]])
    return canonical


def canonical_input(raw: Any, vision: bool) -> tuple[dict[str, Any], ...]:
    """The canonical Items of ``input``: a non-empty string is one user message; null and "" are no input."""
    if raw is None or raw == "":
        return ()
    if isinstance(raw, str):
        return (canonical_item({"type": "message", "role": "user", "content": [{"type": "input_text", "text": raw}]},
                               "input", vision),)
    if not isinstance(raw, list):
        raise malformed("input", f"expected a string or an array of Items, got {type_name(raw)}")
    return tuple(canonical_item(item, f"input[{index}]", vision) for index, item in enumerate(raw))


