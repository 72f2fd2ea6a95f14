"""Protocol-neutral generation glue shared by every HTTP adapter.

One :class:`Generation` drives one request through the server: reserve lifetime capacity (429 when full) ->
prepare the prompt with the model frontend in a worker thread before the pending deadline -> submit to the
engine -> wait for admission (queue timeout and capacity errors surface here, before any response byte) ->
stream engine commits through the frontend's output decoder as protocol-neutral updates -> the final
:class:`GenerationResult`. A client disconnect (see :func:`cancel_on_disconnect`) or server shutdown cancels the
engine request wherever it is (preparing, waiting, prefilling or decoding) and frees its resources.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable

import attrs

from ninfer.core.conversation import Conversation, GenerationOptions
from ninfer.core.errors import EngineUnavailableError, NinferError
from ninfer.core.frontend import (
    ContentDelta,
    OutputEvent,
    ParseReport,
    PreparedRequest,
    ReasoningDelta,
    ToolCallArgumentsDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from ninfer.core.records import RequestRecord
from ninfer.core.request import SessionKey
from ninfer.engine import (
    AdmittedEvent,
    FinishEvent,
    GenerationOutcome,
    ProgressEvent,
    RequestHandle,
    RequestTimings,
    TokensEvent,
)
from ninfer.observability import oplog
from ninfer.observability.request_log import RequestObserver, cache_summary, observability_for
from ninfer.server.errors import internal_error, report_internal_error
from ninfer.server.http import wait_for_disconnect, with_keepalive

_ACTIVE_KEY = "generation.active"
_STOPPING_KEY = "generation.stopping"
_PENDING_RECORDS_KEY = "generation.pending_records"
_POOL_KEY = "generation.prepare_pool"
_MAX_PREPARE_WORKERS = 8
_ABANDONED_POLL_S = 0.02


class ClientDisconnectedError(NinferError):
    """The request's client went away; nobody is left to read this error (nginx's 499 by convention)."""

    status = 499
    error_type = "invalid_request_error"
    code = "client_disconnected"


@attrs.frozen
class GenerationJob:
    """What an adapter hands the glue: the normalized request, its protocol name (for records and logs),
    whether prompt-processing progress updates are wanted, and its Engine reuse session (if any)."""

    protocol: str
    conversation: Conversation
    options: GenerationOptions
    report_progress: bool = False
    stream: bool = False
    session: SessionKey | None = None


@attrs.frozen
class PromptProgress:
    """Cumulative prompt-processing progress (llama.cpp ``prompt_progress``)."""

    event: ProgressEvent


@attrs.frozen
class OutputUpdate:
    """Frontend output events released by one engine commit, with the cumulative timings at that commit."""

    events: tuple[OutputEvent, ...]
    timings: RequestTimings


Update = PromptProgress | OutputUpdate


@attrs.frozen
class GeneratedToolCall:
    """A structured call in the final output; ``arguments_json`` is the canonical JSON object text."""

    index: int
    call_id: str
    name: str
    namespace: str | None
    arguments_json: str


@attrs.frozen
class GenerationResult:
    """The terminal result: engine outcome plus the decoded reasoning/content/tool calls."""

    outcome: GenerationOutcome
    prepared: PreparedRequest
    reasoning: str
    content: str
    tool_calls: tuple[GeneratedToolCall, ...]
    reasoning_tokens: int
    parse_report: ParseReport

    @property
    def finish_reason(self) -> str:
        """The engine's finish reason: ``stop``, ``length`` or ``cancelled``."""
        return self.outcome.finish_reason


