"""A short soak: several clients send mixed traffic (Chat, Responses with a stored-response chain, Messages,
both token counts, streamed and not, with tool calls) to one server subprocess. Every answer must be a 200 whose
stream ends properly, and the server's resident memory (``VmRSS``), measured after a warm-up phase, may grow by
less than ``RSS_GROWTH_BOUND``.

CI runs ``SOAK_SECONDS`` (default 45 s, of which the first ``WARMUP_SECONDS`` are warm-up); lengthen it locally
with ``NINFER_SOAK_SECONDS=600 pytest tests/reliability/test_soak.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from live_server import ECHO_MODEL, LiveServer, start_servers, words
from reliability_support import (
    WEATHER_SCHEMA,
    answer_problems,
    healthy,
    read_request_log,
    rss_kib,
    send_raw,
)

SOAK_SECONDS = float(os.environ.get("NINFER_SOAK_SECONDS", "45"))
WARMUP_SECONDS = min(12.0, SOAK_SECONDS / 3)
CLIENTS = 4
RSS_GROWTH_BOUND = 0.15
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
JSON = {"content-type": "application/json"}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(echo_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("soak")
    args = ["--max-concurrency", "2", "--max-pending-requests", "8", "--no-thinking", "--default-max-tokens", "64",
            "--max-context", "2048", "--response-store-max-records", "16", "--log-stats-interval-ms", "1000",
            "--request-log-jsonl", str(folder / "requests.jsonl")]
    [live] = start_servers(folder, [(echo_artifact, args, {})], [ECHO_MODEL])
    yield live, folder / "requests.jsonl"
    live.stop()


def fence(script: str) -> str:
    return f"Please answer.\n```ninfer-echo\n{script}\n```\n"


Request = tuple[str, dict[str, Any]]


def traffic(n: int) -> list[Request]:
    """The ``n``-th unit of traffic (prompt lengths vary with ``n``); a Responses chain is two requests."""
    text = words(5 + n % 60)
    chat_tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}]
    kinds: list[Callable[[], list[Request]]] = [
        lambda: [("/v1/chat/completions", {"model": ECHO_MODEL, "messages": [{"role": "user", "content": text}]})],
        lambda: [("/v1/chat/completions", {"model": ECHO_MODEL, "stream": True, "tools": chat_tools,
                                           "stream_options": {"include_usage": True},
                                           "messages": [{"role": "user", "content": fence(f"{text}\n\n{CALL}")}]})],
        lambda: [("/v1/responses", {"model": ECHO_MODEL, "input": text, "store": True, "max_output_tokens": 16})],
        lambda: [("/v1/responses", {"model": ECHO_MODEL, "stream": True, "store": False, "instructions": "Be brief.",
                                    "tools": [{"type": "function", "name": "get_weather",
                                               "parameters": WEATHER_SCHEMA}],
                                    "input": [{"role": "user", "content": fence(CALL)}]})],
        lambda: [("/v1/messages", {"model": "claude-local", "max_tokens": 32, "system": "Be brief.",
                                   "tools": [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}],
                                   "messages": [{"role": "user", "content": fence(f"{text}\n\n{CALL}")}]})],
        lambda: [("/v1/messages", {"model": "claude-local", "max_tokens": 32, "stream": True,
                                   "messages": [{"role": "user", "content": text}]})],
        lambda: [("/v1/messages/count_tokens", {"model": "claude-local",
                                                "messages": [{"role": "user", "content": text}]})],
        lambda: [("/v1/responses/input_tokens", {"model": ECHO_MODEL, "input": text})],
    ]
    return kinds[n % len(kinds)]()


def client_loop(server: LiveServer, client_index: int, stop: threading.Event, sent: Counter,
                errors: list[str], lock: threading.Lock) -> None:
    with httpx.Client(timeout=120) as client:
        for n in itertools.count(client_index * 7):
            if stop.is_set():
                return
            previous: str | None = None
            for path, body in traffic(n):
                try:
                    answer = send_raw(server, path, json.dumps(body).encode(), JSON, client=client)
                    problems = answer_problems(path, answer)
                    if answer.status != 200:
                        problems.append(f"HTTP {answer.status}: {answer.text[:300]}")
                except httpx.HTTPError as exc:
                    problems = [f"{type(exc).__name__}: {exc}"]
                with lock:
                    sent[path + (" stream" if body.get("stream") else "")] += 1
                    errors.extend(f"{path}: {problem}" for problem in problems)
                if path == "/v1/responses" and body.get("store") and not problems:
                    previous = json.loads(answer.text)["id"]
            if previous is not None:  # continue the stored Response once
                body = {"model": ECHO_MODEL, "previous_response_id": previous, "input": "and then?", "store": False,
                        "max_output_tokens": 8}
                answer = send_raw(server, "/v1/responses", json.dumps(body).encode(), JSON, client=client)
                with lock:
                    sent["/v1/responses (previous_response_id)"] += 1
                    errors.extend(f"chain: {p}" for p in answer_problems("/v1/responses", answer))
                    if answer.status != 200:
                        errors.append(f"chain: HTTP {answer.status}: {answer.text[:300]}")


def run_traffic(server: LiveServer, seconds: float) -> tuple[Counter, list[str]]:
    stop, lock = threading.Event(), threading.Lock()
    sent: Counter = Counter()
    errors: list[str] = []
    with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
        futures = [pool.submit(client_loop, server, index, stop, sent, errors, lock) for index in range(CLIENTS)]
        time.sleep(seconds)
        stop.set()
        for future in futures:
            future.result(timeout=120)
    return sent, errors


def test_mixed_traffic_has_no_errors_and_bounded_memory(server) -> None:
    live, log = server
    pid = live.process.pid
    warm_sent, warm_errors = run_traffic(live, WARMUP_SECONDS)
    assert not warm_errors, warm_errors[:10]
    before = rss_kib(pid)
    sent, errors = run_traffic(live, SOAK_SECONDS - WARMUP_SECONDS)
    after = rss_kib(pid)
    assert not errors, f"{len(errors)} errors of {sum(sent.values())} requests: {errors[:10]}"
    assert len(sent) == 9 and min(sent.values()) >= 3, sent  # every kind of traffic ran
    growth = (after - before) / before
    assert growth < RSS_GROWTH_BOUND, f"VmRSS grew {growth:.1%}: {before} -> {after} KiB over {sum(sent.values())} " \
                                      f"requests after a warm-up of {sum(warm_sent.values())}"
    assert healthy(live)
    generations = sum(count for path, count in (sent + warm_sent).items()
                      if not path.endswith(("/count_tokens", "/input_tokens")))
    deadline = time.monotonic() + 30
    while True:  # every generation request has its start and exactly one request_done terminal
        events = Counter(record["event"] for record in read_request_log(log))
        if events["request_done"] >= generations or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (events["request_start"], events["request_done"]) == (generations, generations), events
    assert events["request_rejected"] == events["request_error"] == 0, events
