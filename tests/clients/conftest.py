"""Fixtures of the agent-client tests: one echo-model ``ninfer serve`` for the session, a recording proxy per test.

``tests/`` goes on ``sys.path`` so these modules share ``tests/live_server.py`` with the HTTP tests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from agent_support import RecordingProxy  # noqa: E402
from live_server import API_KEY, ECHO_MODEL, LiveServer, start_servers, tiny_artifact  # noqa: E402

# Claude Code's system prompt and tools alone are ~22k tokens and both clients resend the whole history each turn.
SERVER_ARGS = ["--api-key", API_KEY, "--max-context", "65536", "--log-stats-interval-ms", "0"]


@pytest.fixture(scope="session")
def echo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The echo model (default template) behind ``--api-key``; started only when a client test runs."""
    artifact = tiny_artifact(tmp_path_factory, "echo")
    [server] = start_servers(tmp_path_factory.mktemp("clients-server"), [(artifact, SERVER_ARGS, {})], [ECHO_MODEL])
    yield server
    server.stop()


@pytest.fixture
def proxy(echo_server: LiveServer) -> Iterator[RecordingProxy]:
    """A fresh recording proxy in front of the echo server, so each test sees only its own exchanges."""
    recording = RecordingProxy(echo_server.base_url).start()
    yield recording
    recording.stop()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The client's working directory (outside any git repository), where the scripted commands write."""
    path = tmp_path / "work"
    path.mkdir()
    return path
