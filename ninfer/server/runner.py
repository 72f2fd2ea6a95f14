"""Run the ASGI app with uvicorn on a listening socket tuned to detect dead peers, over the h11 protocol that bounds
the time a request's headers may take (:mod:`ninfer.server.header_deadline`)."""

from __future__ import annotations

import socket
from typing import Any

import uvicorn

from ninfer.server.header_deadline import header_deadline_protocol

TCP_USER_TIMEOUT_MS = 15_000
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3


def tune_socket(sock: socket.socket) -> None:
    """TCP keepalive and a 15 s TCP_USER_TIMEOUT; Linux copies them onto every accepted connection."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_MS),
    ):
        option = getattr(socket, name, None)
        if option is not None:  # Linux; other platforms keep the OS defaults
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tune_socket(sock)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def server_config(app: Any, *, header_timeout_ms: int) -> uvicorn.Config:
    """uvicorn's configuration: ninfer's own protocol class (always h11, with the header deadline, whether or not
    httptools is installed), no uvicorn logging, no lifespan, a 10 s graceful shutdown."""
    return uvicorn.Config(
        app,
        http=header_deadline_protocol(header_timeout_ms / 1000),
        log_level="critical",  # ninfer writes its own operational log
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=10,
    )
