"""Chat Completions request parsing: wire JSON -> :class:`Conversation` + :class:`GenerationOptions` + chat options.

Every field the spec accepts is validated with a field-specific 400 (``param`` names the exact field path; messages
and tools are parsed by :mod:`ninfer.protocols.openai_chat.messages`). Options whose behaviour the engine cannot
provide are rejected with ``unsupported_parameter`` and a message naming the guarantee; semantically neutral values
are accepted; unknown top-level fields are ignored. Thinking/effort *support* is resolved later by the model
frontend against the loaded template.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import attrs

from ninfer.core.conversation import Conversation, GenerationOptions
from ninfer.core.errors import InvalidRequestError
from ninfer.protocols.fields import (
    INVALID_VALUE,
    malformed,
    member_path,
    optional_bool,
    optional_int,
    optional_number,
    optional_object,
    optional_str,
    quoted,
    type_name,
    type_tag,
    unsupported,
)
from ninfer.protocols.openai_chat.messages import (
    MessageParser,
    check_legacy_tool_controls,
    parse_tool_choice,
    parse_tools,
)
from ninfer.server.routes import ModelNotFoundError

CONFLICT = "conflicting_template_option"
MAX_STOP_STRINGS = 4
TOP_K_MAX = 20
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
CONSTRAINED_DECODING_ALIASES = (
    "grammar",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
TEMPLATE_KWARGS = ("enable_thinking", "preserve_thinking")
CACHE_RETENTIONS = ("in_memory", "in-memory", "24h")
CACHE_MODES = ("implicit", "explicit")
NO_CONSTRAINED_DECODING = "ninfer does not constrain decoding to a grammar, schema or choice list"


@attrs.frozen
class ChatRequest:
    """A validated Chat Completions request."""

    conversation: Conversation
    options: GenerationOptions
    stream: bool = False
    include_usage: bool = False
    timings_per_token: bool = False
    return_progress: bool = False


# -- model -----------------------------------------------------------------------------------------


def _check_served(model: str, model_id: str) -> None:
    if model != model_id:
        raise ModelNotFoundError(f"the model {quoted(model)} does not exist; this server serves {quoted(model_id)}",
                                 param="model")


def check_model(body: Mapping[str, Any], model_id: str) -> None:
    """Responses: ``model`` must be a non-empty string equal to the public model id (no fallback)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        shown = "missing" if model is None else f"{type_name(model)} {quoted(model)}"
        raise InvalidRequestError(
            f"model: a non-empty model name is required (got {shown}); this server serves {quoted(model_id)}",
            param="model",
            code="missing_required_parameter" if model is None else INVALID_VALUE,
        )
    _check_served(model, model_id)


def check_chat_model(body: Mapping[str, Any], model_id: str) -> None:
    """Chat Completions serve the loaded model when ``model`` is omitted or is not a non-empty string (the
    llama.cpp behaviour the reference contract adopts); a non-empty name must be the public model id."""
    model = body.get("model")
    if isinstance(model, str) and model:
        _check_served(model, model_id)


# -- sampling and limits ---------------------------------------------------------------------------


def parse_stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    values = [stop] if isinstance(stop, str) else stop
    if not isinstance(values, list):
        raise malformed("stop", f"expected a string or an array of strings, got {type_name(stop)}")
    if len(values) > MAX_STOP_STRINGS:
        raise malformed("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(values)}")
    for value in values:
        if not isinstance(value, str) or not value:
            raise malformed("stop", f"stop strings must be non-empty strings, got {quoted(value)}")
    return tuple(values)


def parse_max_tokens(body: Mapping[str, Any]) -> int | None:
    legacy = optional_int(body, "max_tokens", 0)
    current = optional_int(body, "max_completion_tokens", 0)
    if legacy is not None and current is not None and legacy != current:
        raise malformed("max_tokens", f"max_tokens ({legacy}) and max_completion_tokens ({current}) disagree")
    return current if current is not None else legacy


