"""Helpers of the reliability tests (``tests/reliability``): raw JSON bodies with spliced fragments, valid request
bodies per endpoint, the per-protocol checks of a live server's answer (status class, error shape, stream end),
``/proc`` readings of a server subprocess, and a request-log reader that tolerates a crash's partial last line.
"""

from __future__ import annotations

import json
import os
import re
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Iterable

import attrs
import httpx

from live_server import ECHO_MODEL, LiveServer

OPENAI = "openai"
ANTHROPIC = "anthropic"


# -- raw JSON ----------------------------------------------------------------------------------------------------


@attrs.frozen
class Raw:
    """JSON text spliced verbatim into an encoded body (a number or nesting ``json`` cannot write, a lone-surrogate
    escape, invalid UTF-8); usable as a value or as an object key."""

    text: bytes

    @classmethod
    def of(cls, text: str | bytes) -> "Raw":
        return cls(text.encode("utf-8") if isinstance(text, str) else text)

    def __repr__(self) -> str:
        shown = self.text if len(self.text) <= 48 else self.text[:24] + b"..." + self.text[-12:]
        return f"Raw({shown!r}, {len(self.text)} bytes)"


def encode(value: Any) -> bytes:
    """``value`` as JSON bytes: ``Raw`` fragments verbatim, strings as UTF-8 (escaped when they hold surrogates)."""
    out = bytearray()
    _emit(value, out)
    return bytes(out)


def _emit(value: Any, out: bytearray) -> None:
    if isinstance(value, Raw):
        out += value.text
    elif isinstance(value, dict):
        out += b"{"
        for index, (key, item) in enumerate(value.items()):
            if index:
                out += b","
            _emit(key if isinstance(key, Raw) else str(key), out)
            out += b":"
            _emit(item, out)
        out += b"}"
    elif isinstance(value, (list, tuple)):
        out += b"["
        for index, item in enumerate(value):
            if index:
                out += b","
            _emit(item, out)
        out += b"]"
    elif isinstance(value, str):
        try:
            out += json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: the \\uXXXX escape
            out += json.dumps(value).encode("ascii")
    else:
        out += json.dumps(value).encode("ascii")


def nested_arrays(depth: int) -> Raw:
    return Raw(b"[" * depth + b"]" * depth)


def nested_objects(depth: int, leaf: bytes = b"0") -> Raw:
    return Raw(b'{"a":' * depth + leaf + b"}" * depth)


def nested_schema(depth: int) -> Raw:
    """A JSON Schema whose ``properties`` nest ``depth`` objects deep."""
    head = b'{"type":"object","properties":{"a":' * depth
    return Raw(head + b'{"type":"string"}' + b"}}" * depth)


# -- valid requests (the shapes tests/protocols sends) --------------------------------------------------------------

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"]}


def chat_body(content: str = "hello there", **fields: Any) -> dict[str, Any]:
    return {
        "model": ECHO_MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "user", "content": content},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                    "parameters": WEATHER_SCHEMA}}],
        "tool_choice": "auto",
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": ["zzz"],
        "seed": 7,
        **fields,
    }


def responses_body(content: str = "hello there", **fields: Any) -> dict[str, Any]:
    return {
        "model": ECHO_MODEL,
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "What is the weather?"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "user", "content": content},
        ],
        "tools": [{"type": "function", "name": "get_weather", "description": "Current weather",
                   "parameters": WEATHER_SCHEMA}],
        "max_output_tokens": 8,
        "temperature": 0.7,
        "metadata": {"trace": "t-1"},
        "user": "user-1",
        "prompt_cache_key": "key-1",
        "store": False,
        **fields,
    }


def responses_count_body(**fields: Any) -> dict[str, Any]:
    body = responses_body(**fields)
    for name in ("max_output_tokens", "temperature", "metadata", "user", "prompt_cache_key", "store"):
        body.pop(name, None)  # Create-only fields: input_tokens rejects them
    return body


def messages_body(content: str = "hello there", **fields: Any) -> dict[str, Any]:
    return {
        "model": "claude-local",
        "max_tokens": 8,
        "system": "Be brief.",
        "tools": [{"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_SCHEMA}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is the weather?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": content}]},
        ],
        "temperature": 0.7,
        "stop_sequences": ["zzz"],
        "metadata": {"user_id": "user-1"},
        **fields,
    }


