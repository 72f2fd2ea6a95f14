"""A disconnect storm: 100 streams (Chat, Responses, Messages in turn) each closed right after its first event,
while the echo model would keep decoding for seconds. Afterwards the server must be back where it started:

- the request log has exactly one ``request_start`` and one terminal for each of them, a ``request_done`` whose
  finish reason is ``cancelled``;
- the engine is idle: the throughput reporter goes quiet (it reports every interval in which anything is
  outstanding or any counter moved), and its last record shows nothing running or waiting, no promised KV pages,
  every KV page either free or held by a retained checkpoint, and no more checkpoints than the checkpoint slots;
- the server process's thread and open-descriptor counts are back to their warmed-up baseline (small tolerance);
- ``/health`` is 200 and a new request completes.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from live_server import ECHO_MODEL, LiveServer, start_servers, words
from reliability_support import fd_count, healthy, read_request_log, thread_count

STREAMS = 100
WORKERS = 4
STATS_INTERVAL_MS = 200
QUIET_S = 1.5  # several reporter intervals without a record: nothing outstanding, nothing moved
SETTLE_DEADLINE_S = 60.0
THREAD_TOLERANCE = 4
FD_TOLERANCE = 4


@pytest.fixture(scope="module")
def server(echo_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("storm")
    log = folder / "requests.jsonl"
    args = ["--max-concurrency", "4", "--max-pending-requests", "12", "--no-thinking", "--prefill-chunk", "64",
            "--default-max-tokens", "512", "--request-log-jsonl", str(log),
            "--log-stats-interval-ms", str(STATS_INTERVAL_MS)]
    [live] = start_servers(folder, [(echo_artifact, args, {"NINFER_ECHO_DELAY_MS": "20"})], [ECHO_MODEL])
    yield live, log
    live.stop()


def stream_request(index: int) -> tuple[str, dict[str, Any], str]:
    """Path, body and request-id header name of the ``index``-th stream (~400 output tokens if left running)."""
    text = words(50)
    kind = index % 3
    if kind == 0:
        return "/v1/chat/completions", {"model": ECHO_MODEL, "stream": True, "max_tokens": 400,
                                        "messages": [{"role": "user", "content": text}]}, "x-request-id"
    if kind == 1:
        return "/v1/responses", {"model": ECHO_MODEL, "stream": True, "max_output_tokens": 400, "store": False,
                                 "input": text}, "x-request-id"
    return "/v1/messages", {"model": "claude-local", "stream": True, "max_tokens": 400,
                            "messages": [{"role": "user", "content": text}]}, "request-id"


def open_and_drop(client: httpx.Client, server: LiveServer, index: int) -> str:
    """Open one stream, read its first event, close the connection; the request's id."""
    path, body, header = stream_request(index)
    with client.stream("POST", server.url(path), json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
        return response.headers[header]


def storm(server: LiveServer, count: int) -> list[str]:
    def worker(offset: int) -> list[str]:
        with httpx.Client(timeout=60) as client:
            return [open_and_drop(client, server, index) for index in range(offset, count, WORKERS)]

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return [request_id for ids in pool.map(worker, range(WORKERS)) for request_id in ids]


def wait_until(condition: Callable[[], bool], what: Callable[[], str], deadline_s: float = SETTLE_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not settled within {deadline_s:.0f} s: {what()}")
        time.sleep(0.1)


def reporter_quiet(log: Path) -> bool:
    """True once no throughput record was written for ``QUIET_S`` (the file's last record time is in the past)."""
    records = [record for record in read_request_log(log) if record["event"] == "throughput"]
    last_ms = records[-1]["timestamp_unix_ms"] if records else 0
    return time.time() * 1000 - last_ms > QUIET_S * 1000


def terminals_of(log: Path, request_ids: list[str]) -> dict[str, list[str]]:
    """For each http request id, the request-log events recorded for it, in order."""
    events: dict[str, list[str]] = {request_id: [] for request_id in request_ids}
    for record in read_request_log(log):
        if record.get("http_request_id") in events:
            finish = record.get("result", {}).get("finish_reason") if record["event"] == "request_done" else None
            events[record["http_request_id"]].append(record["event"] + (f":{finish}" if finish else ""))
    return events


def test_a_disconnect_storm_leaves_the_server_as_it_was(server) -> None:
    live, log = server
    pid = live.process.pid
    warm_ids = storm(live, 12)  # grows the thread pools and the context cache to their working size
    wait_until(lambda: all(len(events) == 2 for events in terminals_of(log, warm_ids).values()),
               lambda: str(terminals_of(log, warm_ids)))
    wait_until(lambda: reporter_quiet(log), lambda: "the throughput reporter keeps reporting after the warm-up")
    baseline_threads, baseline_fds = thread_count(pid), fd_count(pid)

    request_ids = storm(live, STREAMS)
    assert len(set(request_ids)) == STREAMS

    expected = {"request_start", "request_done:cancelled"}
    wait_until(lambda: all(len(events) >= 2 for events in terminals_of(log, request_ids).values()),
               lambda: str({key: value for key, value in terminals_of(log, request_ids).items() if len(value) < 2}))
    wait_until(lambda: reporter_quiet(log), lambda: "the throughput reporter keeps reporting: something is outstanding")
    wait_until(lambda: thread_count(pid) <= baseline_threads + THREAD_TOLERANCE
               and fd_count(pid) <= baseline_fds + FD_TOLERANCE,
               lambda: f"threads {thread_count(pid)} (baseline {baseline_threads}), open descriptors {fd_count(pid)} "
                       f"(baseline {baseline_fds}): {sorted(Path(f'/proc/{pid}/fd').iterdir())[-8:]}")

    events = terminals_of(log, request_ids)
    wrong = {key: value for key, value in events.items() if value != ["request_start", "request_done:cancelled"]}
    assert not wrong, f"{len(wrong)} streams without exactly one start and one cancelled terminal: {wrong}"
    assert all(set(value) == expected for value in events.values())

    records = read_request_log(log)
    slots = next(r for r in records if r["event"] == "server_start")["capacities"]["device_state_slots"]
    last = [record for record in records if record["event"] == "throughput"][-1]
    scheduler, occupancy = last["scheduler"], last["context_cache"]["occupancy"]
    assert (scheduler["running"], scheduler["prefilling"], scheduler["decode_ready"], scheduler["waiting"]) \
        == (0, 0, 0, 0), last
    assert occupancy["promised_pages"] == 0, occupancy
    assert occupancy["free_pages"] + occupancy["checkpoint_pages"] == occupancy["total_pages"], occupancy
    assert occupancy["checkpoints"] <= slots, occupancy

    assert healthy(live)
    done = httpx.post(live.url("/v1/chat/completions"), timeout=60,
                      json={"model": ECHO_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": words(5)}]})
    assert done.status_code == 200 and json.loads(done.text)["choices"][0]["finish_reason"] == "length"