class OutputAccumulator:
    """Collects decoder events into the aggregate reasoning, content and tool calls."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self._started: dict[int, ToolCallStarted] = {}
        self._arguments: dict[int, list[str]] = {}
        self._finished: dict[int, str] = {}

    def add(self, events: tuple[OutputEvent, ...] | list[OutputEvent]) -> None:
        for event in events:
            if isinstance(event, ReasoningDelta):
                self.reasoning.append(event.text)
            elif isinstance(event, ContentDelta):
                self.content.append(event.text)
            elif isinstance(event, ToolCallStarted):
                self._started[event.index] = event
                self._arguments[event.index] = []
            elif isinstance(event, ToolCallArgumentsDelta):
                self._arguments.setdefault(event.index, []).append(event.text)
            elif isinstance(event, ToolCallFinished):
                self._finished[event.index] = event.arguments_json

    def tool_calls(self) -> tuple[GeneratedToolCall, ...]:
        calls = []
        for index, started in sorted(self._started.items()):
            arguments = self._finished.get(index, "".join(self._arguments.get(index, ())))
            calls.append(GeneratedToolCall(index, started.call_id, started.name, started.namespace, arguments))
        return tuple(calls)


# -- server-wide state -----------------------------------------------------------------------------


def _active(context: Any) -> set["Generation"]:
    return context.state.setdefault(_ACTIVE_KEY, set())


def _prepare_pool(context: Any) -> ThreadPoolExecutor:
    pool = context.state.get(_POOL_KEY)
    if pool is None:
        workers = min(_MAX_PREPARE_WORKERS, max(2, os.cpu_count() or 2))
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ninfer-prepare")
        context.state[_POOL_KEY] = pool
    return pool


def stop_generations(context: Any) -> int:
    """Server shutdown: refuse new generations and cancel every one in flight; returns how many were cancelled."""
    context.state[_STOPPING_KEY] = True
    active = list(_active(context))
    for generation in active:
        generation.cancel()
    return len(active)


def close_generation_resources(context: Any) -> None:
    """Release the preparation worker pool (after the HTTP server stopped)."""
    pool = context.state.pop(_POOL_KEY, None)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


def is_stopping(context: Any) -> bool:
    """True once :func:`stop_generations` ran (graceful shutdown)."""
    return bool(context.state.get(_STOPPING_KEY))


def _shutting_down_error() -> EngineUnavailableError:
    return EngineUnavailableError("the server is shutting down and accepts no more work")


def cancelled_error(generation: "Generation") -> NinferError:
    """Why a request ended ``cancelled``: server shutdown (503) or its client went away."""
    if is_stopping(generation.context):
        return EngineUnavailableError("the request was cancelled because the server is shutting down")
    return ClientDisconnectedError("the request was cancelled because its client disconnected")


# -- one generation --------------------------------------------------------------------------------


class Generation:
    """One generation request's lifecycle; see the module docstring. Always :meth:`close` it."""

    def __init__(self, context: Any, job: GenerationJob, request_id: str) -> None:
        self.context = context
        self.job = job
        self.request_id = request_id
        self.prepared: PreparedRequest | None = None
        self.result: GenerationResult | None = None
        self.admission: AdmittedEvent | None = None
        self._handle: RequestHandle | None = None
        self._events: AsyncIterator[Any] | None = None
        self._pending: list[Any] = []
        self._cancelled = False
        self._closed = False
        self._started_at = time.monotonic()
        self._recorded = False
        self._observer: RequestObserver | None = None
        self._decoder: Any = None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Reserve capacity, prepare the prompt (worker thread, pending deadline) and submit it to the engine."""
        if is_stopping(self.context):
            raise _shutting_down_error()
        engine = self.context.engine
        ticket = engine.reserve_slot()
        _active(self.context).add(self)
        observability = observability_for(self.context)
        if observability is not None:
            self._observer = observability.observe(
                self.job.protocol, self.request_id, self.job.conversation, self.job.stream
            )
        try:
            self.prepared = await self._prepare(ticket)
            prepare_seconds = time.monotonic() - self._started_at
            if self._cancelled or is_stopping(self.context):
                raise cancelled_error(self)
            request = attrs.evolve(
                self.prepared.request,
                report_progress=self.job.report_progress,
                request_id=self.request_id,
                session=self.job.session,
            )
        except BaseException as exc:
            ticket.release()
            _active(self.context).discard(self)
            if self._observer is not None:
                self._observer.rejected(exc)
            raise
        try:
            self._handle = engine.submit(request, ticket)
        except BaseException as exc:
            _active(self.context).discard(self)
            if self._observer is not None:
                self._observer.rejected(exc)
            raise
        if self._observer is not None:
            self._observer.started(self.prepared, request.sampling, prepare_seconds, time.monotonic())
        self._events = self._handle.events()

    async def _prepare(self, ticket: Any) -> PreparedRequest:
        frontend = self.context.frontend
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(
            _prepare_pool(self.context), frontend.prepare, self.job.conversation, self.job.options
        )
        if ticket.deadline is None:
            return await future
        try:
            return await asyncio.wait_for(future, max(ticket.deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise ticket.timeout_error() from None

    async def admitted(self) -> AdmittedEvent:
        """Wait until the engine admits the request; queue timeouts and engine failures raise here.

        Returns the admission event (prompt tokens and the exact reused prefix). A request cancelled before
        admission raises :class:`ClientDisconnectedError` (or the shutdown error when the server is stopping).
        """
        if self.admission is not None:
            return self.admission
        event = await self._next_event()
        if isinstance(event, AdmittedEvent):
            self.admission = event
            return event
        self._pending.append(event)
        if isinstance(event, FinishEvent) and event.outcome.finish_reason == "cancelled":
            await self._drain()
            raise cancelled_error(self)
        raise AssertionError(f"unexpected first engine event {type(event).__name__}")

    async def _next_event(self) -> Any:
        assert self._events is not None, "start() must succeed before events are read"
        try:
            return await self._events.__anext__()
        except NinferError as exc:
            self._record_error()
            if self._observer is not None:
                self._observer.failed(exc)
            raise
        except StopAsyncIteration:
            raise AssertionError("the engine ended a request without a terminal event") from None

    async def _drain(self) -> None:
        async for _ in self.updates():
            pass

    async def updates(self) -> AsyncIterator[Update]:
        """Progress and output updates until the request ends; then :attr:`result` is set.

        Engine failures after admission raise the engine's typed error.
        """
        assert self.prepared is not None
        decoder = self._decoder = self.context.frontend.decoder(self.prepared)
        accumulator = OutputAccumulator()
        while True:
            event = self._pending.pop(0) if self._pending else await self._next_event()
            if isinstance(event, AdmittedEvent):
                self.admission = event
            elif isinstance(event, ProgressEvent):
                yield PromptProgress(event)
            elif isinstance(event, TokensEvent):
                if self._observer is not None and self.admission is not None:
                    self._observer.committed(
                        event.completion_tokens, self.admission.prompt_tokens, self.admission.cached_tokens
                    )
                events = tuple(decoder.push(event.text, token_count=len(event.token_ids)))
                if events:
                    accumulator.add(events)
                    yield OutputUpdate(events, event.timings)
            elif isinstance(event, FinishEvent):
                events = tuple(decoder.finish())
                if events:
                    accumulator.add(events)
                    yield OutputUpdate(events, event.outcome.timings)
                self.result = GenerationResult(
                    outcome=event.outcome,
                    prepared=self.prepared,
                    reasoning="".join(accumulator.reasoning),
                    content="".join(accumulator.content),
                    tool_calls=accumulator.tool_calls(),
                    reasoning_tokens=decoder.reasoning_tokens,
                    parse_report=decoder.parse_report,
                )
                self._record_outcome(self.result)
                return

    async def run(self) -> GenerationResult:
        """Run to the end without streaming and return the result."""
        await self._drain()
        assert self.result is not None
        return self.result

    def cancel(self) -> None:
        """Cancel wherever the request is; an unsubmitted request is abandoned after preparation."""
        self._cancelled = True
        if self._handle is not None:
            self._handle.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def close(self) -> None:
        """Release the request's capacity (cancelling it if unfinished); idempotent."""
        if self._closed:
            return
        self._closed = True
        _active(self.context).discard(self)
        if self._handle is not None:
            self._handle.close()
            if self._observer is not None and not self._observer.ended:
                task = asyncio.get_running_loop().create_task(self._record_abandoned())
                pending = self.context.state.setdefault(_PENDING_RECORDS_KEY, set())
                pending.add(task)
                task.add_done_callback(pending.discard)

    async def _record_abandoned(self) -> None:
        """The response ended before the engine outcome was read (e.g. a stream closed early): wait for the
        (cancelled) request's terminal on the handle so it still gets its one terminal record."""
        handle, observer = self._handle, self._observer
        assert handle is not None and observer is not None
        while not handle.done:
            await asyncio.sleep(_ABANDONED_POLL_S)
        decoder = self._decoder
        if handle.outcome is not None:
            observer.done(
                handle.outcome,
                decoder.parse_report if decoder is not None else ParseReport(),
                decoder.reasoning_tokens if decoder is not None else 0,
            )
        elif handle.error is not None:
            observer.failed(handle.error)

    # -- records -----------------------------------------------------------------------------------

    def _record_outcome(self, result: GenerationResult) -> None:
        outcome = result.outcome
        timings = outcome.timings
        ttft = None
        if timings.first_token_at is not None:
            ttft = max(timings.first_token_at - timings.submitted_at, 0.0)
        if self._observer is not None:
            self._observer.done(outcome, result.parse_report, result.reasoning_tokens)
        log = oplog.get_logger()
        if outcome.finish_reason == "cancelled":
            log.info(f"request {self.request_id} {self.job.protocol} cancelled after {outcome.completion_tokens} tokens")
        else:
            rate = timings.timings_dict()["predicted_per_second"]
            log.info(
                f"request {self.request_id} {self.job.protocol} done: {outcome.finish_reason}, prompt "
                f"{outcome.prompt_tokens} ({cache_summary(outcome)}), "
                f"completion {outcome.completion_tokens}"
                + (f", reasoning {result.reasoning_tokens}" if result.reasoning_tokens else "")
                + (f", tool calls {len(result.tool_calls)}" if result.tool_calls else "")
                + (f", ttft {ttft * 1000:.0f} ms" if ttft is not None else "")
                + f", {rate:.1f} tok/s"
            )
            if result.parse_report.fallback_reason != "none":
                log.warning(
                    f"request {self.request_id}: tool-call markup returned as text "
                    f"({result.parse_report.fallback_reason})"
                )
        self._publish_record(
            RequestRecord(
                protocol=self.job.protocol,
                finish_reason=outcome.finish_reason,
                prompt_tokens=outcome.prompt_tokens,
                cached_tokens=outcome.cached_tokens,
                completion_tokens=outcome.completion_tokens,
                total_seconds=timings.total_s,
                ttft_seconds=ttft,
            )
        )

    def _record_error(self) -> None:
        prompt = len(self.prepared.request.prompt_token_ids) if self.prepared is not None else 0
        self._publish_record(
            RequestRecord(
                protocol=self.job.protocol,
                finish_reason="error",
                prompt_tokens=prompt,
                cached_tokens=0,
                completion_tokens=0,
                total_seconds=time.monotonic() - self._started_at,
            )
        )

    def _publish_record(self, record: RequestRecord) -> None:
        if self._recorded:
            return
        self._recorded = True
        try:
            self.context.plugins.hook.ninfer_request_finished(record=record)
        except Exception as exc:  # a plugin's failure must not break the response
            oplog.get_logger().warning(f"a ninfer_request_finished hook failed: {type(exc).__name__}: {exc}")


