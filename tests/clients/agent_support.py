"""Shared support for driving real agent clients (Codex CLI, Claude Code) against a live echo-model server.

Each client module provides an *agent*: an object with a ``shell`` tool (the client's own shell tool, as it declares
it in its requests) and ``start`` / ``resume`` methods that run the client's binary once, non-interactively, in a
working directory. The scenarios below script the echo model (``plugins-contrib/ninfer-echo``) through the user
prompt, so the client really executes the scripted tool calls, and check what it did on disk and what it printed.

Between the client and ``ninfer serve`` sits a :class:`RecordingProxy`, a transparent HTTP reverse proxy that keeps
every exchange: the server logs no refused requests, and clients retry some refusals with features dropped, so the
proxy is what shows that the server accepted each request the client sent with its default settings.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Iterator, Protocol, Sequence

import attrs
import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]
INSTALL_HINT = "run tests/clients/install.sh"
CLIENT_TIMEOUT_S = 120.0  # per client process: an echo-model run takes seconds, this only turns a hang into a failure
FOREIGN_ENV_PREFIXES = ("ANTHROPIC_", "CLAUDE", "OPENAI_", "CODEX_")  # a developer's own client settings stay out


def pins() -> dict[str, str]:
    """The pinned client versions of ``pins.env`` (``KEY=VALUE`` lines, ``#`` comments)."""
    lines = (HERE / "pins.env").read_text(encoding="utf-8").splitlines()
    pairs = (line.split("=", 1) for line in lines if line.strip() and not line.lstrip().startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


# -- processes -------------------------------------------------------------------------------------------------


@attrs.frozen
class Completed:
    """A finished client process."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def describe(self, tail: int = 4000) -> str:
        command = " ".join(self.argv[:1] + tuple(arg if len(arg) < 80 else arg[:77] + "..." for arg in self.argv[1:]))
        return (f"$ {command}\nexit code {self.returncode}\n--- stdout (tail) ---\n{self.stdout[-tail:]}\n"
                f"--- stderr (tail) ---\n{self.stderr[-tail:]}")


def run_process(argv: Sequence[str | Path], cwd: Path, env: dict[str, str],
                timeout: float = CLIENT_TIMEOUT_S) -> Completed:
    """Run ``argv`` with no stdin in its own process group; a run past ``timeout`` is killed and fails the test."""
    args = tuple(str(arg) for arg in argv)
    process = subprocess.Popen(args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{Path(args[0]).name} did not finish in {timeout:.0f} s\n"
                             + Completed(args, process.returncode, stdout, stderr).describe()) from None
    finally:
        _kill_group(process.pid)  # whatever the client left running in the background (tool shells)
    return Completed(args, process.returncode, stdout, stderr)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def client_env(home: Path, **values: str) -> dict[str, str]:
    """This process's environment without any Anthropic/OpenAI/Claude/Codex settings, with ``home`` as ``HOME`` (and
    its ``tmp/`` as ``TMPDIR``, so the clients' state and scratch files stay in the test's directory), plus ``values``.
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith(FOREIGN_ENV_PREFIXES)}
    (home / "tmp").mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), "TMPDIR": str(home / "tmp"), **values}


def pinned_binary(path: Path | None, expected_version: str, name: str) -> Path:
    """``path`` when it runs and reports ``expected_version``; otherwise skip the test, saying why."""
    if path is None or not path.exists():
        pytest.skip(f"{name} is not installed ({INSTALL_HINT})")
    try:
        reported = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        pytest.skip(f"{name} at {path} does not run: {error} ({INSTALL_HINT})")
    if reported.returncode != 0 or expected_version not in reported.stdout.split():
        said = (reported.stdout.strip() or reported.stderr.strip()).splitlines()[:1]
        pytest.skip(f"{name} at {path} is not version {expected_version} (it says {said[0] if said else 'nothing'!r}, "
                    f"exit code {reported.returncode}; {INSTALL_HINT})")
    return path


# -- the recording proxy ---------------------------------------------------------------------------------------

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                        "upgrade", "content-length"})  # and the length: bodies are re-framed
NOT_FORWARDED = HOP_BY_HOP | {"host", "accept-encoding"}  # request headers httpx sets itself / the proxy replaces
EXCERPT_BYTES = 4096