def messages_count_body(**fields: Any) -> dict[str, Any]:
    body = messages_body(**fields)
    for name in ("max_tokens", "temperature", "stop_sequences", "metadata"):
        body.pop(name, None)
    return body


@attrs.frozen
class Endpoint:
    """A POST endpoint with one valid body."""

    name: str
    path: str
    body: dict[str, Any]

    @property
    def protocol(self) -> str:
        return protocol_of(self.path)


def endpoints() -> list[Endpoint]:
    """Every POST endpoint that reads a body, streaming and not where it can stream."""
    return [
        Endpoint("chat", "/v1/chat/completions", chat_body()),
        Endpoint("chat-stream", "/v1/chat/completions",
                 chat_body(stream=True, stream_options={"include_usage": True})),
        Endpoint("responses", "/v1/responses", responses_body()),
        Endpoint("responses-stream", "/v1/responses", responses_body(stream=True)),
        Endpoint("responses-input-tokens", "/v1/responses/input_tokens", responses_count_body()),
        Endpoint("messages", "/v1/messages", messages_body()),
        Endpoint("messages-stream", "/v1/messages", messages_body(stream=True)),
        Endpoint("messages-count-tokens", "/v1/messages/count_tokens", messages_count_body()),
    ]


def protocol_of(path: str) -> str:
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


# -- checking a live server's answer -------------------------------------------------------------------------------

STREAM_ENDS = {
    "chat": ("[DONE]",),
    "responses": ("response.completed", "response.incomplete", "response.failed", "error"),
    "messages": ("message_stop", "error"),
}


@attrs.frozen
class Answer:
    """What came back for one raw request: status, headers, the body (JSON text, or the SSE lines)."""

    status: int
    headers: httpx.Headers
    text: str
    sse_lines: tuple[str, ...] | None  # None: not an event stream


def send_raw(server: LiveServer, path: str, content: bytes, headers: dict[str, str] | None = None,
             timeout: float = 60.0, client: httpx.Client | None = None) -> Answer:
    """POST raw bytes and read the whole answer (an event stream split into its SSE lines); a dropped connection
    raises."""
    own = client is None
    client = client or httpx.Client(timeout=timeout)
    try:
        with client.stream("POST", server.url(path), content=content, headers=headers or {}) as response:
            data = response.read()
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                lines = sse_lines(data)
                return Answer(response.status_code, response.headers, "\n".join(lines), lines)
            return Answer(response.status_code, response.headers, data.decode("utf-8", "replace"), None)
    finally:
        if own:
            client.close()


def sse_lines(data: bytes) -> tuple[str, ...]:
    """An event stream's lines as the SSE spec splits them: at CR, LF or CRLF only (``httpx``'s ``iter_lines`` also
    splits at U+2028, U+0085 and other ``str.splitlines`` separators, which JSON data may hold unescaped)."""
    return tuple(line.decode("utf-8", "replace") for line in re.split(rb"\r\n|\r|\n", data))


def error_shape_problems(protocol: str, answer: Answer) -> list[str]:
    """Why an error answer is not in its protocol's error shape (empty when it is)."""
    try:
        body = strict_json(answer.text)
    except ValueError:
        return [f"the error body is not JSON: {answer.text[:200]!r}"]
    if not answer.headers.get("content-type", "").startswith("application/json"):
        return [f"the error content-type is {answer.headers.get('content-type')!r}"]
    problems = []
    if protocol == OPENAI:
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return [f"no error object: {body!r:.200}"]
        for key, kinds in (("message", (str,)), ("type", (str,)), ("param", (str, type(None))),
                           ("code", (str, type(None)))):
            if key not in error or not isinstance(error[key], kinds):
                problems.append(f"error.{key} is missing or not {'/'.join(k.__name__ for k in kinds)}: {error!r:.200}")
    else:
        if not isinstance(body, dict) or body.get("type") != "error":
            return [f"not an Anthropic error: {body!r:.200}"]
        error = body.get("error")
        if not isinstance(error, dict) or not isinstance(error.get("type"), str) \
                or not isinstance(error.get("message"), str):
            problems.append(f"error.type/error.message missing: {body!r:.200}")
        if not isinstance(body.get("request_id"), str) or body["request_id"] != answer.headers.get("request-id"):
            problems.append(f"request_id {body.get('request_id')!r} does not match the request-id header "
                            f"{answer.headers.get('request-id')!r}")
    return problems


