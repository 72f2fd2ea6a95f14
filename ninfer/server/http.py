"""HTTP plumbing shared by every adapter: JSON bodies with a size limit, SSE with keep-alive, disconnects.

Every request body enters through :func:`read_json_object` (the size limit, then :func:`ninfer.core.json_input.
parse_json` with its structural limits), and every JSON response byte leaves through :func:`json_bytes` or
:func:`sse_frame`, which cannot fail on text encoding.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from ninfer.core.errors import NinferError
from ninfer.core.json_input import JsonInputError, parse_json

KEEPALIVE_SECONDS = 5.0
KEEPALIVE_COMMENT = b": keep-alive\n\n"
DISCONNECT_KEY = "ninfer.receive"
MIB = 1024 * 1024


class RequestTooLargeError(NinferError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


class RequestBodyStalledError(NinferError):
    status = 408
    error_type = "invalid_request_error"
    code = "request_timeout"


def body_limit_bytes(config: Any) -> int:
    """The raw body limit of ``--max-request-mib`` in bytes."""
    return config.max_request_mib * MIB


async def read_json_object(req: Any, config: Any, *, dotted: bool = False) -> dict[str, Any]:
    """Read the body and parse a JSON object within the JSON input limits; ``dotted`` writes array indices in error
    paths Anthropic's way (``messages.2``).

    More than ``--max-request-mib`` is refused (413) before parsing. A body that stops arriving for
    ``--header-timeout-ms`` is refused (408): like slow headers, a slow body must not hold a request open."""
    max_bytes = body_limit_bytes(config)
    if req.content_length is not None and req.content_length > max_bytes:
        raise RequestTooLargeError(f"request body of {req.content_length} bytes exceeds the {max_bytes}-byte limit")
    stall_s = config.header_timeout_ms / 1000
    chunks: list[bytes] = []
    size = 0
    stream = aiter(req.stream)
    while True:
        try:
            chunk = await asyncio.wait_for(anext(stream), stall_s)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise RequestBodyStalledError(
                f"the request body stopped arriving for {stall_s:g} s (--header-timeout-ms) after {size} bytes"
            ) from None
        size += len(chunk)
        if size > max_bytes:
            raise RequestTooLargeError(f"request body exceeds the {max_bytes}-byte limit")
        chunks.append(chunk)
    body = parse_json(b"".join(chunks), dotted=dotted)
    if not isinstance(body, dict):
        raise JsonInputError("request body must be a JSON object", code="invalid_json")
    return body


def json_bytes(payload: Any) -> bytes:
    """Compact UTF-8 JSON. Non-ASCII text stays literal unless some string cannot be encoded (a lone surrogate,
    which the input checks keep out of client text): then every non-ASCII character is escaped instead."""
    try:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(payload, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def sse_frame(data: Any, event: str | None = None) -> bytes:
    """One SSE frame; ``data`` is JSON-encoded unless it is already a string."""
    body = data.encode("utf-8", "backslashreplace") if isinstance(data, str) else json_bytes(data)
    head = f"event: {event}\n".encode("utf-8", "backslashreplace") if event else b""
    return head + b"data: " + body + b"\n\n"


async def with_keepalive(frames: AsyncIterator[bytes], interval: float = KEEPALIVE_SECONDS) -> AsyncIterator[bytes]:
    """Yield ``frames``; after ``interval`` seconds without one, yield an SSE ``: keep-alive`` comment.

    The source is drained by a separate task into a queue so that a timeout never cancels the source mid-step.
    Closing this generator (client disconnect) cancels the pump task, which closes the source.
    """
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=64)

    async def pump() -> None:
        try:
            async for frame in frames:
                await queue.put(("frame", frame))
            await queue.put(("end", None))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # delivered to the consumer, which re-raises it
            await queue.put(("error", exc))

    task = asyncio.create_task(pump())
    try:
        while True:
            try:
                kind, item = await asyncio.wait_for(queue.get(), timeout=interval)
            except asyncio.TimeoutError:
                yield KEEPALIVE_COMMENT
                continue
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        aclose = getattr(frames, "aclose", None)
        if aclose is not None:
            await aclose()


class DisconnectTracking:
    """ASGI wrapper that keeps each HTTP request's ``receive`` reachable so handlers can watch for disconnects."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http":
            scope[DISCONNECT_KEY] = receive
        await self.app(scope, receive, send)


async def wait_for_disconnect(req: Any) -> None:
    """Return when the client of a request whose body was fully read disconnects."""
    receive = req.scope.get(DISCONNECT_KEY)
    if receive is None:  # not served through DisconnectTracking: never observable
        await asyncio.Event().wait()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
