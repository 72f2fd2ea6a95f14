"""Operability of the live server: the request-header deadline (``--header-timeout-ms``) and the API key from a file
(``--api-key-file``) or the environment (``NINFER_API_KEY``), which never reaches stderr or the request log.

The header tests run against a server with a 1 s bound and only assert that a stalled connection is closed before
a generous deadline, that other requests are answered meanwhile, and that keep-alive pauses longer than the bound
(but shorter than uvicorn's 5 s keep-alive timeout) do not close a connection.
"""

from __future__ import annotations

import http.client
import json
import re
import select
import socket
import time
from typing import Iterator

import httpx
import pytest
from click.testing import CliRunner
from live_server import ECHO_MODEL, LiveServer, echo_body, start_servers, tiny_artifact

from ninfer.cli import cli
from ninfer.core.config import ServeConfig

FILE_KEY = "sk-from-a-file-7f3a9c"
ENV_KEY = "sk-from-the-env-51d0e2"
HEADER_TIMEOUT_MS = "1000"
#: Far longer than the 1 s bound, far shorter than a stalled client would last without it.
CLOSE_DEADLINE_S = 15.0
STALLED_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LiveServer]]:
    """``file``: the 1 s header bound and the key from --api-key-file; ``env``: the key from NINFER_API_KEY. Both
    write a request log."""
    folder = tmp_path_factory.mktemp("operability")
    echo = tiny_artifact(tmp_path_factory, "echo")
    key_file = folder / "api-key"
    key_file.write_text(f"{FILE_KEY}\n", encoding="utf-8")
    common = ["--log-stats-interval-ms", "0", "--no-thinking", "--log-level", "debug"]
    file_args = ["--header-timeout-ms", HEADER_TIMEOUT_MS, "--api-key-file", str(key_file),
                 "--request-log-jsonl", str(folder / "file.jsonl"), *common]
    env_args = ["--request-log-jsonl", str(folder / "env.jsonl"), *common]
    started = start_servers(folder, [(echo, file_args, {}), (echo, env_args, {"NINFER_API_KEY": ENV_KEY})],
                            [ECHO_MODEL, ECHO_MODEL])
    yield {"file": started[0], "env": started[1]}
    for server in started:
        server.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def connect(server: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=CLOSE_DEADLINE_S)


def closed_by_server(sock: socket.socket, within_s: float = CLOSE_DEADLINE_S) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``within_s`` without sending anything."""
    sock.settimeout(within_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def read_response(sock: socket.socket) -> bytes:
    """One whole HTTP/1.1 response with a Content-Length body (the status line onward)."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(next(value for name, value in fields.items() if name.lower() == b"content-length"))
    while len(body) < length:
        body += sock.recv(4096)
    assert len(body) == length, "a second response arrived unasked"
    return head


def assert_other_requests_answer(server: LiveServer) -> None:
    assert httpx.get(server.url("/v1/models"), headers=bearer(FILE_KEY), timeout=10).status_code == 200


# -- the header deadline -----------------------------------------------------------------------------------------


def test_a_silent_connection_is_closed(servers):
    with connect(servers["file"]) as sock:
        assert_other_requests_answer(servers["file"])
        assert closed_by_server(sock)


def test_headers_that_stop_midway_are_closed(servers):
    with connect(servers["file"]) as sock:
        sock.sendall(STALLED_HEAD)
        assert_other_requests_answer(servers["file"])
        assert closed_by_server(sock)


def trickle_until_closed(sock: socket.socket, interval_s: float = 0.25) -> bool:
    """Send one header byte every ``interval_s`` (each well inside the bound, so an idle timer would never fire)
    and report whether the server closed the connection before :data:`CLOSE_DEADLINE_S`."""
    sock.sendall(STALLED_HEAD + b"X-Pad: ")
    started = time.monotonic()
    while time.monotonic() - started < CLOSE_DEADLINE_S:
        try:
            sock.sendall(b"a")
        except (BrokenPipeError, ConnectionResetError):
            return True
        readable, _, _ = select.select([sock], [], [], interval_s)
        if readable:
            try:
                data = sock.recv(1024)
            except ConnectionResetError:
                return True
            assert data == b"", f"the server answered a request whose headers never ended: {data!r}"
            return True
    return False


