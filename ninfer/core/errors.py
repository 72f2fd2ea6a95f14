"""Typed errors. Each carries what a protocol adapter needs to render it: HTTP status, type, code, param.

Error text reaches clients, the request log and stderr, so client input appears in it only through
:func:`quoted` (a bounded, escaped slice) and every message and param is cut to a fixed length.
"""

from __future__ import annotations

import reprlib
from typing import Any

QUOTED_CHARS = 64  # how much of one client value an error message shows
RETRY_AFTER_SECONDS = 1  # the Retry-After of a refusal that a retry can overcome (overload, queue timeout)
MAX_MESSAGE_CHARS = 4096
MAX_PARAM_CHARS = 256


def _quoting() -> reprlib.Repr:
    quoting = reprlib.Repr()
    quoting.maxstring = quoting.maxother = quoting.maxlong = QUOTED_CHARS
    quoting.maxlevel, quoting.maxlist, quoting.maxdict, quoting.maxtuple = 2, 4, 4, 4
    return quoting


_QUOTING = _quoting()


def quoted(value: Any) -> str:
    """How an error message shows a client value: its repr (every unprintable or unencodable character escaped),
    cut to about :data:`QUOTED_CHARS` characters with ``...`` in the middle, containers shown shallowly."""
    try:
        return _QUOTING.repr(value)
    except ValueError:  # an integer beyond Python's digit limit for str()
        return f"<an integer of {value.bit_length()} bits>"


def bounded(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, the cut marked with how much was left out."""
    if len(text) <= limit:
        return text
    kept = limit - len(f"... ({len(text)} more characters)")
    return f"{text[:kept]}... ({len(text) - kept} more characters)"


class NinferError(Exception):
    """Base of every error ninfer raises on purpose.

    ``status`` is the HTTP status an adapter should use, ``error_type`` the OpenAI-style error type,
    ``code`` a stable machine-readable code and ``param`` the request field at fault (if any).
    """

    status: int = 500
    error_type: str = "server_error"
    code: str = "internal_error"
    retry_after_s: int | None = None  # sent as Retry-After: the same request may succeed this much later

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        message = bounded(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.message = message
        self.param = param if param is None else bounded(param, MAX_PARAM_CHARS)
        if code is not None:
            self.code = code


class ConfigError(NinferError):
    """An invalid startup option or option combination."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_config"


class NotYetAvailableError(NinferError):
    """A registered capability whose implementation has not landed yet."""

    status = 501
    error_type = "not_implemented_error"
    code = "not_available"


class PluginError(NinferError):
    """A plugin that cannot be loaded or conflicts with another plugin."""

    code = "plugin_error"


class ArtifactError(NinferError):
    """A .ninfer artifact (or Hugging Face directory) that cannot be read or does not match its manifest."""

    code = "invalid_artifact"


class WeightMismatchError(ArtifactError):
    """A tensor that is missing, unexpected or mis-shaped for the model being loaded."""

    code = "weight_mismatch"


class InvalidRequestError(NinferError):
    """A client request that is malformed or asks for something ninfer cannot provide."""

    status = 400
    error_type = "invalid_request_error"
    code = "invalid_request_error"


class CapacityError(NinferError):
    """A request that can never fit the engine's startup-fixed capacity."""

    status = 400
    error_type = "invalid_request_error"
    code = "context_length_exceeded"


class ServerOverloadedError(NinferError):
    """Admission capacity (max concurrency + pending) is full."""

    status = 429
    error_type = "server_error"
    code = "server_overloaded"
    retry_after_s = RETRY_AFTER_SECONDS


class QueueTimeoutError(NinferError):
    """A request was not admitted before its pending deadline."""

    status = 503
    error_type = "server_error"
    code = "request_queue_timeout"
    retry_after_s = RETRY_AFTER_SECONDS


class EngineUnavailableError(NinferError):
    """The engine suffered an engine-wide failure and accepts no more work."""

    status = 503
    error_type = "server_error"
    code = "engine_unavailable"