@attrs.frozen
class Exchange:
    """One request through the proxy: the request body in full, the response body's start."""

    method: str
    path: str
    status: int
    request_body: bytes
    response_excerpt: bytes

    def summary(self) -> str:
        return f"{self.method} {self.path} -> {self.status}: {self.response_excerpt[:600].decode(errors='replace')}"


@attrs.define
class RecordingProxy:
    """A transparent reverse proxy on 127.0.0.1 in front of ``upstream`` that records every :class:`Exchange`.

    Responses stream through chunk by chunk (SSE included), so the client sees the server's own timing.
    """

    upstream: str
    exchanges: list[Exchange] = attrs.Factory(list)
    _lock: threading.Lock = attrs.Factory(threading.Lock)
    _http: httpx.Client = attrs.Factory(lambda: httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0)))
    _server: http.server.ThreadingHTTPServer | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None, "the proxy is not started"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> RecordingProxy:
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="recording-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        self._http.close()

    def record(self, exchange: Exchange) -> None:
        with self._lock:
            self.exchanges.append(exchange)

    def posts(self) -> list[Exchange]:
        """The model requests (every POST), in arrival order."""
        with self._lock:
            return [exchange for exchange in self.exchanges if exchange.method == "POST"]

    def refused_posts(self) -> list[Exchange]:
        return [exchange for exchange in self.posts() if exchange.status >= 400]

    def report(self) -> str:
        with self._lock:
            return "\n".join(exchange.summary() for exchange in self.exchanges) or "(no requests reached the proxy)"


def _handler_class(proxy: RecordingProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def forward(self) -> None:
            body = _read_body(self)
            headers = {key: value for key, value in self.headers.items() if key.lower() not in NOT_FORWARDED}
            headers["accept-encoding"] = "identity"  # readable excerpts (bodies pass through byte for byte anyway)
            request = proxy._http.build_request(self.command, proxy.upstream + self.path, headers=headers,
                                                content=body)
            excerpt = bytearray()
            status = 502
            try:
                response = proxy._http.send(request, stream=True)
            except httpx.HTTPError as error:
                excerpt += f"proxy: upstream failed: {error!r}".encode()
                self.send_error(502)
            else:
                status = response.status_code
                try:
                    self.relay(response, excerpt)
                finally:
                    response.close()
            finally:
                proxy.record(Exchange(self.command, self.path, status, body, bytes(excerpt)))

        def relay(self, response: httpx.Response, excerpt: bytearray) -> None:
            """Send ``response`` on; keep its body's first bytes in ``excerpt``."""
            self.send_response(response.status_code)
            for key, value in response.headers.multi_items():
                if key.lower() not in HOP_BY_HOP:
                    self.send_header(key, value)
            if self.command == "HEAD" or response.status_code in (204, 304):
                self.send_header("Content-Length", response.headers.get("content-length", "0"))
                self.end_headers()
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for chunk in response.iter_raw():
                if len(excerpt) < EXCERPT_BYTES:
                    excerpt += chunk[:EXCERPT_BYTES - len(excerpt)]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = do_PATCH = forward

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's signature
            pass

    return Handler


def _read_body(handler: http.server.BaseHTTPRequestHandler) -> bytes:
    if "chunked" in handler.headers.get("transfer-encoding", "").lower():
        body = bytearray()
        while size := int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16):
            body += handler.rfile.read(size)
            handler.rfile.readline()
        while handler.rfile.readline().strip():  # trailers up to the blank line
            pass
        return bytes(body)
    length = int(handler.headers.get("content-length") or 0)
    return handler.rfile.read(length) if length else b""


# -- echo scripts ----------------------------------------------------------------------------------------------


@attrs.frozen
class ShellTool:
    """A client's shell tool: its function name and the parameter that carries the command line."""

    name: str
    command_parameter: str

    def call(self, command: str) -> str:
        """A Qwen XML tool call of this tool running ``command``."""
        return (f"<tool_call>\n<function={self.name}>\n<parameter={self.command_parameter}>\n{command}\n"
                f"</parameter>\n</function>\n</tool_call>")


