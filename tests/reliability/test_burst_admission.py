"""A burst beyond the lifetime capacity: ``--max-concurrency 2 --max-pending-requests 4`` admits exactly 6 of 30
concurrent requests (Chat, Responses and Messages, streaming and not); every other one is refused at once in its
protocol's overload shape (OpenAI 429 ``server_overloaded``, Anthropic 529 ``overloaded_error``) with a
``Retry-After`` header; the admitted ones complete; afterwards the server is healthy and its whole capacity is free.

The echo model sleeps 100 ms per forward (``NINFER_ECHO_DELAY_MS``), so each admitted request holds its capacity for
seconds while the 30 requests, released together by a barrier, all arrive.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

from live_server import ECHO_MODEL, LiveServer, start_servers, words
from reliability_support import (
    Answer,
    answer_problems,
    error_shape_problems,
    healthy,
    protocol_of,
    retry_after_problems,
    send_raw,
)

CONCURRENCY, PENDING = 2, 4
CAPACITY = CONCURRENCY + PENDING
BURST = 30
OUTPUT_TOKENS = 24  # x 100 ms per decode round: each admitted request holds its place for seconds


@pytest.fixture(scope="module")
def server(echo_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    args = ["--max-concurrency", str(CONCURRENCY), "--max-pending-requests", str(PENDING), "--no-thinking",
            "--prefill-chunk", "64", "--default-max-tokens", "512", "--log-stats-interval-ms", "0"]
    [live] = start_servers(tmp_path_factory.mktemp("burst"), [(echo_artifact, args, {"NINFER_ECHO_DELAY_MS": "100"})],
                           [ECHO_MODEL])
    yield live
    live.stop()


def request(index: int, max_tokens: int = OUTPUT_TOKENS) -> tuple[str, dict[str, Any]]:
    """The ``index``-th request of a burst: Chat, Responses, Messages in turn, every other one streamed."""
    stream = index % 2 == 1
    text = words(40)
    kind = index % 3
    if kind == 0:
        return "/v1/chat/completions", {"model": ECHO_MODEL, "max_tokens": max_tokens, "stream": stream,
                                        "messages": [{"role": "user", "content": text}]}
    if kind == 1:
        return "/v1/responses", {"model": ECHO_MODEL, "max_output_tokens": max_tokens, "stream": stream,
                                 "store": False, "input": text}
    return "/v1/messages", {"model": "claude-local", "max_tokens": max_tokens, "stream": stream,
                            "messages": [{"role": "user", "content": text}]}


@attrs.frozen
class Sent:
    path: str
    body: dict[str, Any]
    answer: Answer


def fire(server: LiveServer, count: int, max_tokens: int = OUTPUT_TOKENS) -> list[Sent]:
    """Send ``count`` requests at once (one client each, released by a barrier) and collect every answer."""
    clients = [httpx.Client(timeout=120) for _ in range(count)]
    barrier = threading.Barrier(count)

    def send(index: int) -> Sent:
        path, body = request(index, max_tokens)
        barrier.wait(30)
        return Sent(path, body, send_raw(server, path, json.dumps(body).encode(), {"content-type": "application/json"},
                                         client=clients[index]))

    try:
        with ThreadPoolExecutor(max_workers=count) as pool:
            return list(pool.map(send, range(count)))
    finally:
        for client in clients:
            client.close()


@pytest.fixture(scope="module")
def burst(server: LiveServer) -> list[Sent]:
    return fire(server, BURST)


def is_refusal(sent: Sent) -> bool:
    return sent.answer.status in (429, 529)


def test_exactly_the_capacity_is_admitted_and_completes(burst: list[Sent]) -> None:
    statuses = Counter(sent.answer.status for sent in burst)
    assert statuses[200] == CAPACITY, statuses
    assert statuses[200] + sum(1 for sent in burst if is_refusal(sent)) == BURST, statuses
    for sent in burst:
        if sent.answer.status == 200:
            assert answer_problems(sent.path, sent.answer) == [], (sent.path, sent.body)
            if sent.answer.sse_lines is None:
                usage = json.loads(sent.answer.text)["usage"]
                produced = usage.get("completion_tokens", usage.get("output_tokens"))
                assert produced == OUTPUT_TOKENS, (sent.path, usage)


def test_refusals_have_their_protocol_overload_shape(burst: list[Sent]) -> None:
    refused = [sent for sent in burst if is_refusal(sent)]
    assert {protocol_of(sent.path) for sent in refused} == {"openai", "anthropic"}  # 10 of each kind, 6 admitted
    for sent in refused:
        answer = sent.answer
        assert error_shape_problems(protocol_of(sent.path), answer) == [], (sent.path, answer.status, answer.text)
        error = json.loads(answer.text)["error"]
        if protocol_of(sent.path) == "anthropic":
            assert (answer.status, error["type"]) == (529, "overloaded_error"), answer.text
        else:
            assert (answer.status, error["code"], error["type"]) == (429, "server_overloaded", "server_error"), \
                answer.text


def test_refusals_carry_retry_after(burst: list[Sent]) -> None:
    problems = {(sent.path, sent.answer.status, problem)
                for sent in burst if is_refusal(sent) for problem in retry_after_problems(sent.answer.headers)}
    assert not problems, sorted(problems)


def test_capacity_is_free_after_the_burst(server: LiveServer, burst: list[Sent]) -> None:
    """Exactly the capacity at once is admitted in full (a request's place is released just after its answer, so
    a refusal is retried a few times; a leaked place refuses every time)."""
    assert healthy(server)
    for _ in range(5):
        again = fire(server, CAPACITY, max_tokens=2)
        if all(sent.answer.status == 200 for sent in again):
            break
        time.sleep(0.5)
    assert [sent.answer.status for sent in again] == [200] * CAPACITY, [sent.answer.text[:200] for sent in again]
    assert all(answer_problems(sent.path, sent.answer) == [] for sent in again)