def parse_generation_options(body: Mapping[str, Any]) -> GenerationOptions:
    n = optional_int(body, "n", 1)
    if n is not None and n != 1:
        raise unsupported("n", "ninfer generates exactly one choice per request (n must be 1)")
    return GenerationOptions(
        max_tokens=parse_max_tokens(body),
        temperature=optional_number(body, "temperature", 0.0, 2.0),
        top_p=optional_number(body, "top_p", 0.0, 1.0),
        top_k=optional_int(body, "top_k", 0, TOP_K_MAX),
        min_p=optional_number(body, "min_p", 0.0, 1.0),
        presence_penalty=optional_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=optional_number(body, "frequency_penalty", -2.0, 2.0),
        seed=optional_int(body, "seed", INT64_MIN, INT64_MAX),
        stop=parse_stop(body),
    )


# -- capability rejections and neutral values -------------------------------------------------------


def _check_output_controls(body: Mapping[str, Any]) -> None:
    bias = optional_object(body, "logit_bias")
    for token, value in (bias or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise malformed(member_path("logit_bias", token), f"expected a finite number, got {quoted(value)}")
        if value != 0:
            raise unsupported("logit_bias", "nonzero logit biases cannot be applied by the sampler")
    if optional_bool(body, "logprobs"):
        raise unsupported("logprobs", "log probabilities are not reported")
    top_logprobs = optional_int(body, "top_logprobs", 0)
    if top_logprobs:
        raise unsupported("top_logprobs", "log probabilities are not reported")
    response_format = optional_object(body, "response_format")
    if response_format is not None:
        kind = type_tag(response_format, "response_format")
        if kind in ("json_object", "json_schema"):
            raise unsupported("response_format", f"{kind} output needs constrained decoding; {NO_CONSTRAINED_DECODING}")
        if kind != "text":
            raise malformed("response_format.type", f"expected 'text', got {quoted(kind)}")
    for alias in CONSTRAINED_DECODING_ALIASES:
        if body.get(alias) is not None:
            raise unsupported(alias, NO_CONSTRAINED_DECODING)
    verbosity = body.get("verbosity")
    if verbosity is not None and verbosity != "medium":
        if verbosity in ("low", "high"):
            raise unsupported("verbosity", f"{quoted(verbosity)} verbosity cannot be controlled; only 'medium' is "
                                           "neutral")
        raise malformed("verbosity", f"expected 'low', 'medium' or 'high', got {quoted(verbosity)}")
    penalty = body.get("repetition_penalty")
    if penalty is not None:
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
            raise malformed("repetition_penalty", f"expected a number, got {quoted(penalty)}")
        if penalty != 1:
            raise unsupported("repetition_penalty", "only the neutral value 1 is accepted; use presence_penalty or "
                              "frequency_penalty")


def _check_modalities(body: Mapping[str, Any]) -> None:
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(item, str) for item in modalities):
            raise malformed("modalities", "expected an array of strings")
        if "audio" in modalities:
            raise unsupported("modalities", "audio output cannot be produced; only text output is supported")
        unknown = [item for item in modalities if item != "text"]
        if unknown:
            raise malformed("modalities", f"unknown output modality {quoted(unknown[0])}")
    optional_object(body, "audio")  # a text-only request's audio configuration has no effect


def _check_hosted_features(body: Mapping[str, Any]) -> None:
    if optional_bool(body, "store"):
        raise unsupported("store", "stored Chat Completions are not kept by this server")
    if body.get("web_search_options") is not None:
        raise unsupported("web_search_options", "web search needs a hosted search executor, which ninfer does not have")
    if body.get("moderation") not in (None, False):
        raise unsupported("moderation", "hosted moderation is not available")
    mm_kwargs = optional_object(body, "mm_processor_kwargs")
    if mm_kwargs and any(value is not None for value in mm_kwargs.values()):
        raise unsupported("mm_processor_kwargs", "media processor overrides cannot be applied")


