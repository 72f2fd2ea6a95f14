"""OpenAI Responses Core: ``/v1/responses`` resources, typed output Items, semantic SSE and the local store.

One :class:`OutputBuilder` turns the frontend's decoder events into output Items (reasoning with raw
``reasoning_text``, an assistant message with ``output_text``, ``function_call`` Items) and, at the same time, into
the semantic events that build them, so an aggregate body and a stream of the same generation always agree: the
concatenated deltas equal the terminal Items. Terminal Responses are kept in the bounded local store (unless
``store`` is false) together with their conversation context for ``previous_response_id``.

Engine-local reuse: a stored root Response gets an Engine session key derived from its id, and every
``previous_response_id`` child inherits it from the stored parent, so the chain's latest finished turn is the
session's endpoint checkpoint, kept under cache pressure ahead of anonymous checkpoints. A store:false root has no
session; a store:false child reads the chain's checkpoints but may not replace its endpoint. The key stays
internal: it never appears in an HTTP body or stream.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import secrets
import time
from typing import Any, AsyncIterator, Mapping

import falcon

from ninfer.core.errors import InvalidRequestError, NinferError, NotYetAvailableError
from ninfer.core.frontend import (
    ContentDelta,
    OutputEvent,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from ninfer.core.request import SessionKey
from ninfer.observability import oplog
from ninfer.protocols.fields import malformed, quoted, unsupported
from ninfer.protocols.openai_responses.request import (
    ParentContext,
    ResponsesRequest,
    parse_include,
    parse_responses_request,
)
from ninfer.protocols.openai_responses.store import ContextSegment, ResponseStore, StoredResponse, items_size
from ninfer.protocols.openai_responses.tools import FREEFORM_PARAMETER
from ninfer.protocols.reasoning_codec import encode_reasoning
from ninfer.server.generation import (
    Generation,
    GenerationJob,
    GenerationResult,
    OutputUpdate,
    cancel_on_disconnect,
    cancelled_error,
    respond_with_stream,
)
from ninfer.server.http import MIB, json_bytes, read_json_object, sse_frame

PROTOCOL = "openai_responses"
STORE_KEY = "responses.store"
WARNED_HOSTED_KEY = "responses.warned_hosted_tools"

INPUT_ITEMS_DEFAULT_LIMIT, INPUT_ITEMS_MAX_LIMIT = 20, 100
#: Frontend error params renamed to the Responses field that carries the same value.
_PARAM_ALIASES = {"messages": "input", "reasoning_effort": "reasoning.effort", "enable_thinking": "reasoning.effort",
                  "max_tokens": "max_output_tokens"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def root_session_key(response_id: str) -> str:
    """The Engine session key of a stored root Response: a 16-byte BLAKE2b digest of its id, in hex."""
    return hashlib.blake2b(response_id.encode("utf-8"), digest_size=16).hexdigest()


def chain_session(request: ResponsesRequest, response_id: str, parent: StoredResponse | None) -> SessionKey | None:
    """The Engine session of a Create: a stored root starts one, a child inherits its parent's (read-only when
    the child is store:false), a store:false root stays anonymous."""
    if parent is None:
        return SessionKey(root_session_key(response_id)) if request.store else None
    if parent.session_key is None:
        return None
    return SessionKey(parent.session_key, may_replace_endpoint=request.store)


def response_status(result: GenerationResult) -> str:
    """``completed`` for model/string stops, ``incomplete`` for output or context exhaustion, else ``cancelled``."""
    return {"stop": "completed", "length": "incomplete"}.get(result.finish_reason, "cancelled")


def usage_object(result: GenerationResult) -> dict[str, Any]:
    outcome = result.outcome
    return {
        "input_tokens": outcome.prompt_tokens,
        "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
        "output_tokens": outcome.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
        "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
    }


def response_object(request: ResponsesRequest, *, response_id: str, created_at: int, model: str, status: str,
                    output: list[Mapping[str, Any]], usage: Mapping[str, Any] | None = None,
                    error: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The wire ``response`` object; request settings are echoed, ``max_output_tokens`` stays null when omitted."""
    body = request.body
    reasoning = body.get("reasoning") or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": request.instructions,
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": body.get("metadata") or {},
        "model": model,
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "previous_response_id": request.previous_response_id,
        "prompt_cache_key": body.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": None},
        "safety_identifier": body.get("safety_identifier"),
        "service_tier": "default",
        "store": request.store,
        "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_logprobs": body.get("top_logprobs") or 0,
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "user": body.get("user"),
        "ignored_tools": list(request.conversation.ignored_tools),
    }