def stream_kind(path: str) -> str:
    return {"/v1/chat/completions": "chat", "/v1/responses": "responses", "/v1/messages": "messages"}[path]


def strict_json(text: str) -> Any:
    """``json.loads`` that refuses ``NaN`` and ``Infinity`` (not JSON, though Python writes and reads them)."""
    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def stream_problems(path: str, lines: Iterable[str]) -> list[str]:
    """Why a 200 event stream is malformed: a data line that is not strict JSON (but the Chat ``[DONE]``), or no
    terminal event of its protocol at the end (Chat: ``[DONE]``, or an error frame, after which nothing follows);
    empty when it is well formed."""
    kind = stream_kind(path)
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    if not data:
        return ["the stream carried no data line"]
    for payload in data[:-1] if kind == "chat" else data:
        try:
            strict_json(payload)
        except ValueError:
            return [f"a data line is not JSON: {payload[:200]!r}"]
    last = data[-1]
    if kind == "chat":
        if last == "[DONE]":
            return []
        try:
            final = strict_json(last)
        except ValueError:
            return [f"the last chat data line is not JSON: {last[:200]!r}"]
        if isinstance(final, dict) and isinstance(final.get("error"), dict):
            return []
        return [f"the chat stream ended with {last[:200]!r}, neither [DONE] nor an error frame"]
    try:
        event = strict_json(last)
    except ValueError:
        return [f"the last event is not JSON: {last[:200]!r}"]
    if not isinstance(event, dict) or event.get("type") not in STREAM_ENDS[kind]:
        return [f"the {kind} stream ended with a {event.get('type') if isinstance(event, dict) else event!r} "
                f"event, not one of {STREAM_ENDS[kind]}"]
    return []


def answer_problems(path: str, answer: Answer) -> list[str]:
    """Everything wrong with one answer: a 5xx; a 4xx outside its protocol's error shape; an unterminated 200 stream
    or a 200 body that is not a JSON object; a missing request id header."""
    protocol = protocol_of(path)
    header = "request-id" if protocol == ANTHROPIC else "x-request-id"
    problems = [] if answer.headers.get(header) else [f"no {header} header"]
    if answer.status >= 500:
        return [*problems, f"HTTP {answer.status}: {answer.text[:300]!r}"]
    if 400 <= answer.status < 500:
        return problems + error_shape_problems(protocol, answer)
    if answer.status != 200:
        return [*problems, f"unexpected HTTP {answer.status}"]
    if answer.sse_lines is not None:
        return problems + stream_problems(path, answer.sse_lines)
    try:
        body = strict_json(answer.text)
    except ValueError:
        return [*problems, f"the 200 body is not JSON: {answer.text[:200]!r}"]
    return problems if isinstance(body, dict) else [*problems, "the 200 body is not a JSON object"]


def healthy(server: LiveServer) -> bool:
    if server.process.poll() is not None:
        return False
    try:
        return httpx.get(server.url("/health"), timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def retry_after_problems(headers: httpx.Headers) -> list[str]:
    """Why a refusal's ``Retry-After`` is missing or not delay-seconds / an HTTP date."""
    value = headers.get("retry-after")
    if value is None:
        return ["no Retry-After header"]
    if value.strip().isdigit():
        return []
    try:
        parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return [f"Retry-After {value!r} is neither delay-seconds nor an HTTP date"]
    return []


# -- a server subprocess, through /proc ----------------------------------------------------------------------------


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


# -- the request log -------------------------------------------------------------------------------------------------


def read_request_log(path: Path) -> list[dict[str, Any]]:
    """The records of a ``--request-log-jsonl`` file. A last line without its line feed (a server killed while
    writing it) is skipped, as docs/request-log.md says readers do; any other line that is not one JSON object
    raises."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    lines.pop()  # b"" when the file ends with a line feed, else the partial last line: skipped
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise AssertionError(f"{path}:{number} is not a JSON line ({exc}): {line[:200]!r}") from None
        if not isinstance(record, dict):
            raise AssertionError(f"{path}:{number} is not a JSON object: {line[:200]!r}")
        records.append(record)
    return records