@contextlib.asynccontextmanager
async def cancel_on_disconnect(req: Any, generation: Generation) -> AsyncIterator[None]:
    """While the block runs, a client disconnect cancels ``generation`` (waiting, prefilling or decoding)."""
    watcher = asyncio.create_task(watch_disconnect(req, generation.cancel))
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher


async def watch_disconnect(req: Any, on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` when the client of ``req`` (body fully read) disconnects; run it as a task."""
    await wait_for_disconnect(req)
    on_disconnect()


ErrorFrame = Callable[[NinferError], bytes]


class GenerationStream:
    """The SSE body of a streamed generation, shared by every adapter.

    ``frames`` are the adapter's encoded events; this adds ``: keep-alive`` comments, cancels the generation
    when the client disconnects, and releases it when falcon closes the body (end or failed send). Once the 200
    headers are out an error can no longer change the status, so a failure of ``frames`` ends the stream with the
    protocol's error event (``error_frame``): a typed error as itself, anything else (an internal invariant broke,
    logged once with its traceback) as ``internal_error``. The connection is never just dropped.
    """

    def __init__(self, req: Any, generation: Generation, frames: AsyncIterator[bytes],
                 error_frame: ErrorFrame) -> None:
        self.generation = generation
        self._watcher = asyncio.create_task(watch_disconnect(req, generation.cancel))
        self._frames = with_keepalive(frames)
        self._error_frame = error_frame
        self._ended = False

    def __aiter__(self) -> "GenerationStream":
        return self

    async def __anext__(self) -> bytes:
        if self._ended:
            raise StopAsyncIteration
        try:
            return await self._frames.__anext__()
        except StopAsyncIteration:
            raise
        except Exception as exc:
            self._ended = True
            return self._final_frame(exc)

    def _final_frame(self, exc: Exception) -> bytes:
        request_id = self.generation.request_id
        if not isinstance(exc, NinferError):
            report_internal_error(exc, request_id, "streaming a response")
            exc = internal_error()
        try:
            return self._error_frame(exc)
        except Exception as frame_error:  # the error event itself cannot be built: end the stream cleanly
            report_internal_error(frame_error, request_id, "rendering a stream's error event")
            raise StopAsyncIteration from None

    async def close(self) -> None:
        self._watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._watcher
        self.generation.close()
        with contextlib.suppress(Exception):
            await self._frames.aclose()


async def respond_with_stream(req: Any, resp: Any, generation: Generation, begin: Callable[[], Awaitable[None]],
                              frames: AsyncIterator[bytes], error_frame: ErrorFrame) -> None:
    """Run ``begin`` (start + wait for admission) and only then commit an SSE response carrying ``frames``
    (ended by ``error_frame`` if they fail; see :class:`GenerationStream`).

    Committing after admission keeps overload, queue-timeout and preparation failures ordinary HTTP errors.
    """
    try:
        async with cancel_on_disconnect(req, generation):
            await begin()
    except BaseException:
        generation.close()
        raise
    resp.status = 200
    resp.content_type = "text/event-stream"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.stream = GenerationStream(req, generation, frames, error_frame)