def _check_advisory(body: Mapping[str, Any]) -> None:
    """Advisory fields: validated for shape, no effect on execution."""
    metadata = optional_object(body, "metadata")
    for key, value in (metadata or {}).items():
        if not isinstance(value, str):
            raise malformed(member_path("metadata", key), f"expected a string, got {type_name(value)}")
    for key in ("user", "safety_identifier", "service_tier", "prompt_cache_key"):
        optional_str(body, key)
    retention = body.get("prompt_cache_retention")
    if retention is not None and retention not in CACHE_RETENTIONS:
        raise malformed("prompt_cache_retention", f"expected 'in_memory' or '24h', got {quoted(retention)}")
    options = optional_object(body, "prompt_cache_options")
    if options is not None and options.get("mode") is not None and options["mode"] not in CACHE_MODES:
        raise malformed("prompt_cache_options.mode", f"expected 'implicit' or 'explicit', got "
                                                     f"{quoted(options['mode'])}")
    prediction = body.get("prediction")
    if prediction is not None and not isinstance(prediction, dict):
        raise malformed("prediction", f"expected an object, got {type_name(prediction)}")


# -- thinking options ------------------------------------------------------------------------------


def _template_option(body: Mapping[str, Any], kwargs: Mapping[str, Any], key: str) -> bool | None:
    top = optional_bool(body, key)
    nested = optional_bool(kwargs, key, f"chat_template_kwargs.{key}")
    if top is not None and nested is not None and top != nested:
        raise InvalidRequestError(
            f"{key} is {str(top).lower()} but chat_template_kwargs.{key} is {str(nested).lower()}; the two "
            "spellings must agree",
            param=f"chat_template_kwargs.{key}",
            code=CONFLICT,
        )
    return top if top is not None else nested


def parse_thinking(body: Mapping[str, Any]) -> dict[str, Any]:
    """``enable_thinking``, ``preserve_thinking`` and ``reasoning_effort`` for the Conversation."""
    kwargs = optional_object(body, "chat_template_kwargs") or {}
    for key, value in kwargs.items():
        if key not in TEMPLATE_KWARGS and value is not None:
            raise unsupported(
                member_path("chat_template_kwargs", key),
                "only enable_thinking and preserve_thinking may be passed to the chat template; other template "
                "variables would silently change prompt semantics",
            )
    effort = optional_str(body, "reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise malformed("reasoning_effort", f"expected one of {', '.join(REASONING_EFFORTS)}, got {quoted(effort)}")
    return {
        "enable_thinking": _template_option(body, kwargs, "enable_thinking"),
        "preserve_thinking": _template_option(body, kwargs, "preserve_thinking"),
        "reasoning_effort": effort,
    }


# -- the request -----------------------------------------------------------------------------------


def _stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = bool(optional_bool(body, "stream"))
    options = optional_object(body, "stream_options") or {}
    include_usage = optional_bool(options, "include_usage", "stream_options.include_usage")
    optional_bool(options, "include_obfuscation", "stream_options.include_obfuscation")
    return stream, bool(include_usage) and stream


def parse_chat_request(body: Mapping[str, Any], *, model_id: str, vision: bool) -> ChatRequest:
    """Validate a Chat Completions body; raises a field-specific :class:`InvalidRequestError` (or 404 model)."""
    check_chat_model(body, model_id)
    messages = MessageParser(vision).parse(body.get("messages"))
    tools = parse_tools(body)
    tool_choice, allowed = parse_tool_choice(body, tools)
    check_legacy_tool_controls(body)
    conversation = Conversation(
        messages=messages, tools=tools, tool_choice=tool_choice, allowed_tools=allowed, **parse_thinking(body)
    )
    parallel = optional_bool(body, "parallel_tool_calls")
    if parallel is False and conversation.callable_tools:
        raise unsupported(
            "parallel_tool_calls",
            "limiting the model to one call per turn needs constrained decoding; send true or disable tools",
        )
    options = parse_generation_options(body)
    _check_output_controls(body)
    _check_modalities(body)
    _check_hosted_features(body)
    _check_advisory(body)
    stream, include_usage = _stream_options(body)
    return ChatRequest(
        conversation=conversation,
        options=options,
        stream=stream,
        include_usage=include_usage,
        timings_per_token=bool(optional_bool(body, "timings_per_token")) and stream,
        return_progress=bool(optional_bool(body, "return_progress")) and stream,
    )
