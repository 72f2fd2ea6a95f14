"""Built-in protocol adapters. Their routes are mounted by the HTTP server once it lands."""

from __future__ import annotations

from ninfer.core.descriptors import ProtocolAdapter, Route
from ninfer.core.hookspecs import hookimpl
from ninfer.protocols.models import mount_health, mount_models


@hookimpl
def ninfer_protocol_adapters() -> list[ProtocolAdapter]:
    return [
        ProtocolAdapter("health", (Route("GET", "/health"),), "engine readiness", mount=mount_health),
        ProtocolAdapter(
            "models", (Route("GET", "/v1/models"), Route("GET", "/v1/models/{model_id}")), "OpenAI model listing", mount=mount_models
        ),
        ProtocolAdapter("openai_chat", (Route("POST", "/v1/chat/completions"),), "OpenAI Chat Completions"),
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
        ),
        ProtocolAdapter(
            "anthropic_messages",
            (Route("POST", "/v1/messages"), Route("POST", "/v1/messages/count_tokens")),
            "Anthropic Messages",
        ),
    ]
