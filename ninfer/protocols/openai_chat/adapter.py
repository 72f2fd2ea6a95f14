"""``POST /v1/chat/completions``: the OpenAI Chat Completions resource and its JSON / SSE rendering."""

from __future__ import annotations

import secrets
import time
from typing import Any, AsyncIterator

import falcon

from ninfer.core.errors import NinferError
from ninfer.core.frontend import ContentDelta, OutputEvent, ReasoningDelta, ToolCallArgumentsDelta, ToolCallStarted
from ninfer.protocols.openai_chat.request import ChatRequest, parse_chat_request
from ninfer.server.errors import OPENAI, render_ninfer_error
from ninfer.server.generation import (
    Generation,
    GenerationJob,
    GenerationResult,
    OutputUpdate,
    PromptProgress,
    cancel_on_disconnect,
    cancelled_error,
    respond_with_stream,
)
from ninfer.server.http import json_bytes, read_json_object, sse_frame

PROTOCOL = "openai_chat"
DONE_FRAME = b"data: [DONE]\n\n"


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def chat_finish_reason(result: GenerationResult) -> str:
    """``length`` for output/context limits; ``tool_calls`` when structured calls were produced; else ``stop``."""
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if result.tool_calls else "stop"


def usage_object(result: GenerationResult) -> dict[str, Any]:
    outcome = result.outcome
    return {
        "prompt_tokens": outcome.prompt_tokens,
        "completion_tokens": outcome.completion_tokens,
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
    }


def tool_call_object(call: Any) -> dict[str, Any]:
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}


def completion_object(result: GenerationResult, *, completion: str, created: int, model: str) -> dict[str, Any]:
    """The aggregate ``chat.completion`` object (with the llama.cpp ``timings`` extension)."""
    calls = [tool_call_object(call) for call in result.tool_calls]
    message = {
        "role": "assistant",
        "content": None if calls and not result.content else result.content,
        "reasoning_content": result.reasoning or None,
        "tool_calls": calls,
        "refusal": None,
    }
    return {
        "id": completion,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": chat_finish_reason(result)}],
        "usage": usage_object(result),
        "timings": result.outcome.timings.timings_dict(),
    }


