"""Error bodies in each protocol's own shape (OpenAI and Anthropic)."""

from __future__ import annotations

from typing import Any

import attrs

from ninfer.core.errors import NinferError, QueueTimeoutError, ServerOverloadedError

OPENAI = "openai"
ANTHROPIC = "anthropic"

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
    """A rendered error: HTTP status and JSON body."""

    status: int
    body: dict[str, Any]


def protocol_for_path(path: str) -> str:
    return ANTHROPIC if path.startswith("/v1/messages") else OPENAI


def openai_error(status: int, message: str, error_type: str, code: str | None, param: str | None) -> ErrorReply:
    return ErrorReply(status, {"error": {"message": message, "type": error_type, "param": param, "code": code}})


def anthropic_error(status: int, message: str, request_id: str | None) -> ErrorReply:
    # Anthropic has no 429-for-overload: local admission overload is 529 overloaded_error, a queue timeout 504.
    error_type = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return ErrorReply(status, {"type": "error", "error": {"type": error_type, "message": message}, "request_id": request_id})


def render_ninfer_error(error: NinferError, protocol: str, request_id: str | None) -> ErrorReply:
    if protocol == ANTHROPIC:
        status = error.status
        if isinstance(error, ServerOverloadedError):
            status = 529
        elif isinstance(error, QueueTimeoutError):
            status = 504
        return anthropic_error(status, error.message, request_id)
    return openai_error(error.status, error.message, error.error_type, error.code, error.param)


def render_http_error(status: int, message: str, protocol: str, request_id: str | None, code: str) -> ErrorReply:
    """An error that did not come from ninfer code (unknown route, method not allowed, auth, body size)."""
    if protocol == ANTHROPIC:
        return anthropic_error(status, message, request_id)
    error_type = "invalid_request_error" if status < 500 else "server_error"
    if status == 401:
        error_type = "authentication_error"
    return openai_error(status, message, error_type, code, None)
