"""Live ``ninfer serve`` subprocesses on 127.0.0.1 for the HTTP tests: tiny artifacts, start/wait/stop, SSE parsing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import httpx
import openai
import pytest

from ninfer.core.plugins import load_plugin_manager
from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact

API_KEY = "local-secret"
STARTUP_TIMEOUT_S = 120.0
ECHO_MODEL = "ninfer-tiny-echo"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def has_family(name: str) -> bool:
    return name in load_plugin_manager().registries.model_families


def tiny_artifact(tmp_path_factory: pytest.TempPathFactory, family: str = "qwen3_5", template: str = "qwen3_6") -> Path:
    """A tiny artifact shared by every module of the session (built once)."""
    if not has_family(family):
        pytest.skip(f"the {family!r} model family is not installed")
    path = tmp_path_factory.getbasetemp() / "live-artifacts" / f"{family}-{template}.ninfer"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        write_tiny_artifact(partial, TinyOptions(family=family, template=template), load_plugin_manager().registries)
        partial.rename(path)
    return path


@attrs.define
class LiveServer:
    """A ``ninfer serve`` subprocess on 127.0.0.1 with its stderr in a file."""

    process: subprocess.Popen
    port: int
    log_path: Path
    model_id: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def client(self, api_key: str = "unused", **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, **options)

    def wait_for_log(self, predicate: Callable[[str], bool], timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            if predicate(text):
                return text
            time.sleep(0.05)
        raise AssertionError(f"the expected server log line did not appear; log:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def inherited_env() -> dict[str, str]:
    """This process's environment without ``NINFER_API_KEY``: a developer's key (the Codex setup exports it) must not
    secure a test server; a test that wants one passes it in the server's extra env."""
    return {name: value for name, value in os.environ.items() if name != "NINFER_API_KEY"}


def start_servers(
    tmp_dir: Path, specs: Sequence[tuple[Path | None, Sequence[str], dict[str, str]]], model_ids: Sequence[str],
    ports: Sequence[int | None] | None = None,
) -> list[LiveServer]:
    """Start one server per ``(artifact, extra args, extra env)`` concurrently and wait until all are healthy;
    ``ports`` pins a server's port (None or omitted: a free one)."""
    servers = []
    for index, ((artifact, args, env), model_id) in enumerate(zip(specs, model_ids)):
        port = (ports[index] if ports is not None else None) or free_port()
        log_path = tmp_dir / f"server-{port}-{index}.log"
        source = [] if artifact is None else [str(artifact)]  # None: the built-in demo model
        command = [sys.executable, "-c", "from ninfer.cli import main; main()", "serve", *source,
                   "--host", "127.0.0.1", "--port", str(port), *args]
        with open(log_path, "w", encoding="utf-8") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**inherited_env(), **env})
        servers.append(LiveServer(process, port, log_path, model_id))
    try:
        _wait_healthy(servers)
    except BaseException:
        for server in servers:
            server.stop(signal.SIGKILL)
        raise
    return servers


def _wait_healthy(servers: list[LiveServer]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                raise RuntimeError(f"ninfer serve exited with {server.process.returncode}:\n{server.log()}")
            try:
                if httpx.get(server.url("/health"), timeout=2).status_code == 200:
                    pending.remove(server)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"ninfer serve did not become healthy:\n{pending[0].log()}")
        time.sleep(0.1)


def echo_body(script: str, **fields: Any) -> dict[str, Any]:
    """A Chat Completions body whose echo-model output is exactly ``script``."""
    return {
        "model": ECHO_MODEL,
        "messages": [{"role": "user", "content": f"```ninfer-echo\n{script}\n```"}],
        **fields,
    }


def sse_data(lines: Sequence[str]) -> list[Any]:
    """The ``data:`` payloads of SSE lines (JSON decoded, ``[DONE]`` kept as the string)."""
    payloads = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "light")  # one token each, with their space


def words(count: int) -> str:
    """``count`` tokens of text (the echo model says it back token by token)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(count))
