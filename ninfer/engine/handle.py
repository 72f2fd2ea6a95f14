"""The caller's side of a submitted request: its events (blocking or async), cancel, close, result.

The executor publishes events without ever blocking: into a buffer read by a blocking iterator, or with
``loop.call_soon_threadsafe`` onto the event loop of an async consumer. The request's admission ticket is
released when its final event has been consumed, or when the handle is closed (at once if the request
already ended, otherwise as soon as it ends; closing an unfinished request cancels it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable, Iterator

from ninfer.core.errors import NinferError
from ninfer.engine.admission import AdmissionTicket
from ninfer.engine.events import EngineEvent, FinishEvent, GenerationOutcome


class _Failure:
    """Terminal marker for a request that failed; iterating raises ``error``."""

    def __init__(self, error: NinferError) -> None:
        self.error = error


_Item = EngineEvent | _Failure


class RequestHandle:
    """Events, cancellation and the outcome of one request."""

    def __init__(self, request_id: str, ticket: AdmissionTicket, wake: Callable[[], None]) -> None:
        self.request_id = request_id
        self._ticket = ticket
        self._wake = wake
        self._cond = threading.Condition()
        self._buffer: deque[_Item] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Item] | None = None
        self._ended = False  # terminal item published
        self._consumed = False  # terminal item consumed
        self._closed = False
        self._cancel_requested = False
        self.outcome: GenerationOutcome | None = None
        self.error: NinferError | None = None

    # -- caller side -------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the request reached its terminal outcome (which may not be consumed yet)."""
        return self._ended

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    def cancel(self) -> None:
        """Ask the engine to stop this request at the next boundary; its outcome becomes ``cancelled``."""
        with self._cond:
            if self._ended or self._cancel_requested:
                return
            self._cancel_requested = True
        self._wake()

    def close(self) -> None:
        """Release the request's capacity; an unfinished request is cancelled first."""
        with self._cond:
            self._closed = True
            ended = self._ended
        if ended:
            self._ticket.release()
        else:
            self.cancel()

    def __enter__(self) -> "RequestHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[EngineEvent]:
        """Blocking iteration over the events; raises the request's error if it failed."""
        return self._iterate(None)

    def _iterate(self, timeout: float | None) -> Iterator[EngineEvent]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                if self._consumed and not self._buffer:
                    return
                if self._loop is not None:
                    raise RuntimeError("this handle is already consumed through events() on an event loop")
                while not self._buffer:
                    if self._consumed:
                        return
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"request {self.request_id} did not finish within {timeout} s")
                    self._cond.wait(remaining)
                item = self._buffer.popleft()
            if self._deliver_terminal(item):
                if isinstance(item, _Failure):
                    raise item.error
                yield item
                return
            yield item  # type: ignore[misc]

    async def events(self) -> AsyncIterator[EngineEvent]:
        """Async iteration on the running loop; events arrive via ``loop.call_soon_threadsafe``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        with self._cond:
            if self._loop is not None:
                raise RuntimeError("this handle is already consumed through events()")
            while self._buffer:
                queue.put_nowait(self._buffer.popleft())
            self._loop, self._queue = loop, queue
            consumed = self._consumed
        if consumed:
            return
        while True:
            item = await queue.get()
            if self._deliver_terminal(item):
                if isinstance(item, _Failure):
                    raise item.error
                yield item
                return
            yield item  # type: ignore[misc]

    def result(self, timeout: float | None = None) -> GenerationOutcome:
        """Consume every remaining event and return the outcome (raises the request's error)."""
        for _ in self._iterate(timeout):
            pass
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return self.outcome

    def _deliver_terminal(self, item: _Item) -> bool:
        if not isinstance(item, (FinishEvent, _Failure)):
            return False
        with self._cond:
            self._consumed = True
        self._ticket.release()
        return True

    # -- executor side -----------------------------------------------------------------------------

    def publish(self, event: EngineEvent) -> None:
        self._put(event)

    def finish(self, outcome: GenerationOutcome) -> None:
        self.outcome = outcome
        self._put(FinishEvent(outcome), terminal=True)

    def fail(self, error: NinferError) -> None:
        self.error = error
        self._put(_Failure(error), terminal=True)

    def _put(self, item: _Item, terminal: bool = False) -> None:
        with self._cond:
            if self._ended:
                return
            if terminal:
                self._ended = True
            release_now = terminal and self._closed
            if self._loop is not None and self._queue is not None:
                try:
                    self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
                except RuntimeError:  # the consumer's loop is closed: nobody will read this request
                    self._cancel_requested = True
                    release_now = terminal
            else:
                self._buffer.append(item)
                self._cond.notify_all()
        if release_now:
            self._ticket.release()
