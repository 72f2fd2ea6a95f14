"""HTTP plumbing shared by every adapter: JSON bodies with a size limit, SSE with keep-alive, disconnects."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from ninfer.core.errors import InvalidRequestError, NinferError

KEEPALIVE_SECONDS = 5.0
KEEPALIVE_COMMENT = b": keep-alive\n\n"
DISCONNECT_KEY = "ninfer.receive"


class RequestTooLargeError(NinferError):
    status = 413
    error_type = "invalid_request_error"
    code = "request_too_large"


async def read_json_object(req: Any, max_bytes: int) -> dict[str, Any]:
    """Read the body (refusing more than ``max_bytes`` before parsing) and parse a JSON object."""
    if req.content_length is not None and req.content_length > max_bytes:
        raise RequestTooLargeError(f"request body of {req.content_length} bytes exceeds the {max_bytes}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in req.stream:
        size += len(chunk)
        if size > max_bytes:
            raise RequestTooLargeError(f"request body exceeds the {max_bytes}-byte limit")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequestError("request body must be a JSON object", code="invalid_json")
    return body


def json_bytes(payload: Any) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def sse_frame(data: Any, event: str | None = None) -> bytes:
    """One SSE frame; ``data`` is JSON-encoded unless it is already a string."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode("utf-8")


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
