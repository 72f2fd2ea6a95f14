"""``kill -9`` under load, then a restart on the same ``--request-log-jsonl`` file (and the same port).

The killed server leaves a request log of complete JSON lines (at most a partial last line, which readers skip:
docs/request-log.md); the restarted server starts cleanly, serves, and appends its own records after the old ones,
under a new ``server_instance_id``. A crash that does leave a partial last line must not corrupt the next run's
first record either.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import httpx

from live_server import ECHO_MODEL, LiveServer, start_servers, words
from reliability_support import healthy, read_request_log

LOAD_CLIENTS = 4
KILL_AFTER_DONE = 12  # request_done records written before the kill: the server is mid-load


def server_args(log: Path) -> list[str]:
    return ["--max-concurrency", "2", "--max-pending-requests", "8", "--no-thinking", "--default-max-tokens", "64",
            "--request-log-jsonl", str(log), "--log-stats-interval-ms", "100"]


def load(server: LiveServer, stop: threading.Event, index: int) -> int:
    """Streamed and plain requests until ``stop``; connection failures (the kill) end nothing but the request."""
    answered = 0
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            body = {"model": ECHO_MODEL, "max_tokens": 24, "stream": index % 2 == 0,
                    "messages": [{"role": "user", "content": words(30 + answered % 20)}]}
            try:
                with client.stream("POST", server.url("/v1/chat/completions"), json=body) as response:
                    response.read()
                answered += 1
            except httpx.HTTPError:
                if server.process.poll() is not None:
                    return answered
    return answered


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s"
        time.sleep(0.05)


def events_of(log: Path) -> list[str]:
    return [record["event"] for record in read_request_log(log)]


def test_sigkill_under_load_then_restart_on_the_same_log(echo_artifact: Path, tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    [first] = start_servers(tmp_path, [(echo_artifact, server_args(log), {"NINFER_ECHO_DELAY_MS": "5"})],
                            [ECHO_MODEL])
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=LOAD_CLIENTS)
    try:
        clients = [pool.submit(load, first, stop, index) for index in range(LOAD_CLIENTS)]
        wait_for(lambda: events_of(log).count("request_done") >= KILL_AFTER_DONE, timeout=60)
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL  # while the clients keep sending
        stop.set()
        answered = sum(client.result(timeout=60) for client in clients)
    finally:
        stop.set()
        first.stop(signal.SIGKILL)
        pool.shutdown(wait=True)
    assert answered >= 1
    killed = read_request_log(log)  # every line but a partial last one is one complete JSON object
    assert killed[0]["event"] == "server_start"
    assert {record["server_instance_id"] for record in killed} == {killed[0]["server_instance_id"]}
    assert [record["event"] for record in killed].count("request_start") >= KILL_AFTER_DONE

    [second] = start_servers(tmp_path, [(echo_artifact, server_args(log), {})], [ECHO_MODEL], ports=[first.port])
    try:
        body = {"model": ECHO_MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": words(8)}]}
        reply = httpx.post(second.url("/v1/chat/completions"), json=body, timeout=60)
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == words(3)
        assert healthy(second)
        wait_for(lambda: "request_done" in events_of(log)[len(killed):])
    finally:
        assert second.stop() == 0
    startup = second.log()
    assert " INFO ready: serving " in startup and " ERROR " not in startup and "Traceback" not in startup, startup

    records = read_request_log(log)
    assert records[:len(killed)] == killed  # the old records are kept as they were
    appended = records[len(killed):]
    assert appended[0]["event"] == "server_start"
    assert appended[0]["server_instance_id"] != killed[0]["server_instance_id"]
    assert {record["server_instance_id"] for record in appended} == {appended[0]["server_instance_id"]}
    done = [record for record in appended if record["event"] == "request_done"]
    assert len(done) == 1 and done[0]["result"]["completion_tokens"] == 3
    assert log.read_bytes().endswith(b"\n")  # a clean stop leaves no partial line


def test_a_partial_last_line_does_not_swallow_the_next_runs_first_record(echo_artifact: Path, tmp_path: Path) -> None:
    """A crash mid-write leaves a record without its line feed (written here, as a kill cannot be aimed at one
    write). Readers skip it while it is last; after a restart it must still be the only line lost."""
    log = tmp_path / "requests.jsonl"
    complete = {"schema": "ninfer_serve_request_log", "event": "throughput", "server_instance_id": "0" * 32}
    log.write_bytes(json.dumps(complete).encode() + b"\n" + b'{"schema":"ninfer_serve_request_log","event":"requ')
    assert read_request_log(log) == [complete]  # the partial last line is skipped
    [server] = start_servers(tmp_path, [(echo_artifact, server_args(log), {})], [ECHO_MODEL])
    try:
        assert healthy(server)
    finally:
        assert server.stop() == 0
    partial = b'{"schema":"ninfer_serve_request_log","event":"requ'
    unreadable, records = [], []
    for line in filter(None, log.read_bytes().split(b"\n")):
        try:
            records.append(json.loads(line))
        except ValueError:
            unreadable.append(line)
    assert unreadable in ([], [partial]), \
        f"the restarted server's first record was appended to the partial line: {unreadable[0][:150]!r}..."
    assert records[0] == complete and [record["event"] for record in records[1:2]] == ["server_start"], records[:2]