def test_a_trickling_client_is_closed(servers):
    with connect(servers["file"]) as sock:
        assert trickle_until_closed(sock)
    assert_other_requests_answer(servers["file"])


def test_a_keep_alive_request_that_trickles_is_closed(servers):
    """The deadline is armed again for each request on a kept-alive connection."""
    with connect(servers["file"]) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        assert trickle_until_closed(sock)


def test_a_body_that_stalls_is_answered_408_and_closed(servers):
    """Headers complete, then 10 of the 200 declared body bytes and silence: 408 in the OpenAI error shape once the
    body has paused for the bound, then the connection closes; the server keeps serving."""
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + FILE_KEY.encode() + b"\r\nContent-Length: 200\r\n\r\n")
    with connect(servers["file"]) as sock:
        sock.sendall(head + b'{"model": ')
        sock.settimeout(CLOSE_DEADLINE_S)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
        status, _, rest = data.partition(b"\r\n")
        assert status.startswith(b"HTTP/1.1 408"), data[:300]
        error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "request_timeout" and "--header-timeout-ms" in error["message"]
        assert closed_by_server(sock)
    assert_other_requests_answer(servers["file"])


def test_keep_alive_pauses_longer_than_the_bound_keep_the_connection(servers):
    """Idle time between requests is keep-alive time (uvicorn's 5 s), not header time: pauses of twice the bound,
    and a next request whose headers arrive in two parts, reuse one connection."""
    server = servers["file"]
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.request("GET", "/v1/models", headers=bearer(FILE_KEY))
        response = connection.getresponse()
        assert response.status == 200 and json.loads(response.read())["data"][0]["id"] == ECHO_MODEL
        sock = connection.sock
        for _ in range(2):
            time.sleep(2.0)
            connection.request("GET", "/v1/models", headers=bearer(FILE_KEY))
            response = connection.getresponse()
            assert response.status == 200
            response.read()
            assert connection.sock is sock
    finally:
        connection.close()
    with connect(server) as raw:
        raw.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(raw).startswith(b"HTTP/1.1 200")
        time.sleep(2.0)
        raw.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.3)
        raw.sendall(b"Host: x\r\n\r\n")
        assert read_response(raw).startswith(b"HTTP/1.1 200")


# -- the API key from a file or the environment ------------------------------------------------------------------


@pytest.mark.parametrize(("name", "key"), [("file", FILE_KEY), ("env", ENV_KEY)])
def test_the_key_from_a_file_or_the_environment_is_required(servers, name, key):
    server = servers[name]
    assert httpx.get(server.url("/v1/models")).status_code == 401
    assert httpx.get(server.url("/v1/models"), headers=bearer("wrong")).status_code == 401
    assert httpx.get(server.url("/v1/models"), headers=bearer(key)).status_code == 200
    assert httpx.get(server.url("/v1/models"), headers={"x-api-key": key}).status_code == 200
    completion = httpx.post(server.url("/v1/chat/completions"), json=echo_body("hello"), headers=bearer(key),
                            timeout=60)
    assert completion.status_code == 200 and completion.json()["choices"][0]["message"]["content"] == "hello"


@pytest.mark.parametrize(("name", "key", "source"), [("file", FILE_KEY, "--api-key-file"),
                                                     ("env", ENV_KEY, "NINFER_API_KEY")])
