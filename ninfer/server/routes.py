"""``GET /health``, ``GET|HEAD /`` and ``/api/hello`` (the server's identity), ``GET /v1/models`` and
``GET /v1/models/{id}``.

``/`` and ``/api/hello`` answer without authentication, like ``/health``: agent clients probe them for connectivity
before their first request. They name the server and its readiness only (no model, no configuration).
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import falcon

from ninfer.core.errors import NinferError, quoted


class ModelNotFoundError(NinferError):
    status = 404
    error_type = "invalid_request_error"
    code = "model_not_found"


def engine_healthy(context: Any) -> bool:
    return context.engine is not None and context.engine.healthy


class HealthResource:
    def __init__(self, context: Any) -> None:
        self.context = context

    async def on_get(self, req: Any, resp: Any) -> None:
        healthy = engine_healthy(self.context)
        resp.status = falcon.HTTP_200 if healthy else falcon.HTTP_503
        resp.media = {"status": "ok" if healthy else "unavailable"}


#: Paths agent clients probe for connectivity without a key (Claude Code sends ``HEAD /api/hello``).
PROBE_PATHS = ("/", "/api/hello")


class RootResource:
    def __init__(self, context: Any) -> None:
        self.context = context

    async def on_get(self, req: Any, resp: Any) -> None:
        resp.media = {"object": "server", "name": "ninfer", "version": version("ninfer"),
                      "status": "ok" if engine_healthy(self.context) else "unavailable"}

    async def on_head(self, req: Any, resp: Any) -> None:
        await self.on_get(req, resp)


def model_card(context: Any) -> dict[str, Any]:
    return {
        "id": context.model_id,
        "object": "model",
        "created": context.created,
        "owned_by": "ninfer",
        "max_model_len": context.max_model_len,
    }


class ModelsResource:
    def __init__(self, context: Any) -> None:
        self.context = context

    async def on_get(self, req: Any, resp: Any) -> None:
        resp.media = {"object": "list", "data": [model_card(self.context)]}

    async def on_get_one(self, req: Any, resp: Any, model_id: str) -> None:
        if model_id != self.context.model_id:
            raise ModelNotFoundError(f"model {quoted(model_id)} does not exist; this server serves "
                                     f"{quoted(self.context.model_id)}", param="model")
        resp.media = model_card(self.context)


def mount_health(app: Any, context: Any) -> None:
    app.add_route("/health", HealthResource(context))
    root = RootResource(context)
    for path in PROBE_PATHS:
        app.add_route(path, root)


def mount_models(app: Any, context: Any) -> None:
    resource = ModelsResource(context)
    app.add_route("/v1/models", resource)
    app.add_route("/v1/models/{model_id}", resource, suffix="one")