class ChunkRenderer:
    """Builds ``chat.completion.chunk`` objects for one streamed completion."""

    def __init__(self, request: ChatRequest, *, completion: str, created: int, model: str) -> None:
        self.request = request
        self.base = {"id": completion, "object": "chat.completion.chunk", "created": created, "model": model,
                     "system_fingerprint": None}
        self._arguments_sent: dict[int, str] = {}

    def chunk(self, delta: dict[str, Any] | None, finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        chunk = {**self.base, "choices": choices}
        if self.request.include_usage:
            chunk["usage"] = None
        chunk.update(extra)
        return chunk

    def role(self) -> dict[str, Any]:
        return self.chunk({"role": "assistant", "content": ""})

    def progress(self, update: PromptProgress) -> dict[str, Any]:
        return self.chunk(None, prompt_progress=update.event.to_dict())

    def deltas(self, update: OutputUpdate) -> list[dict[str, Any]]:
        """One chunk per run of same-channel text and one per tool-call step, in event order."""
        chunks: list[dict[str, Any]] = []
        run_key: str | None = None
        run_text: list[str] = []

        def flush_run() -> None:
            nonlocal run_key
            if run_key is not None and run_text:
                extra = {"timings": update.timings.timings_dict()} if self.request.timings_per_token else {}
                chunks.append(self.chunk({run_key: "".join(run_text)}, **extra))
            run_key = None
            run_text.clear()

        for event in update.events:
            key = _text_key(event)
            if key is not None:
                if key != run_key:
                    flush_run()
                    run_key = key
                run_text.append(event.text)  # type: ignore[union-attr]
                continue
            flush_run()
            tool_delta = self._tool_delta(event)
            if tool_delta is not None:
                chunks.append(self.chunk({"tool_calls": [tool_delta]}))
        flush_run()
        return chunks

    def _tool_delta(self, event: OutputEvent) -> dict[str, Any] | None:
        if isinstance(event, ToolCallStarted):
            self._arguments_sent[event.index] = ""
            return {"index": event.index, "id": event.call_id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
        if isinstance(event, ToolCallArgumentsDelta):
            self._arguments_sent[event.index] = self._arguments_sent.get(event.index, "") + event.text
            return {"index": event.index, "function": {"arguments": event.text}}
        return None

    def missing_arguments(self, result: GenerationResult) -> list[dict[str, Any]]:
        """Argument text of the final calls not yet streamed (the decoder's deltas normally cover it all)."""
        chunks = []
        for call in result.tool_calls:
            sent = self._arguments_sent.get(call.index, "")
            if call.arguments_json != sent and call.arguments_json.startswith(sent):
                rest = call.arguments_json[len(sent):]
                chunks.append(self.chunk({"tool_calls": [{"index": call.index, "function": {"arguments": rest}}]}))
        return chunks

    def finish(self, result: GenerationResult) -> list[dict[str, Any]]:
        """The finish-reason chunk, the optional usage chunk; ``timings`` rides on the last one."""
        chunks = [self.chunk({}, chat_finish_reason(result))]
        if self.request.include_usage:
            chunks.append(self.chunk(None, usage=usage_object(result)))
        chunks[-1]["timings"] = result.outcome.timings.timings_dict()
        return chunks


def _text_key(event: OutputEvent) -> str | None:
    if isinstance(event, ReasoningDelta):
        return "reasoning_content"
    if isinstance(event, ContentDelta):
        return "content"
    return None


def error_frame(error: NinferError, request_id: str) -> bytes:
    """A stream's terminal error: one data frame holding the OpenAI error body (no ``[DONE]`` follows)."""
    return sse_frame(render_ninfer_error(error, OPENAI, request_id).body)


async def chat_frames(generation: Generation, renderer: ChunkRenderer) -> AsyncIterator[bytes]:
    """The encoded SSE frames of a streamed completion."""
    yield sse_frame(renderer.role())
    try:
        async for update in generation.updates():
            if isinstance(update, PromptProgress):
                if renderer.request.return_progress:
                    yield sse_frame(renderer.progress(update))
                continue
            for chunk in renderer.deltas(update):
                yield sse_frame(chunk)
    except NinferError as error:
        yield error_frame(error, generation.request_id)
        return
    result = generation.result
    assert result is not None
    if result.finish_reason == "cancelled":  # the client is gone, or the server is stopping: say so if anyone listens
        yield error_frame(cancelled_error(generation), generation.request_id)
        return
    for chunk in (*renderer.missing_arguments(result), *renderer.finish(result)):
        yield sse_frame(chunk)
    yield DONE_FRAME


class ChatCompletionsResource:
    def __init__(self, context: Any) -> None:
        self.context = context

    async def on_post(self, req: Any, resp: Any) -> None:
        body = await read_json_object(req, self.context.config)
        request = parse_chat_request(body, model_id=self.context.model_id, vision=bool(self.context.config.vision))
        job = GenerationJob(
            PROTOCOL, request.conversation, request.options, report_progress=request.return_progress,
            stream=request.stream,
        )
        generation = Generation(self.context, job, req.context.request_id)
        created, completion, model = int(time.time()), completion_id(), self.context.model_id
        if request.stream:
            await self._stream(req, resp, generation, ChunkRenderer(request, completion=completion, created=created, model=model))
            return
        try:
            async with cancel_on_disconnect(req, generation):
                await generation.start()
                result = await generation.run()
        finally:
            generation.close()
        if result.finish_reason == "cancelled":
            raise cancelled_error(generation)
        resp.status = falcon.HTTP_200
        resp.content_type = falcon.MEDIA_JSON
        resp.data = json_bytes(completion_object(result, completion=completion, created=created, model=model))

    async def _stream(self, req: Any, resp: Any, generation: Generation, renderer: ChunkRenderer) -> None:
        async def begin() -> None:
            await generation.start()
            await generation.admitted()

        await respond_with_stream(req, resp, generation, begin, chat_frames(generation, renderer),
                                  lambda error: error_frame(error, generation.request_id))


def mount_openai_chat(app: Any, context: Any) -> None:
    app.add_route("/v1/chat/completions", ChatCompletionsResource(context))