def turn(reasoning: str, answer: str) -> str:
    """One scripted assistant turn: reasoning, then the answer (text or a tool call); thinking is on by default."""
    return f"{reasoning}\n</think>\n\n{answer}"


def echo_prompt(instruction: str, *turns: str) -> str:
    """A user prompt whose echo-model replies are ``turns``, one per successive assistant turn."""
    return instruction + "\n" + "".join(f"```ninfer-echo\n{script}\n```\n" for script in turns)


# -- scenarios -------------------------------------------------------------------------------------------------


@attrs.frozen
class AgentRun:
    """One client invocation: the process, the final answer it reported and its session id (when it has one)."""

    process: Completed
    final_text: str | None
    session_id: str | None


class Agent(Protocol):
    shell: ShellTool

    def start(self, prompt: str, workdir: Path) -> AgentRun: ...

    def resume(self, previous: AgentRun, prompt: str, workdir: Path) -> AgentRun: ...


def assert_answered(run: AgentRun, answer: str, proxy: RecordingProxy) -> None:
    """The client exited 0, reported ``answer`` as its final text, and the server accepted every model request."""
    context = f"{run.process.describe()}\n--- exchanges ---\n{proxy.report()}"
    assert run.process.returncode == 0, context
    assert run.final_text == answer, context
    assert answer in run.process.stdout, context
    assert proxy.posts(), context
    assert not proxy.refused_posts(), "the server refused requests the client sent:\n" + context


def single_tool_call(agent: Agent, workdir: Path, proxy: RecordingProxy) -> None:
    answer = "hello.txt now holds the greeting."
    prompt = echo_prompt(
        "Write hello.txt.",
        turn("I write the file with the shell.", agent.shell.call("printf 'hello from the echo model\\n' > hello.txt")),
        turn("The command succeeded.", answer),
    )
    run = agent.start(prompt, workdir)
    assert_answered(run, answer, proxy)
    assert (workdir / "hello.txt").read_text() == "hello from the echo model\n"


def three_turn_tool_loop(agent: Agent, workdir: Path, proxy: RecordingProxy) -> None:
    answer = "Three commands ran in order."
    prompt = echo_prompt(
        "Build loop.txt and upper.txt.",
        turn("First line.", agent.shell.call("printf 'one\\n' > loop.txt")),
        turn("Second line.", agent.shell.call("printf 'two\\n' >> loop.txt")),
        turn("Now the upper-case copy.", agent.shell.call("tr a-z A-Z < loop.txt > upper.txt")),
        turn("All done.", answer),
    )
    run = agent.start(prompt, workdir)
    assert_answered(run, answer, proxy)
    assert (workdir / "loop.txt").read_text() == "one\ntwo\n"
    assert (workdir / "upper.txt").read_text() == "ONE\nTWO\n"  # the third command saw the first two's output
    assert len(proxy.posts()) >= 4


def second_user_turn(agent: Agent, workdir: Path, proxy: RecordingProxy) -> None:
    first_answer, second_answer = "The first file is written.", "The second file is written too."
    first = agent.start(echo_prompt(
        "Write first.txt.",
        turn("First turn.", agent.shell.call("printf 'first\\n' > first.txt")),
        turn("Written.", first_answer),
    ), workdir)
    assert_answered(first, first_answer, proxy)
    resumed_from = len(proxy.posts())
    second = agent.resume(first, echo_prompt(
        "Now write second.txt.",
        turn("Second turn.", agent.shell.call("printf 'second\\n' > second.txt")),
        turn("Written again.", second_answer),
    ), workdir)
    assert_answered(second, second_answer, proxy)
    assert (workdir / "first.txt").read_text() == "first\n"
    assert (workdir / "second.txt").read_text() == "second\n"
    continued = proxy.posts()[resumed_from:]
    assert continued and all(first_answer.encode() in exchange.request_body for exchange in continued), (
        "the second turn's requests do not carry the first turn's answer: the session was not continued")


def iter_jsonl(text: str) -> Iterator[dict]:
    """The JSON objects of a JSONL text (lines that are not JSON objects are left out)."""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
