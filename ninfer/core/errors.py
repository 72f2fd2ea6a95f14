"""Typed errors. Each carries what a protocol adapter needs to render it: HTTP status, type, code, param."""

from __future__ import annotations


class NinferError(Exception):
    """Base of every error ninfer raises on purpose.

    ``status`` is the HTTP status an adapter should use, ``error_type`` the OpenAI-style error type,
    ``code`` a stable machine-readable code and ``param`` the request field at fault (if any).
    """

    status: int = 500
    error_type: str = "server_error"
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
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


class QueueTimeoutError(NinferError):
    """A request was not admitted before its pending deadline."""

    status = 503
    error_type = "server_error"
    code = "request_queue_timeout"


class EngineUnavailableError(NinferError):
    """The engine suffered an engine-wide failure and accepts no more work."""

    status = 503
    error_type = "server_error"
    code = "engine_unavailable"
