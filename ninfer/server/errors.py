"""Error bodies in each protocol's own shape (OpenAI and Anthropic), and the report of an internal failure.

Anthropic error objects have no code field; ninfer adds its stable code there as the extension ``error.code``
(the same value an OpenAI body carries in ``error.code``), so clients of both protocols can act on it. A refusal a
retry can overcome (overload, queue timeout) carries ``Retry-After``.
"""

from __future__ import annotations

import traceback
from typing import Any

import attrs

from ninfer.core.errors import NinferError, QueueTimeoutError, ServerOverloadedError, bounded
from ninfer.observability import oplog

OPENAI = "openai"
ANTHROPIC = "anthropic"
INTERNAL_ERROR = "internal_error"
INTERNAL_MESSAGE = "internal server error"

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    501: "api_error",
    503: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}


@attrs.frozen
class ErrorReply:
    """A rendered error: HTTP status, JSON body and extra response headers."""

    status: int
    body: dict[str, Any]
    headers: tuple[tuple[str, str], ...] = ()


def protocol_for_path(path: str) -> str:
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


def openai_error(status: int, message: str, error_type: str, code: str | None, param: str | None) -> ErrorReply:
    return ErrorReply(status, {"error": {"message": message, "type": error_type, "param": param, "code": code}})


def anthropic_error(status: int, message: str, request_id: str | None, code: str | None = None) -> ErrorReply:
    # Anthropic has no 429-for-overload: local admission overload is 529 overloaded_error, a queue timeout 504.
    error_type = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    error: dict[str, Any] = {"type": error_type, "message": message}
    if code is not None:
        error["code"] = code  # ninfer's extension: the stable code (see the module docstring)
    return ErrorReply(status, {"type": "error", "error": error, "request_id": request_id})


def render_ninfer_error(error: NinferError, protocol: str, request_id: str | None) -> ErrorReply:
    if protocol == ANTHROPIC:
        status = error.status
        if isinstance(error, ServerOverloadedError):
            status = 529
        elif isinstance(error, QueueTimeoutError):
            status = 504
        reply = anthropic_error(status, error.message, request_id, error.code)
    else:
        reply = openai_error(error.status, error.message, error.error_type, error.code, error.param)
    if error.retry_after_s is not None:
        reply = attrs.evolve(reply, headers=(("Retry-After", str(error.retry_after_s)),))
    return reply


def render_http_error(status: int, message: str, protocol: str, request_id: str | None, code: str) -> ErrorReply:
    """An error that did not come from ninfer code (unknown route, method not allowed, auth, body size)."""
    if protocol == ANTHROPIC:
        return anthropic_error(status, message, request_id, code)
    error_type = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        error_type = "authentication_error"
    return openai_error(status, message, error_type, code, None)


def internal_error() -> NinferError:
    """What a client is told when an internal invariant broke (HTTP 500 ``internal_error``): nothing more."""
    return NinferError(INTERNAL_MESSAGE, code=INTERNAL_ERROR)


def report_internal_error(error: BaseException, request_id: str | None, where: str) -> None:
    """Log an unexpected exception once at ERROR: the request id, where it happened and the traceback. The
    exception's own message is bounded and escaped (it may quote request data)."""
    frames = "".join(traceback.format_tb(error.__traceback__)).rstrip()
    summary = ascii(bounded(str(error), 200))
    oplog.get_logger().error(f"internal error in request {request_id} while {where}: {type(error).__name__} "
                             f"{summary}\n{frames}")
