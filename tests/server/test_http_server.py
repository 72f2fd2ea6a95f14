"""The live HTTP server (``ninfer serve`` as a subprocess): health, models, auth, CORS, body limit, request ids,
admission overload, cancellation on client disconnect, SSE keep-alive and graceful shutdown.

The slow-path tests use the echo model family (``plugins-contrib/ninfer-echo``) with ``NINFER_ECHO_DELAY_MS``
so that waiting, prefilling and decoding are observable without timing assertions. The live-server helpers are in
``live_server.py``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Sequence

import httpx
import openai
import pytest

from ninfer.core.plugins import load_plugin_manager

from live_server import API_KEY, ECHO_MODEL, LiveServer, free_port, sse_data, start_servers, tiny_artifact, words

# -- fixtures ----------------------------------------------------------------------------------------------------

SLOW_DELAY_MS = "100"
def first_content_line(lines: Sequence[str]) -> int:
    return next(i for i, line in enumerate(lines) if '"content":"' in line and '"content":""' not in line)


@pytest.fixture(scope="module")
def echo_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_artifact(tmp_path_factory, "echo")


@pytest.fixture(scope="module")
def secured(echo_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    """API key, CORS, a 1 MiB body limit, capacity 1 active + 1 pending, a slow echo model, an alias model id."""
    args = ["--api-key", API_KEY, "--cors", "--max-request-mib", "1", "--max-concurrency", "1",
            "--max-pending-requests", "1", "--prefill-chunk", "64", "--model-id", "alias-model", "--no-thinking",
            "--default-max-tokens", "512"]
    [server] = start_servers(tmp_path_factory.mktemp("secured"), [(echo_artifact, args, {"NINFER_ECHO_DELAY_MS": SLOW_DELAY_MS})],
                             ["alias-model"])
    yield server
    server.stop()


def auth_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


# -- health, models, request ids ---------------------------------------------------------------------------------


def test_health_is_open_and_models_list_the_alias(secured):
    health = httpx.get(secured.url("/health"))
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert re.fullmatch(r"req-[0-9a-f]{24}", health.headers["x-request-id"])
    client = secured.client(API_KEY)
    models = client.models.list()
    assert [model.id for model in models.data] == ["alias-model"]
    assert models.data[0].max_model_len == 8192
    assert client.models.retrieve("alias-model").id == "alias-model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve(ECHO_MODEL)
    assert missing.value.body["code"] == "model_not_found"


def test_chat_uses_the_alias_and_rejects_the_artifact_id(secured):
    client = secured.client(API_KEY)
    completion = client.chat.completions.create(model="alias-model", messages=[{"role": "user", "content": "hi"}])
    assert completion.model == "alias-model" and completion.choices[0].message.content == "hi"
    with pytest.raises(openai.NotFoundError) as wrong:
        client.chat.completions.create(model=ECHO_MODEL, messages=[{"role": "user", "content": "hi"}])
    assert wrong.value.body["code"] == "model_not_found" and wrong.value.body["param"] == "model"


def test_every_response_carries_a_unique_request_id(secured):
    ok = httpx.post(secured.url("/v1/chat/completions"), headers=auth_headers(),
                    json={"model": "alias-model", "messages": [{"role": "user", "content": "a"}], "max_tokens": 1})
    bad = httpx.post(secured.url("/v1/chat/completions"), headers=auth_headers(), json={"model": "alias-model"})
    unauthorized = httpx.get(secured.url("/v1/models"))
    unknown = httpx.get(secured.url("/v1/nothing-here"), headers=auth_headers())
    with httpx.stream("POST", secured.url("/v1/chat/completions"), headers=auth_headers(),
                      json={"model": "alias-model", "messages": [{"role": "user", "content": "a"}], "stream": True}) as stream:
        stream.read()
    assert [r.status_code for r in (ok, bad, unauthorized, unknown, stream)] == [200, 400, 401, 404, 200]
    ids = [r.headers["x-request-id"] for r in (ok, bad, unauthorized, unknown, stream)]
    assert all(re.fullmatch(r"req-[0-9a-f]{24}", value) for value in ids) and len(set(ids)) == len(ids)


def test_finished_requests_reach_request_finished_plugins(secured):
    if "prometheus_metrics" not in load_plugin_manager().registries.protocol_adapters:
        pytest.skip("the ninfer-prometheus contrib plugin is not installed")
    body = {"model": "alias-model", "max_tokens": 3, "messages": [{"role": "user", "content": words(5)}]}
    assert httpx.post(secured.url("/v1/chat/completions"), json=body, headers=auth_headers(), timeout=60).status_code == 200
    metrics = httpx.get(secured.url("/metrics"), headers=auth_headers()).text
    finished = re.search(r'ninfer_requests_total\{finish_reason="length",protocol="openai_chat"\} (\d+)', metrics)
    completion = re.search(r'ninfer_completion_tokens_total\{protocol="openai_chat"\} (\d+)', metrics)
    assert finished and int(finished.group(1)) >= 1 and completion and int(completion.group(1)) >= 3


# -- authentication and CORS -------------------------------------------------------------------------------------


def test_api_key_is_required_in_openai_shape(secured):
    with pytest.raises(openai.AuthenticationError) as denied:
        secured.client("wrong-key").chat.completions.create(model="alias-model", messages=[{"role": "user", "content": "x"}])
    assert denied.value.status_code == 401
    assert denied.value.body["type"] == "authentication_error" and denied.value.body["code"] == "invalid_api_key"
    assert httpx.get(secured.url("/v1/models")).status_code == 401
    assert httpx.get(secured.url("/v1/models"), headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.get(secured.url("/v1/models"), headers=auth_headers()).status_code == 200


def test_cors_preflight_is_open_and_responses_carry_cors_headers(secured):
    preflight = httpx.options(
        secured.url("/v1/chat/completions"),
        headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"},
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    listed = httpx.get(secured.url("/v1/models"), headers={**auth_headers(), "Origin": "http://app.example"})
    assert listed.headers["access-control-allow-origin"] == "*"


# -- body limit --------------------------------------------------------------------------------------------------


def test_oversized_body_is_413_before_parsing(secured):
    oversized = b"{" + b"x" * (1024 * 1024)  # not even JSON: the size check must come first
    response = httpx.post(secured.url("/v1/chat/completions"), content=oversized,
                          headers={**auth_headers(), "content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: the limit applies while reading
        for _ in range(17):
            yield b"x" * 65536

    streamed = httpx.post(secured.url("/v1/chat/completions"), content=chunks(),
                          headers={**auth_headers(), "content-type": "application/json"})
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
    malformed = httpx.post(secured.url("/v1/chat/completions"), content=b"{nope",
                           headers={**auth_headers(), "content-type": "application/json"})
    assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "invalid_json"


# -- admission ---------------------------------------------------------------------------------------------------


def test_burst_beyond_capacity_gets_429_server_overloaded(secured):
    body = {"model": "alias-model", "max_tokens": 12, "messages": [{"role": "user", "content": words(40)}]}

    def send(_: int) -> httpx.Response:
        return httpx.post(secured.url("/v1/chat/completions"), json=body, headers=auth_headers(), timeout=120)

    with ThreadPoolExecutor(max_workers=5) as pool:
        responses = list(pool.map(send, range(5)))
    statuses = Counter(response.status_code for response in responses)
    assert set(statuses) <= {200, 429} and statuses[200] >= 2 and statuses[429] >= 1, statuses
    refused = next(response for response in responses if response.status_code == 429)
    error = refused.json()["error"]
    assert error["code"] == "server_overloaded" and "x-request-id" in refused.headers
    done = next(response for response in responses if response.status_code == 200).json()
    assert done["usage"]["completion_tokens"] == 12 and done["choices"][0]["finish_reason"] == "length"
    assert done["choices"][0]["message"]["content"] == words(12)


# -- cancellation on client disconnect ---------------------------------------------------------------------------


def test_streaming_disconnect_cancels_generation_and_frees_capacity(secured):
    body = {"model": "alias-model", "stream": True, "max_tokens": 400, "messages": [{"role": "user", "content": words(100)}]}
    with httpx.stream("POST", secured.url("/v1/chat/completions"), json=body, headers=auth_headers(), timeout=60) as stream:
        request_id = stream.headers["x-request-id"]
        for line in stream.iter_lines():
            if '"content":"alpha' in line:
                break  # one generated delta seen: leave while decoding (the rest would take ~10 s)
    log = secured.wait_for_log(lambda text: f"request {request_id} openai_chat cancelled" in text)
    assert f"request {request_id} openai_chat done" not in log
    assert_capacity_free(secured)


def assert_capacity_free(server: LiveServer) -> None:
    """Capacity is 1 active + 1 pending: two concurrent requests are both accepted only when nothing else holds it."""
    body = {"model": "alias-model", "max_tokens": 2, "messages": [{"role": "user", "content": "again please"}]}

    def send(_: int) -> int:
        return httpx.post(server.url("/v1/chat/completions"), json=body, headers=auth_headers(), timeout=60).status_code

    with ThreadPoolExecutor(max_workers=2) as pool:
        assert list(pool.map(send, range(2))) == [200, 200]


def test_non_streaming_disconnect_cancels_generation(secured):
    before = secured.log().count("openai_chat cancelled")
    body = {"model": "alias-model", "max_tokens": 400, "messages": [{"role": "user", "content": words(100)}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(secured.url("/v1/chat/completions"), json=body, headers=auth_headers(), timeout=1.0)
    secured.wait_for_log(lambda text: text.count("openai_chat cancelled") > before)
    assert_capacity_free(secured)


# -- SSE keep-alive ----------------------------------------------------------------------------------------------


def test_keep_alive_comment_during_a_long_silent_prefill(secured):
    # 64-token prefill chunks at 100 ms each: 4000 prompt tokens take ~6 s without a protocol event
    body = {"model": "alias-model", "stream": True, "max_tokens": 2, "messages": [{"role": "user", "content": words(4000)}]}
    with httpx.stream("POST", secured.url("/v1/chat/completions"), json=body, headers=auth_headers(), timeout=120) as stream:
        lines = list(stream.iter_lines())
    assert ": keep-alive" in lines
    assert 0 < lines.index(": keep-alive") < first_content_line(lines)  # after the role chunk, during the prefill
    payloads = sse_data(lines)
    assert payloads[-1] == "[DONE]"
    content = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in payloads[:-1] if chunk["choices"])
    assert content == words(2)  # the comment changes nothing in the protocol stream


# -- queue timeout and graceful shutdown (a second server; the shutdown test ends it, so it runs last) -------------


@pytest.fixture(scope="module")
def plain(echo_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    """No auth, no CORS, one active request, a 1 s pending timeout, a slow echo model."""
    args = ["--no-thinking", "--default-max-tokens", "512", "--pending-timeout-ms", "1000"]
    [server] = start_servers(tmp_path_factory.mktemp("plain"),
                             [(echo_artifact, args, {"NINFER_ECHO_DELAY_MS": SLOW_DELAY_MS})], [ECHO_MODEL])
    yield server
    server.stop()


class LongStream:
    """A streamed echo request with ~10 s of decoding, read in a thread; leaving the block disconnects it."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.lines: list[str] = []
        self.decoding = threading.Event()
        self.leave = threading.Event()
        self.thread = threading.Thread(target=self._consume)

    def _consume(self) -> None:
        body = {"model": ECHO_MODEL, "stream": True, "max_tokens": 400, "messages": [{"role": "user", "content": words(100)}]}
        with httpx.stream("POST", self.server.url("/v1/chat/completions"), json=body, timeout=60) as stream:
            for line in stream.iter_lines():
                self.lines.append(line)
                if '"content":"alpha' in line:
                    self.decoding.set()
                if self.leave.is_set():
                    return

    def __enter__(self) -> "LongStream":
        self.thread.start()
        assert self.decoding.wait(30), self.server.log()
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave.set()
        self.thread.join(30)


