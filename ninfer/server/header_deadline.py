"""The HTTP/1.1 protocol the server runs: uvicorn's h11 protocol plus a total deadline on each request's headers.

uvicorn arms no timer while request headers arrive: its keep-alive timer starts only after a response and any byte
cancels it, so a client that connects and sends nothing, or trickles one header byte every few seconds, would hold
its socket forever. Here a request's headers must be complete within ``header_timeout_s`` of the moment the
request begins, else the connection is closed. A request begins when the connection opens (its first request) or
with the first byte after the previous response (a keep-alive request), so the idle time between keep-alive
requests stays governed by uvicorn's ``timeout_keep_alive`` alone. The deadline is set once per request and later
bytes never move it, which is why trickling cannot extend it. The request body is not covered: once the headers
are in, reading the body is the application's business.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ninfer.observability import oplog


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol whose requests must deliver their headers within :attr:`header_timeout_s`.

    h11's ``their_state`` is the one source of truth: ``IDLE`` means the headers of the client's next request are
    not complete yet; any other state means they are (or the connection is ending), so no deadline runs.
    """

    header_timeout_s: float = 10.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_deadline()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # these bytes begin (or continue) the next request's headers
            self._start_header_deadline()
        super().data_received(data)
        self._settle_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._settle_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_deadline()
        super().connection_lost(exc)

    def _settle_header_deadline(self) -> None:
        """Stop the deadline once the headers are in; start it when bytes of the next request already wait in h11's
        buffer (a pipelined request, or the tail of a chunk that also ended the previous request's body)."""
        if self.conn.their_state is not h11.IDLE:
            self._stop_header_deadline()
        elif self.conn.trailing_data[0]:
            self._start_header_deadline()

    def _start_header_deadline(self) -> None:
        if self._header_deadline is None:  # once per request: a running deadline is never pushed back
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _stop_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        if not self.transport.is_closing():
            oplog.get_logger().debug(
                f"closed a connection whose request headers were not complete within {self.header_timeout_s:g} s"
            )
            self.transport.close()


def header_deadline_protocol(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with this bound (uvicorn instantiates a class per
    connection, so the bound travels as a class attribute)."""
    return type(HeaderDeadlineProtocol.__name__, (HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
