"""The falcon ASGI application: middleware (request ids, auth, body limit), error rendering, adapter mounting."""

from __future__ import annotations

import hmac
import json
import secrets
import time
from typing import TYPE_CHECKING, Any

import attrs
import falcon
import falcon.asgi

from ninfer.core.errors import NinferError, quoted
from ninfer.server.errors import (
    ANTHROPIC,
    ErrorReply,
    internal_error,
    protocol_for_path,
    render_http_error,
    render_ninfer_error,
    report_internal_error,
)
from ninfer.server.http import DisconnectTracking, RequestTooLargeError, body_limit_bytes
from ninfer.server.routes import PROBE_PATHS

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.config import ServeConfig
    from ninfer.core.frontend import Frontend
    from ninfer.core.plugins import PluginManager
    from ninfer.engine import Engine

OPEN_PATHS = frozenset({"/health", *PROBE_PATHS})  # readiness and identity probes answer without a key


@attrs.define
class ServerContext:
    """What adapters and lifecycle hooks see of the running server (:class:`ninfer.core.serving.ServerView`)."""

    config: ServeConfig
    plugins: PluginManager
    engine: Engine
    frontend: Frontend
    model_id: str
    max_model_len: int
    created: int = attrs.field(factory=lambda: int(time.time()))
    state: dict[str, Any] = attrs.field(factory=dict)  # adapter-owned state (e.g. the Responses store)


def new_request_id(protocol: str) -> str:
    return ("req_" if protocol == ANTHROPIC else "req-") + secrets.token_hex(12)


class ProtocolMiddleware:
    """Assigns request ids, enforces the API key and the raw body limit before any JSON is parsed."""

    def __init__(self, context: ServerContext) -> None:
        self.api_key = context.config.api_key
        self.max_body_bytes = body_limit_bytes(context.config)

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        protocol = protocol_for_path(req.path)
        req.context.protocol = protocol
        req.context.request_id = new_request_id(protocol)
        _set_request_id_header(req, resp)
        if req.method == "OPTIONS" or req.path in OPEN_PATHS:
            return
        if self.api_key is not None and not self._authorized(req):
            raise _AuthError("invalid or missing API key")
        if req.content_length is not None and req.content_length > self.max_body_bytes:
            raise RequestTooLargeError(
                f"request body of {req.content_length} bytes exceeds --max-request-mib ({self.max_body_bytes} bytes)"
            )

    def _authorized(self, req: falcon.asgi.Request) -> bool:
        presented = []
        auth = req.get_header("Authorization") or ""
        if auth[:7].lower() == "bearer ":
            presented.append(auth[7:].strip())
        if req.get_header("x-api-key"):
            presented.append(req.get_header("x-api-key").strip())
        return any(hmac.compare_digest(value.encode(), self.api_key.encode()) for value in presented)


class _AuthError(NinferError):
    status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"


def _set_request_id_header(req: Any, resp: Any) -> None:
    name = "request-id" if req.context.protocol == ANTHROPIC else "x-request-id"
    resp.set_header(name, req.context.request_id)


def _reply(req: Any, resp: Any, reply: ErrorReply) -> None:
    """Send an error body; ASCII-escaped JSON, so rendering an error can never fail on text encoding."""
    resp.status = reply.status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = json.dumps(reply.body, ensure_ascii=True).encode("ascii")
    resp.stream = None
    resp.sse = None
    for name, value in reply.headers:
        resp.set_header(name, value)


def _context_of(req: Any) -> tuple[str, str | None]:
    protocol = getattr(req.context, "protocol", None) or protocol_for_path(req.path)
    return protocol, getattr(req.context, "request_id", None)


async def _handle_ninfer_error(req: Any, resp: Any, error: NinferError, params: Any) -> None:
    protocol, request_id = _context_of(req)
    _reply(req, resp, render_ninfer_error(error, protocol, request_id))


async def _handle_http_error(req: Any, resp: Any, error: falcon.HTTPError, params: Any) -> None:
    protocol, request_id = _context_of(req)
    status = int(str(error.status).split()[0]) if not isinstance(error.status, int) else error.status
    code = {404: "not_found", 405: "method_not_allowed"}.get(status, "http_error")
    message = error.description or error.title or "request failed"
    if status == 404:
        message = f"no route for {req.method} {quoted(req.path)}"
    _reply(req, resp, render_http_error(status, message, protocol, request_id, code))


async def _handle_unexpected(req: Any, resp: Any, error: Exception, params: Any) -> None:
    """A 500: an internal invariant broke (client input never gets here). Logged once with its traceback."""
    protocol, request_id = _context_of(req)
    report_internal_error(error, request_id, f"serving {req.method} {quoted(req.path)}")
    _reply(req, resp, render_ninfer_error(internal_error(), protocol, request_id))


def build_app(context: ServerContext) -> DisconnectTracking:
    """Build the ASGI app: middleware, error handlers and every available protocol adapter's routes."""
    app = falcon.asgi.App(middleware=[ProtocolMiddleware(context)], cors_enable=bool(context.config.cors))
    app.req_options.strip_url_path_trailing_slash = True
    app.add_error_handler(Exception, _handle_unexpected)
    app.add_error_handler(falcon.HTTPError, _handle_http_error)
    app.add_error_handler(NinferError, _handle_ninfer_error)
    for adapter in context.plugins.registries.protocol_adapters.values():
        if adapter.mount is not None:
            adapter.mount(app, context)
        else:
            _mount_not_available(app, adapter)
    return DisconnectTracking(app)


class _NotAvailableResource:
    """Answers every method of a registered adapter whose implementation has not landed with a clear 501."""

    def __init__(self, adapter: Any) -> None:
        self.adapter = adapter

    async def _fail(self, req: Any, resp: Any, **_: Any) -> None:
        self.adapter.require_mount()

    on_get = on_post = on_delete = _fail


def _mount_not_available(app: falcon.asgi.App, adapter: Any) -> None:
    resource = _NotAvailableResource(adapter)
    for path in dict.fromkeys(route.path for route in adapter.routes):
        app.add_route(path, resource)
