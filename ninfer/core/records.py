"""Content-free records passed to lifecycle hooks (never prompts, generated text or credentials)."""

from __future__ import annotations

import attrs


@attrs.frozen
class RequestRecord:
    """What ``ninfer_request_finished`` receives after a generation request reaches its terminal outcome."""

    protocol: str  # "openai_chat" | "openai_responses" | "anthropic_messages" | "offline"
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    total_seconds: float
    ttft_seconds: float | None = None
