"""Lifetime admission capacity: C + pending outstanding requests, each holding a ticket.

A ticket is taken BEFORE the server prepares a prompt (so preparation counts toward capacity) and is
released when the request's final event has been consumed or its handle closed. The ticket also carries
the absolute pending deadline that starts at reservation.
"""

from __future__ import annotations

import threading
import time

from ninfer.core.errors import EngineUnavailableError, QueueTimeoutError, ServerOverloadedError


class AdmissionTicket:
    """One unit of lifetime capacity, with the request's pending deadline (monotonic seconds or None)."""

    def __init__(self, controller: "AdmissionController", created_at: float, deadline: float | None) -> None:
        self._controller = controller
        self.created_at = created_at
        self.deadline = deadline
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def expired(self, now: float | None = None) -> bool:
        if self.deadline is None:
            return False
        return (time.monotonic() if now is None else now) >= self.deadline

    def timeout_error(self) -> QueueTimeoutError:
        waited_ms = (time.monotonic() - self.created_at) * 1000.0
        return QueueTimeoutError(
            f"the request was not admitted within the pending timeout of {self._controller.pending_timeout_ms} ms "
            f"(waited {waited_ms:.0f} ms)"
        )

    def release(self) -> None:
        """Give the capacity back; idempotent."""
        self._controller._release(self)

    def __enter__(self) -> "AdmissionTicket":
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.release()


class AdmissionController:
    """Counts outstanding tickets against ``max_concurrency + max_pending_requests``."""

    def __init__(self, max_concurrency: int, max_pending_requests: int, pending_timeout_ms: int | None) -> None:
        self.max_concurrency = max_concurrency
        self.max_pending_requests = max_pending_requests
        self.pending_timeout_ms = pending_timeout_ms
        self._lock = threading.Lock()
        self._outstanding = 0
        self._closed_reason: str | None = None

    @property
    def capacity(self) -> int:
        return self.max_concurrency + self.max_pending_requests

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def reserve(self) -> AdmissionTicket:
        """Take a ticket or raise :class:`ServerOverloadedError` when capacity is full."""
        now = time.monotonic()
        deadline = None if self.pending_timeout_ms is None else now + self.pending_timeout_ms / 1000.0
        with self._lock:
            if self._closed_reason is not None:
                raise EngineUnavailableError(self._closed_reason)
            if self._outstanding >= self.capacity:
                raise ServerOverloadedError(
                    f"the server is at capacity: {self._outstanding} requests outstanding of "
                    f"{self.capacity} (max concurrency {self.max_concurrency} + max pending "
                    f"{self.max_pending_requests}); retry later"
                )
            self._outstanding += 1
        return AdmissionTicket(self, now, deadline)

    def close(self, reason: str) -> None:
        """Refuse every later reservation with :class:`EngineUnavailableError`."""
        with self._lock:
            if self._closed_reason is None:
                self._closed_reason = reason

    def _release(self, ticket: AdmissionTicket) -> None:
        with self._lock:
            if ticket._released:
                return
            ticket._released = True
            self._outstanding -= 1
