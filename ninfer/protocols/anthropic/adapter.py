"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages resources, aggregate and SSE.

Both the aggregate and the stream are built by one :class:`BlockAssembler` from the frontend's output events, so
the streamed blocks always reassemble into the aggregate content. A stream commits (``message_start``, whose usage
split is exact) only after admission, so admission failures (529 overload, 504 queue timeout) stay HTTP errors.
Thinking blocks carry an opaque compatibility signature derived from their text; ``signature_delta`` precedes
their ``content_block_stop``. A block only ever receives deltas of its own kind. A request's ``context_management``
edits (:mod:`ninfer.protocols.anthropic.context`) are applied before generation and reported on the message and the
final ``message_delta``; count_tokens counts the edited prompt and reports the original count.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any, AsyncIterator, Callable

import falcon

from ninfer.core.conversation import Conversation
from ninfer.core.errors import NinferError, NotYetAvailableError
from ninfer.core.frontend import (
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from ninfer.protocols.anthropic.context import EditedConversation, apply_context_management
from ninfer.protocols.anthropic.request import MessagesRequest, RequestSettings, parse_messages_request
from ninfer.protocols.reasoning_codec import encode_reasoning
from ninfer.server.errors import ANTHROPIC, render_ninfer_error
from ninfer.server.generation import (
    Generation,
    GenerationJob,
    GenerationResult,
    OutputUpdate,
    cancel_on_disconnect,
    cancelled_error,
    respond_with_stream,
)
from ninfer.server.http import json_bytes, read_json_object, sse_frame

PROTOCOL = "anthropic_messages"
Event = tuple[str, dict[str, Any]]  # (SSE event name, JSON payload whose "type" is that name)


def message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id(call_id: str) -> str:
    """Anthropic-style ``toolu_`` id for a decoder call id."""
    return "toolu_" + call_id.removeprefix("call_")


def thinking_signature(thinking: str) -> str:
    """The signature of a thinking block: the reasoning codec's encoding of its text, so a block replayed with
    empty ``thinking`` (``display: "omitted"``) restores it. Not secret; a visible text always wins on replay."""
    return encode_reasoning(thinking)


def usage_object(prompt_tokens: int, cached_tokens: int, output_tokens: int, thinking_tokens: int) -> dict[str, Any]:
    """Anthropic usage: ``input_tokens`` is the uncached part; cache creation is unknown (null)."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": None,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
        "output_tokens_details": {"thinking_tokens": thinking_tokens},
    }


def stop_fields(result: GenerationResult, max_tokens: int) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)``: a custom stop string, the output limit, the context window, tool use or
    the end of the turn. ``max_tokens`` is the request's effective output limit."""
    outcome = result.outcome
    if outcome.finish_reason == "length":
        if outcome.completion_tokens < max_tokens:
            return "model_context_window_exceeded", None
        return "max_tokens", None
    if outcome.stop is not None and outcome.stop.string is not None:
        return "stop_sequence", outcome.stop.string
    return ("tool_use" if result.tool_calls else "end_turn"), None


class BlockAssembler:
    """Turns output events into Anthropic content blocks and their SSE lifecycle events; with ``omit_thinking``
    thinking blocks stay empty (no thinking deltas) and only their signature carries the reasoning."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.omit_thinking = omit_thinking
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # type of the open block (the last one), if any
        self._tool_index: dict[int, int] = {}  # decoder call index -> block index
        self._json: dict[int, list[str]] = {}

    def feed(self, events: tuple[OutputEvent, ...] | list[OutputEvent]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ReasoningDelta) and event.text:
                self._ensure("thinking", out)
                self.blocks[-1]["thinking"] += event.text
                if not self.omit_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
            elif isinstance(event, ContentDelta) and event.text:
                self._ensure("text", out)
                self.blocks[-1]["text"] += event.text
                out.append(self._delta({"type": "text_delta", "text": event.text}))
            elif isinstance(event, ToolCallStarted):
                self._close(out)
                self.blocks.append({"type": "tool_use", "id": tool_use_id(event.call_id), "name": event.name,
                                    "input": {}})
                self._open = "tool_use"
                self._tool_index[event.index] = len(self.blocks) - 1
                self._json[event.index] = []
                out.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                    "content_block": dict(self.blocks[-1])}))
            elif isinstance(event, ToolCallArgumentsDelta) and event.text:
                self._json[event.index].append(event.text)
                out.append(("content_block_delta", {"type": "content_block_delta",
                                                    "index": self._tool_index[event.index],
                                                    "delta": {"type": "input_json_delta", "partial_json": event.text}}))
            elif isinstance(event, ToolCallFinished):
                out.extend(self._finish_call(event))
        return out

    def _finish_call(self, event: ToolCallFinished) -> list[Event]:
        """Send any argument text the deltas did not cover, then record the final input object."""
        out: list[Event] = []
        sent = "".join(self._json[event.index])
        index = self._tool_index[event.index]
        if event.arguments_json != sent:
            if not event.arguments_json.startswith(sent):
                raise AssertionError("a tool call's final arguments do not extend its streamed argument text")
            rest = event.arguments_json[len(sent):]
            self._json[event.index].append(rest)
            out.append(("content_block_delta", {"type": "content_block_delta", "index": index,
                                                "delta": {"type": "input_json_delta", "partial_json": rest}}))
        self.blocks[index]["input"] = json.loads(event.arguments_json) if event.arguments_json else {}
        return out

    def close(self) -> list[Event]:
        """Close the open block (at the end of the output)."""
        out: list[Event] = []
        self._close(out)
        return out

    def _ensure(self, kind: str, out: list[Event]) -> None:
        if self._open == kind:
            return
        self._close(out)
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text",
                                                                                                  "text": ""}
        self.blocks.append(block)
        self._open = kind
        out.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                            "content_block": dict(block)}))

    def _delta(self, delta: dict[str, Any]) -> Event:
        return "content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self, out: list[Event]) -> None:
        if self._open is None:
            return
        index = len(self.blocks) - 1
        block = self.blocks[index]
        if self._open == "thinking":
            block["signature"] = thinking_signature(block["thinking"])
            if self.omit_thinking:
                block["thinking"] = ""
            out.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        self._open = None
        out.append(("content_block_stop", {"type": "content_block_stop", "index": index}))


class MessageRenderer:
    """The message object of one response and its start / delta / stop events."""

    def __init__(self, request: MessagesRequest, max_tokens: int, edited: EditedConversation | None = None) -> None:
        self.request = request
        self.max_tokens = max_tokens
        self.context_management = None if edited is None else edited.response_field()
        self.id = message_id()
        self.assembler = BlockAssembler(request.omit_thinking)

    def _shell(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.request.model}

    def start(self, prompt_tokens: int, cached_tokens: int) -> list[Event]:
        message = {**self._shell(), "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage_object(prompt_tokens, cached_tokens, 0, 0)}
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def usage(self, result: GenerationResult) -> dict[str, Any]:
        outcome = result.outcome
        return usage_object(outcome.prompt_tokens, outcome.cached_tokens, outcome.completion_tokens,
                            result.reasoning_tokens)

    def _edits(self) -> dict[str, Any]:
        return {} if self.context_management is None else {"context_management": self.context_management}

    def finish(self, result: GenerationResult) -> list[Event]:
        stop_reason, stop_sequence = stop_fields(result, self.max_tokens)
        return [*self.assembler.close(),
                ("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   "usage": self.usage(result), **self._edits()}),
                ("message_stop", {"type": "message_stop"})]

    def message(self, result: GenerationResult) -> dict[str, Any]:
        """The aggregate message (the assembler must have seen every output event)."""
        self.assembler.close()
        stop_reason, stop_sequence = stop_fields(result, self.max_tokens)
        return {**self._shell(), "content": self.assembler.blocks, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": self.usage(result), **self._edits()}


def _frame(event: Event) -> bytes:
    return sse_frame(event[1], event=event[0])


def error_frame(error: NinferError, request_id: str) -> bytes:
    """A stream's terminal error: an ``event: error`` frame holding the Anthropic error body."""
    return sse_frame(render_ninfer_error(error, ANTHROPIC, request_id).body, event="error")


async def message_frames(generation: Generation, renderer: MessageRenderer) -> AsyncIterator[bytes]:
    """The encoded SSE frames of a streamed message."""
    admission = generation.admission
    assert admission is not None
    for event in renderer.start(admission.prompt_tokens, admission.cached_tokens):
        yield _frame(event)
    try:
        async for update in generation.updates():
            if isinstance(update, OutputUpdate):
                for event in renderer.assembler.feed(update.events):
                    yield _frame(event)
    except NinferError as error:
        yield error_frame(error, generation.request_id)
        return
    result = generation.result
    assert result is not None
    if result.finish_reason == "cancelled":  # client gone or server stopping: say so if anyone listens
        yield error_frame(cancelled_error(generation), generation.request_id)
        return
    for event in renderer.finish(result):
        yield _frame(event)


def token_counter(context: Any) -> Callable[[Conversation], int]:
    count = getattr(context.frontend, "count_tokens", None)
    if count is None:
        raise NotYetAvailableError("token counting is not yet available for this model family's frontend")
    return count


async def edit_context(context: Any, request: MessagesRequest) -> EditedConversation | None:
    """The request's ``context_management`` edits applied (None when it sent none); counts in a worker thread."""
    if request.context_management is None:
        return None
    return await asyncio.to_thread(apply_context_management, request.conversation, request.context_management,
                                   token_counter(context))


def request_settings(context: Any) -> RequestSettings:
    config = context.config
    return RequestSettings(vision=bool(config.vision), default_max_tokens=config.default_max_tokens,
                           default_thinking=not config.no_thinking)


class MessagesResource:
    def __init__(self, context: Any) -> None:
        self.context = context

    async def on_post(self, req: Any, resp: Any) -> None:
        body = await read_json_object(req, self.context.config, dotted=True)
        request = parse_messages_request(body, request_settings(self.context))
        max_tokens = self.context.config.request_policy.max_tokens(request.options.max_tokens)
        edited = await edit_context(self.context, request)
        conversation = request.conversation if edited is None else edited.conversation
        job = GenerationJob(PROTOCOL, conversation, request.options, stream=request.stream)
        generation = Generation(self.context, job, req.context.request_id)
        renderer = MessageRenderer(request, max_tokens, edited)
        if request.stream:
            await self._stream(req, resp, generation, renderer)
            return
        try:
            async with cancel_on_disconnect(req, generation):
                await generation.start()
                async for update in generation.updates():
                    if isinstance(update, OutputUpdate):
                        renderer.assembler.feed(update.events)
        finally:
            generation.close()
        result = generation.result
        assert result is not None
        if result.finish_reason == "cancelled":
            raise cancelled_error(generation)
        resp.status = falcon.HTTP_200
        resp.content_type = falcon.MEDIA_JSON
        resp.data = json_bytes(renderer.message(result))

    async def _stream(self, req: Any, resp: Any, generation: Generation, renderer: MessageRenderer) -> None:
        async def begin() -> None:
            await generation.start()
            await generation.admitted()

        await respond_with_stream(req, resp, generation, begin, message_frames(generation, renderer),
                                  lambda error: error_frame(error, generation.request_id))


class CountTokensResource:
    """Prompt tokens of a Messages request through the same normalization, without generation."""

    def __init__(self, context: Any) -> None:
        self.context = context

    async def on_post(self, req: Any, resp: Any) -> None:
        body = await read_json_object(req, self.context.config, dotted=True)
        request = parse_messages_request(body, request_settings(self.context), count_only=True)
        count = token_counter(self.context)
        edited = await edit_context(self.context, request)
        if edited is None:
            payload: dict[str, Any] = {"input_tokens": await asyncio.to_thread(count, request.conversation)}
        else:
            tokens = edited.tokens
            if tokens is None:  # no edit needed a count, so none cleared anything
                tokens = await asyncio.to_thread(count, edited.conversation)
            original = edited.original_tokens if edited.original_tokens is not None else tokens
            payload = {"input_tokens": tokens, "context_management": {"original_input_tokens": original}}
        resp.status = falcon.HTTP_200
        resp.content_type = falcon.MEDIA_JSON
        resp.data = json_bytes(payload)


def mount_anthropic_messages(app: Any, context: Any) -> None:
    app.add_route("/v1/messages", MessagesResource(context))
    app.add_route("/v1/messages/count_tokens", CountTokensResource(context))