def test_queue_timeout_is_an_http_503_even_for_streams(plain):
    listed = httpx.get(plain.url("/v1/models"), headers={"Origin": "http://app.example"})
    assert listed.status_code == 200 and "access-control-allow-origin" not in listed.headers  # no --cors here
    queued = {"model": ECHO_MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "queued"}]}
    with LongStream(plain):  # holds the only lane for ~10 s
        waited = httpx.post(plain.url("/v1/chat/completions"), json=queued, timeout=30)
        streamed = httpx.post(plain.url("/v1/chat/completions"), json={**queued, "stream": True}, timeout=30)
    for response in (waited, streamed):
        assert response.status_code == 503 and response.headers["content-type"].startswith("application/json")
        error = response.json()["error"]
        assert error["code"] == "request_queue_timeout" and error["type"] == "server_error"
    plain.wait_for_log(lambda text: "openai_chat cancelled" in text)  # the disconnected stream released its lane
    assert httpx.post(plain.url("/v1/chat/completions"), json=queued, timeout=30).status_code == 200


def test_sigterm_cancels_in_flight_requests_and_exits_zero(plain):
    with LongStream(plain) as stream:
        cancelled_before = plain.log().count("openai_chat cancelled")
        returncode = plain.stop(signal.SIGTERM)
    assert returncode == 0
    log = plain.log()
    assert "SIGTERM received: shutting down (cancelling 1 in-flight request)" in log
    assert log.count("openai_chat cancelled") == cancelled_before + 1 and log.rstrip().endswith("INFO stopped")
    payloads = sse_data(stream.lines)
    assert payloads[-1]["error"]["code"] == "engine_unavailable" and "[DONE]" not in payloads


