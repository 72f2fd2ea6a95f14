"""Built-in protocol adapters. An adapter whose ``mount`` is None answers 501 "not yet available"."""

from __future__ import annotations

from typing import Any

from ninfer.core.descriptors import ProtocolAdapter, Route
from ninfer.core.hookspecs import hookimpl
from ninfer.server.routes import mount_health, mount_models


def _mount_openai_chat(app: Any, context: Any) -> None:
    from ninfer.protocols.openai_chat.adapter import mount_openai_chat  # lazily: it pulls in the engine (torch)

    mount_openai_chat(app, context)


def _mount_openai_responses(app: Any, context: Any) -> None:
    from ninfer.protocols.openai_responses.adapter import mount_openai_responses  # lazily, like Chat (engine imports)

    mount_openai_responses(app, context)


def _mount_anthropic_messages(app: Any, context: Any) -> None:
    from ninfer.protocols.anthropic.adapter import mount_anthropic_messages  # lazily, like openai_chat

    mount_anthropic_messages(app, context)


@hookimpl
def ninfer_protocol_adapters() -> list[ProtocolAdapter]:
    return [
        ProtocolAdapter("health", (Route("GET", "/health"), Route("GET", "/"), Route("HEAD", "/"),
                                   Route("GET", "/api/hello"), Route("HEAD", "/api/hello")),
                        "engine readiness and the server's identity", mount=mount_health),
        ProtocolAdapter(
            "models", (Route("GET", "/v1/models"), Route("GET", "/v1/models/{model_id}")), "OpenAI model listing", mount=mount_models
        ),
        ProtocolAdapter(
            "openai_chat", (Route("POST", "/v1/chat/completions"),), "OpenAI Chat Completions", mount=_mount_openai_chat
        ),
        ProtocolAdapter(
            "openai_responses",
            (
                Route("POST", "/v1/responses"),
                Route("POST", "/v1/responses/input_tokens"),
                Route("GET", "/v1/responses/{response_id}"),
                Route("DELETE", "/v1/responses/{response_id}"),
                Route("GET", "/v1/responses/{response_id}/input_items"),
                Route("POST", "/v1/responses/{response_id}/cancel"),
                Route("POST", "/v1/responses/compact"),
            ),
            "OpenAI Responses Core",
            mount=_mount_openai_responses,
        ),
        ProtocolAdapter(
            "anthropic_messages",
            (Route("POST", "/v1/messages"), Route("POST", "/v1/messages/count_tokens")),
            "Anthropic Messages",
            mount=_mount_anthropic_messages,
        ),
    ]