def test_the_key_never_reaches_stderr_or_the_request_log(servers, name, key, source):
    server = servers[name]
    assert httpx.post(server.url("/v1/chat/completions"), json=echo_body("hi"), headers=bearer(key),
                      timeout=60).status_code == 200
    assert httpx.get(server.url("/v1/models"), headers=bearer(key + "x")).status_code == 401
    stderr = server.wait_for_log(lambda text: re.search(r"request \S+ openai_chat done", text) is not None)
    assert f"API key required (from {source})" in stderr
    log_path = server.log_path.parent / f"{name}.jsonl"
    records = [json.loads(line) for line in log_path.read_text(encoding="utf-8").splitlines()]
    assert {"server_start", "request_start", "request_done"} <= {record["event"] for record in records}
    for text in (stderr, log_path.read_text(encoding="utf-8")):
        assert key not in text
    argv = next(record for record in records if record["event"] == "server_start")["argv"]
    if name == "file":  # the path is fine to record, the key is not
        assert argv[argv.index("--api-key-file") + 1].endswith("api-key")
    else:
        assert not any("NINFER_API_KEY" in arg for arg in argv)


# -- startup errors and precedence -------------------------------------------------------------------------------


def serve(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["serve", *args], env={"NINFER_API_KEY": None, **(env or {})})
    return result.exit_code, result.stdout, result.stderr


def assert_startup_error(args: list[str], expected: str, env: dict[str, str] | None = None) -> None:
    status, stdout, stderr = serve(*args, env=env)
    assert status == 2 and stdout == "", stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0], stderr
    assert "Traceback" not in stderr


def test_both_key_flags_are_a_usage_error(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(FILE_KEY)
    assert_startup_error(["--api-key", "other-key", "--api-key-file", str(key_file)], "mutually exclusive")
    assert_startup_error(["--api-key-file", str(key_file), "--api-key", "other-key"], "mutually exclusive")


@pytest.mark.parametrize(("content", "expected"), [("", "is empty"), (" \n\n", "is empty"),
                                                   (f"{FILE_KEY}\nsecond line\n", "single line")])
def test_an_empty_or_multi_line_key_file_is_a_startup_error(tmp_path, content, expected):
    key_file = tmp_path / "key"
    key_file.write_text(content)
    assert_startup_error(["--api-key-file", str(key_file)], expected)
    status, _, stderr = serve("--api-key-file", str(key_file))
    assert FILE_KEY not in stderr and str(key_file) in stderr


def test_an_unreadable_key_file_is_a_startup_error(tmp_path):
    assert_startup_error(["--api-key-file", str(tmp_path / "missing")], "no such file")
    assert_startup_error(["--api-key-file", str(tmp_path)], "is a directory")


def test_an_empty_environment_key_is_a_startup_error():
    assert_startup_error([], "NINFER_API_KEY", env={"NINFER_API_KEY": "  "})


def test_the_file_key_is_stripped_and_the_flags_win_over_the_environment(tmp_path, registries):
    key_file = tmp_path / "key"
    key_file.write_text(f"  {FILE_KEY} \r\n")
    environ = {"NINFER_API_KEY": ENV_KEY}
    from_file = ServeConfig.build(registries, api_key_file=str(key_file), environ=environ)
    assert (from_file.api_key, from_file.api_key_source) == (FILE_KEY, "--api-key-file")
    from_flag = ServeConfig.build(registries, api_key="flag-key", environ=environ)
    assert (from_flag.api_key, from_flag.api_key_source) == ("flag-key", "--api-key")
    from_env = ServeConfig.build(registries, environ=environ)
    assert (from_env.api_key, from_env.api_key_source) == (ENV_KEY, "NINFER_API_KEY")
    assert ServeConfig.build(registries).api_key is None  # no environ given: the process environment is not read
    printed = json.loads(serve("--print-config", env=environ)[1])
    assert (printed["api_key"], printed["api_key_source"]) == ("<redacted>", "NINFER_API_KEY")
    assert ENV_KEY not in json.dumps(printed) and FILE_KEY not in repr(from_file)


def test_print_config_shows_the_header_bound():
    assert json.loads(serve("--print-config")[1])["header_timeout_ms"] == 10000
    assert json.loads(serve("--print-config", "--header-timeout-ms", "250")[1])["header_timeout_ms"] == 250
    assert_startup_error(["--header-timeout-ms", "0"], "--header-timeout-ms")