def test_startup_warns_about_nothing_the_user_did_not_set(secured, plain):
    """The flags of these servers select nothing that is missing, so their startup log has no WARNING line."""
    for server in (secured, plain):
        startup = server.log().split(" INFO ready: serving ")[0]
        assert " INFO loading " in startup
        assert " WARNING " not in startup, startup


def test_context_cost_presets_are_resolved_at_startup(echo_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    """The presets file's transfer entry and the served model's prefill entry replace the generic coefficients (the
    startup record says which); another model's entry is ignored; a wrong field aborts startup with one Error line."""
    folder = tmp_path_factory.mktemp("presets")
    presets = folder / "presets.json"
    presets.write_text(json.dumps({
        "transfer": {"batch_ns": 5000, "op_ns": 100, "ns_per_byte": 0.02},
        "prefill": {ECHO_MODEL: {"token_ns": 12000, "pair_ns": 0.5}, "another-model": {"token_ns": 1}},
    }), encoding="utf-8")
    [server] = start_servers(folder, [(echo_artifact, ["--context-cost-presets", str(presets)], {})], [ECHO_MODEL])
    try:
        startup = server.log().split(" INFO ready: serving ")[0]
        assert f"context cost ({presets} (transfer, prefill[{ECHO_MODEL}])): restore max(5 us + 0.1 us per tensor, " \
               "50 B/ns), prefill 12 us per token + 0.5 ns per attention pair" in startup
        assert " WARNING " not in startup
    finally:
        server.stop()
    wrong = folder / "wrong.json"
    wrong.write_text('{"transfer": {"gib_per_s": 50}}', encoding="utf-8")
    result = subprocess.run([sys.executable, "-c", "from ninfer.cli import main; main()", "serve", str(echo_artifact),
                             "--port", str(free_port()), "--context-cost-presets", str(wrong)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "Error: --context-cost-presets: transfer has unknown fields ['gib_per_s']" in result.stderr