# -- output Items and their events ---------------------------------------------------------------------------------


class OutputBuilder:
    """Builds output Items from decoder events and returns the semantic events (type, payload) that build them.

    Reasoning and message Items are text Items with one content part; a text Item stays open until another Item
    starts or the output ends. Function calls are added when they start and done when their arguments are final.
    A call of a freeform tool (``custom_names``) becomes a ``custom_tool_call`` whose ``input`` is the call's one
    string argument; it streams as one input delta once the call is complete (its JSON argument text is not the
    input). With ``encrypt_reasoning``, closed reasoning Items carry ``encrypted_content``.
    """

    def __init__(self, custom_names: frozenset[str] = frozenset(), encrypt_reasoning: bool = False) -> None:
        self.custom_names = custom_names
        self.encrypt_reasoning = encrypt_reasoning
        self.items: list[dict[str, Any]] = []
        self._open_text: int | None = None
        self._text: list[str] = []
        self._calls: dict[int, int] = {}  # decoder call index -> output index
        self._arguments: dict[int, str] = {}  # output index -> arguments streamed so far

    def feed(self, events: tuple[OutputEvent, ...] | list[OutputEvent]) -> list[tuple[str, dict[str, Any]]]:
        emitted: list[tuple[str, dict[str, Any]]] = []
        for event in events:
            if isinstance(event, (ReasoningDelta, ContentDelta)):
                self._text_delta("reasoning" if isinstance(event, ReasoningDelta) else "message", event.text, emitted)
            elif isinstance(event, ToolCallStarted):
                self._start_call(event, emitted)
            elif isinstance(event, ToolCallArgumentsDelta):
                self._arguments_delta(self._calls[event.index], event.text, emitted)
            elif isinstance(event, ToolCallFinished):
                self._finish_call(self._calls[event.index], event.arguments_json, emitted)
        return emitted

    def finish(self, status: str) -> list[tuple[str, dict[str, Any]]]:
        """Close the open text Item: ``completed`` when the Response completed, else ``incomplete``."""
        emitted: list[tuple[str, dict[str, Any]]] = []
        self._close_text("completed" if status == "completed" else "incomplete", emitted)
        return emitted

    # -- text Items --------------------------------------------------------------------------------------------

    def _text_delta(self, kind: str, text: str, emitted: list[tuple[str, dict[str, Any]]]) -> None:
        if not text:
            return
        if self._open_text is None or self.items[self._open_text]["type"] != kind:
            self._close_text("completed", emitted)
            self._open_text_item(kind, emitted)
        index = self._open_text
        self._text.append(text)
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        payload = self._part_ref(index) | {"delta": text}
        if kind == "message":
            payload["logprobs"] = []
        emitted.append((event, payload))

    def _open_text_item(self, kind: str, emitted: list[tuple[str, dict[str, Any]]]) -> None:
        if kind == "reasoning":
            item: dict[str, Any] = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                    "status": "in_progress"}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
        self.items.append(item)
        self._open_text = len(self.items) - 1
        self._text = []
        emitted.append(("response.output_item.added", {"output_index": self._open_text, "item": copy.deepcopy(item)}))
        emitted.append(("response.content_part.added", self._part_ref(self._open_text) | {"part": self._part(kind, "")}))

    def _close_text(self, status: str, emitted: list[tuple[str, dict[str, Any]]]) -> None:
        index = self._open_text
        if index is None:
            return
        self._open_text = None
        item = self.items[index]
        text = "".join(self._text)
        part = self._part(item["type"], text)
        item["content"] = [part]
        item["status"] = status
        if item["type"] == "reasoning" and self.encrypt_reasoning:
            item["encrypted_content"] = encode_reasoning(text)
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        payload = self._part_ref(index) | {"text": text}
        if item["type"] == "message":
            payload["logprobs"] = []
        emitted.append((done, payload))
        emitted.append(("response.content_part.done", self._part_ref(index) | {"part": copy.deepcopy(part)}))
        emitted.append(("response.output_item.done", {"output_index": index, "item": copy.deepcopy(item)}))

    def _part_ref(self, index: int) -> dict[str, Any]:
        return {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    # -- function calls ----------------------------------------------------------------------------------------

    def _start_call(self, event: ToolCallStarted, emitted: list[tuple[str, dict[str, Any]]]) -> None:
        self._close_text("completed", emitted)
        if event.namespace is None and event.name in self.custom_names:
            item: dict[str, Any] = {"id": new_id("ctc"), "type": "custom_tool_call", "call_id": event.call_id,
                                    "name": event.name, "input": "", "status": "in_progress"}
        else:
            item = {"id": new_id("fc"), "type": "function_call", "call_id": event.call_id, "name": event.name,
                    "arguments": "", "status": "in_progress"}
        if event.namespace is not None:
            item["namespace"] = event.namespace
        self.items.append(item)
        index = len(self.items) - 1
        self._calls[event.index] = index
        self._arguments[index] = ""
        emitted.append(("response.output_item.added", {"output_index": index, "item": copy.deepcopy(item)}))

    def _arguments_delta(self, index: int, text: str, emitted: list[tuple[str, dict[str, Any]]]) -> None:
        if not text or self.items[index]["type"] == "custom_tool_call":
            return
        self._arguments[index] += text
        emitted.append(("response.function_call_arguments.delta",
                        {"item_id": self.items[index]["id"], "output_index": index, "delta": text}))

    def _finish_call(self, index: int, arguments: str, emitted: list[tuple[str, dict[str, Any]]]) -> None:
        item = self.items[index]
        if item["type"] == "custom_tool_call":
            self._finish_custom_call(index, arguments, emitted)
            return
        sent = self._arguments[index]
        if arguments != sent:
            if not arguments.startswith(sent):
                raise AssertionError("the decoder's final tool-call arguments contradict its streamed deltas")
            self._arguments_delta(index, arguments[len(sent):], emitted)
        item["arguments"] = arguments
        item["status"] = "completed"
        emitted.append(("response.function_call_arguments.done",
                        {"item_id": item["id"], "output_index": index, "name": item["name"], "arguments": arguments}))
        emitted.append(("response.output_item.done", {"output_index": index, "item": copy.deepcopy(item)}))

    def _finish_custom_call(self, index: int, arguments: str, emitted: list[tuple[str, dict[str, Any]]]) -> None:
        value = json.loads(arguments).get(FREEFORM_PARAMETER, "")
        raw_input = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        item = self.items[index]
        item["input"] = raw_input
        item["status"] = "completed"
        ref = {"item_id": item["id"], "output_index": index}
        if raw_input:
            emitted.append(("response.custom_tool_call_input.delta", ref | {"delta": raw_input}))
        emitted.append(("response.custom_tool_call_input.done", ref | {"input": raw_input}))
        emitted.append(("response.output_item.done", {"output_index": index, "item": copy.deepcopy(item)}))


# -- one Create ----------------------------------------------------------------------------------------------------


def _store(context: Any) -> ResponseStore:
    return context.state[STORE_KEY]


def _rename_param(error: NinferError) -> NinferError:
    if error.param in _PARAM_ALIASES:
        error.param = _PARAM_ALIASES[error.param]
    return error


class ResponseRun:
    """One Create request's generation, Items, terminal object and store write; ``parent`` is the stored
    ``previous_response_id`` Response (None for a root)."""

    def __init__(self, context: Any, request: ResponsesRequest, request_id: str,
                 parent: StoredResponse | None = None) -> None:
        self.context = context
        self.request = request
        self.response_id = new_id("resp")
        self.created_at = int(time.time())
        custom = frozenset(tool.name for tool in request.conversation.tools if tool.freeform)
        self.builder = OutputBuilder(custom, request.include_encrypted_reasoning)
        self.session = chain_session(request, self.response_id, parent)
        job = GenerationJob(PROTOCOL, request.conversation, request.options, stream=request.stream,
                            session=self.session)
        self.generation = Generation(context, job, request_id)

    def snapshot(self, status: str, **fields: Any) -> dict[str, Any]:
        return response_object(self.request, response_id=self.response_id, created_at=self.created_at,
                               model=self.context.model_id, status=status, output=self.builder.items, **fields)

    async def start(self) -> None:
        """Check the store can hold the input, prepare and submit the generation, wait for admission."""
        if self.request.store:
            parent = self.request.parent
            chain = parent.segment.chain_size() if parent is not None and parent.segment is not None else 0
            _store(self.context).check_fits(chain + items_size(self.request.input_items))
        try:
            await self.generation.start()
            await self.generation.admitted()
        except NinferError as error:
            raise _rename_param(error) from None

    async def events(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The output events until the generation ends; then :meth:`terminal` gives the final object."""
        async for update in self.generation.updates():
            if isinstance(update, OutputUpdate):
                for event in self.builder.feed(update.events):
                    yield event

    def terminal(self) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
        """Close the output and build the terminal object; the closing events and the object."""
        result = self.generation.result
        assert result is not None
        status = response_status(result)
        closing = self.builder.finish(status)
        return closing, self.snapshot(status, usage=usage_object(result))

    def keep(self, body: dict[str, Any]) -> None:
        """Store the terminal object and its context (unless ``store`` is false)."""
        result = self.generation.result
        if not self.request.store or result is None:
            return
        parent = self.request.parent
        segment = ContextSegment(parent.segment if parent is not None else None,
                                 (*self.request.input_items, *copy.deepcopy(self.builder.items)),
                                 len(self.request.input_items))
        record = StoredResponse(self.response_id, copy.deepcopy(body), segment, result.prepared.preserve_thinking,
                                self.session.key if self.session is not None else None)
        _store(self.context).put(record)


class ResponseEvents:
    """The encoded SSE frames of a streamed Response: typed events with increasing sequence numbers."""

    def __init__(self, run: ResponseRun) -> None:
        self.run = run
        self.sequence = 0

    def _frame(self, event: str, payload: Mapping[str, Any]) -> bytes:
        data = {"type": event, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return sse_frame(data, event=event)

    def failed_frame(self, error: NinferError) -> bytes:
        """The terminal ``response.failed`` event carrying ``error``."""
        failed = self.run.snapshot("failed", error={"code": error.code, "message": error.message})
        return self._frame("response.failed", {"response": failed})

    async def frames(self) -> AsyncIterator[bytes]:
        run = self.run
        yield self._frame("response.created", {"response": run.snapshot("in_progress")})
        yield self._frame("response.in_progress", {"response": run.snapshot("in_progress")})
        try:
            async for event, payload in run.events():
                yield self._frame(event, payload)
            closing, body = run.terminal()
            for event, payload in closing:
                yield self._frame(event, payload)
            run.keep(body)
        except NinferError as error:
            yield self.failed_frame(error)
            return
        if body["status"] == "cancelled":  # the client is gone or the server is stopping: say why if anyone listens
            error = cancelled_error(run.generation)
            yield self._frame("response.failed", {"response": body | {"error": {"code": error.code,
                                                                                "message": error.message}}})
            return
        yield self._frame(f"response.{body['status']}", {"response": body})


# -- resources -----------------------------------------------------------------------------------------------------


class _Resource:
    def __init__(self, context: Any) -> None:
        self.context = context

    async def parse(self, req: Any, *, count_only: bool = False) -> tuple[ResponsesRequest, StoredResponse | None]:
        """The parsed request and the stored ``previous_response_id`` Response it continues (None for a root)."""
        body = await read_json_object(req, self.context.config)
        parents: list[StoredResponse] = []

        def lookup(response_id: str) -> ParentContext:
            record = _store(self.context).get(response_id, param="previous_response_id")
            parents.append(record)
            return ParentContext(record.context.history(), record.preserve_thinking, record.context,
                                 record.context.output_starts())

        config = self.context.config
        request = parse_responses_request(body, model_id=self.context.model_id, vision=bool(config.vision),
                                          lookup=lookup, count_only=count_only, hosted_tools=config.hosted_tools)
        self._warn_ignored(request.conversation.ignored_tools)
        return request, parents[-1] if parents else None

    def _warn_ignored(self, kinds: tuple[str, ...]) -> None:
        """One stderr warning per process and hosted tool type (the type names are a fixed vocabulary)."""
        warned: set[str] = self.context.state.setdefault(WARNED_HOSTED_KEY, set())
        for kind in dict.fromkeys(kinds):
            if kind not in warned:
                warned.add(kind)
                oplog.get_logger().warning(f"Responses tool type {quoted(kind)} is hosted by OpenAI and has no "
                                           "executor here: left out of the effective tools (--hosted-tools ignore)")


def _json(resp: Any, body: Any) -> None:
    resp.status = falcon.HTTP_200
    resp.content_type = falcon.MEDIA_JSON
    resp.data = json_bytes(body)


class CreateResource(_Resource):
    async def on_post(self, req: Any, resp: Any) -> None:
        request, parent = await self.parse(req)
        run = ResponseRun(self.context, request, req.context.request_id, parent)
        if run.request.stream:
            await self._stream(req, resp, run)
            return
        try:
            async with cancel_on_disconnect(req, run.generation):
                await run.start()
                async for _ in run.events():
                    pass
                _, body = run.terminal()
                run.keep(body)
        finally:
            run.generation.close()
        if body["status"] == "cancelled":
            raise cancelled_error(run.generation)
        _json(resp, body)

    async def _stream(self, req: Any, resp: Any, run: ResponseRun) -> None:
        events = ResponseEvents(run)
        await respond_with_stream(req, resp, run.generation, run.start, events.frames(), events.failed_frame)


class InputTokensResource(_Resource):
    async def on_post(self, req: Any, resp: Any) -> None:
        request, _parent = await self.parse(req, count_only=True)
        count_tokens = getattr(self.context.frontend, "count_tokens", None)
        if count_tokens is None:
            raise NotYetAvailableError("input-token counting is not yet available for this model family's frontend")
        loop = asyncio.get_running_loop()
        try:
            count = await loop.run_in_executor(None, count_tokens, request.conversation)
        except NinferError as error:
            raise _rename_param(error) from None
        _json(resp, {"object": "response.input_tokens", "input_tokens": count})


def _query_flag(req: Any, name: str) -> bool:
    value = req.get_param(name)
    return value is not None and value.lower() not in ("false", "0", "")


def _query_include(req: Any) -> bool:
    """Whether the query's ``include`` asks for encrypted reasoning (other values are rejected)."""
    include = [value for name in ("include", "include[]") for value in (req.get_param_as_list(name) or []) if value]
    return parse_include(include, "include")


def with_encrypted_reasoning(body: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a stored Response whose reasoning Items carry ``encrypted_content``."""
    copied = copy.deepcopy(dict(body))
    for item in copied["output"]:
        if item["type"] == "reasoning":
            item["encrypted_content"] = encode_reasoning("".join(part["text"] for part in item["content"]))
    return copied


class ResponseResource(_Resource):
    async def on_get(self, req: Any, resp: Any, response_id: str) -> None:
        if _query_flag(req, "stream") or req.get_param("starting_after") is not None:
            raise unsupported("stream", "stored Responses are terminal objects; stream recovery is not available")
        include = _query_include(req)
        body = _store(self.context).get(response_id).body
        _json(resp, with_encrypted_reasoning(body) if include else body)

    async def on_delete(self, req: Any, resp: Any, response_id: str) -> None:
        _store(self.context).delete(response_id)
        _json(resp, {"id": response_id, "object": "response.deleted", "deleted": True})


class InputItemsResource(_Resource):
    async def on_get(self, req: Any, resp: Any, response_id: str) -> None:
        if _query_include(req):
            raise unsupported("include", "input Items are listed as they were normalized; encrypted reasoning is "
                              "only added to Response output")
        limit_text = req.get_param("limit")
        try:
            limit = INPUT_ITEMS_DEFAULT_LIMIT if limit_text is None else int(limit_text)
        except ValueError:
            raise malformed("limit", f"expected an integer, got {quoted(limit_text)}") from None
        if not 1 <= limit <= INPUT_ITEMS_MAX_LIMIT:
            raise malformed("limit", f"{limit} is out of range (expected 1..{INPUT_ITEMS_MAX_LIMIT})")
        order = req.get_param("order") or "desc"
        if order not in ("asc", "desc"):
            raise malformed("order", f"expected 'asc' or 'desc', got {quoted(order)}")
        items = list(_store(self.context).get(response_id).context.input_items)
        if order == "desc":
            items.reverse()
        after = req.get_param("after")
        if after is not None:
            position = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if position is None:
                raise malformed("after", f"{quoted(after)} is not an input Item id of response {quoted(response_id)}")
            items = items[position + 1:]
        page = items[:limit]
        _json(resp, {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                     "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


class CancelResource(_Resource):
    async def on_post(self, req: Any, resp: Any, response_id: str) -> None:
        _store(self.context).get(response_id)
        raise InvalidRequestError("only background Responses can be cancelled and background execution is not "
                                  "available; stored Responses are already terminal", param="response_id",
                                  code="background_not_supported")


class CompactResource(_Resource):
    async def on_post(self, req: Any, resp: Any) -> None:
        raise InvalidRequestError("Response compaction is not available on this server", code="compaction_not_supported")


def mount_openai_responses(app: Any, context: Any) -> None:
    config = context.config
    context.state[STORE_KEY] = ResponseStore(config.response_store_max_records, config.response_store_max_mib * MIB)
    app.add_route("/v1/responses", CreateResource(context))
    app.add_route("/v1/responses/input_tokens", InputTokensResource(context))
    app.add_route("/v1/responses/compact", CompactResource(context))
    app.add_route("/v1/responses/{response_id}", ResponseResource(context))
    app.add_route("/v1/responses/{response_id}/input_items", InputItemsResource(context))
    app.add_route("/v1/responses/{response_id}/cancel", CancelResource(context))
