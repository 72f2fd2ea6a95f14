"""``--request-log-jsonl`` and the stderr operational log, observed on a live ``ninfer serve`` (echo model).

One server (API key, capacity 1 active + 1 pending, a short pending timeout, a slow echo model) is driven
through Chat Completions: successes (plain and streamed), a validation rejection, a preparation rejection,
a streaming disconnect, an overload burst and a queue timeout. Every JSONL line must validate against
``docs/request-log.schema.json``; HTTP responses are joined to records through ``x-request-id``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import httpx
import jsonschema
import pytest

from live_server import ECHO_MODEL, LiveServer, free_port, sse_data, start_servers, tiny_artifact
from paths import DOCS

API_KEY = "sk-request-log-secret-4711"
SECRET_WORD = "marmalade"  # appears only in prompts (and so in the echoed output): never in any log
SCHEMA_PATH = DOCS / "request-log.schema.json"
STDERR_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} (TRACE|DEBUG|INFO|WARNING|ERROR|CRITICAL) \S.*$")
TERMINALS = ("request_done", "request_error")


@attrs.define
class Exchange:
    """One HTTP request's outcome: its x-request-id, status and decoded body (or SSE payloads)."""

    request_id: str
    status: int
    body: Any


@attrs.define
class Scenario:
    server: LiveServer
    records: list[dict[str, Any]]
    stderr: str
    jsonl_text: str
    exchanges: dict[str, Exchange | list[Exchange]]

    def by_request(self, http_request_id: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("http_request_id") == http_request_id]

    def events(self, http_request_id: str) -> list[str]:
        return [r["event"] for r in self.by_request(http_request_id)]

    def one(self, http_request_id: str, event: str) -> dict[str, Any]:
        [record] = [r for r in self.by_request(http_request_id) if r["event"] == event]
        return record


def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def body(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": ECHO_MODEL, "messages": [{"role": "user", "content": content}], **fields}


def prompt(count: int) -> str:
    return " ".join([SECRET_WORD, *(["river stone"] * count)])


def post(server: LiveServer, payload: dict[str, Any], timeout: float = 60) -> Exchange:
    response = httpx.post(server.url("/v1/chat/completions"), json=payload, headers=headers(), timeout=timeout)
    return Exchange(response.headers["x-request-id"], response.status_code, response.json())


def mounted(adapter: str) -> bool:
    """Whether the built-in protocol adapter ``adapter`` is mounted (not a 501 placeholder) in this tree."""
    from ninfer.protocols.builtin import ninfer_protocol_adapters

    return any(a.name == adapter and a.mount is not None for a in ninfer_protocol_adapters())


def post_path(server: LiveServer, path: str, payload: dict[str, Any], id_header: str) -> Exchange:
    response = httpx.post(server.url(path), json=payload, timeout=60,
                          headers={**headers(), "x-api-key": API_KEY, "anthropic-version": "2023-06-01"})
    return Exchange(response.headers[id_header], response.status_code, response.json())


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def wait_for_terminal(path: Path, http_request_id: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("http_request_id") == http_request_id and r["event"] in TERMINALS for r in read_records(path)):
            return
        time.sleep(0.05)
    raise AssertionError(f"no terminal record for {http_request_id}")


def stream_until_first_delta(server: LiveServer, payload: dict[str, Any]) -> Exchange:
    """Stream and disconnect right after the first generated delta (leaving the iteration closes the connection)."""
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=payload, headers=headers(), timeout=60) as stream:
        request_id = stream.headers["x-request-id"]
        for line in stream.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break
    return Exchange(request_id, 200, None)


def while_streaming(server: LiveServer, payload: dict[str, Any], action: Any) -> tuple[Exchange, Any]:
    """Run ``action()`` once a streamed request produced its first delta, reading that stream to its end meanwhile."""
    first_delta, seen = threading.Event(), {}

    def read() -> Exchange:
        with httpx.stream("POST", server.url("/v1/chat/completions"), json=payload, headers=headers(),
                          timeout=60) as stream:
            seen["request_id"] = stream.headers["x-request-id"]
            for line in stream.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    first_delta.set()
        first_delta.set()
        return Exchange(seen["request_id"], stream.status_code, None)

    with ThreadPoolExecutor(max_workers=1) as pool:
        reader = pool.submit(read)
        assert first_delta.wait(30)
        result = action()
        return reader.result(), result


def burst(server: LiveServer, count: int) -> list[Exchange]:
    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(lambda _: post(server, body(prompt(3), max_tokens=8)), range(count)))


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    artifact = tiny_artifact(tmp_path_factory, "echo")
    tmp = tmp_path_factory.mktemp("request-log")
    log_path = tmp / "requests.jsonl"
    args = ["--api-key", API_KEY, "--request-log-jsonl", str(log_path), "--log-stats-interval-ms", "150",
            "--max-concurrency", "1", "--max-pending-requests", "1", "--pending-timeout-ms", "1500",
            "--no-thinking", "--default-max-tokens", "64", "--strict-effort", "--max-long-anchors-per-continuation", "3"]
    [server] = start_servers(tmp, [(artifact, args, {"NINFER_ECHO_DELAY_MS": "30"})], [ECHO_MODEL])
    exchanges: dict[str, Any] = {}
    try:
        exchanges["plain"] = post(server, body(prompt(6), max_tokens=6))
        streamed = httpx.post(server.url("/v1/chat/completions"), headers=headers(), timeout=60,
                              json=body(prompt(4), stream=True, stream_options={"include_usage": True}))
        exchanges["streamed"] = Exchange(streamed.headers["x-request-id"], streamed.status_code,
                                         sse_data(streamed.text.splitlines()))
        exchanges["invalid"] = post(server, {"model": ECHO_MODEL})
        exchanges["effort"] = post(server, body(prompt(2), reasoning_effort="high"))
        disconnected = stream_until_first_delta(server, body(prompt(100), stream=True, max_tokens=150))
        wait_for_terminal(log_path, disconnected.request_id)
        exchanges["disconnected"] = disconnected
        # while a long stream holds the one active lane, three requests compete for the one pending place
        exchanges["burst_holder"], exchanges["burst"] = while_streaming(
            server, body(prompt(100), stream=True, max_tokens=150), lambda: burst(server, 3)
        )
        if mounted("openai_responses"):
            exchanges["responses"] = post_path(server, "/v1/responses", {
                "model": ECHO_MODEL, "input": f"{SECRET_WORD} light cloud", "max_output_tokens": 6}, "x-request-id")
        if mounted("anthropic_messages"):
            messages = {"model": ECHO_MODEL, "max_tokens": 6,
                        "messages": [{"role": "user", "content": f"{SECRET_WORD} delta gamma"}]}
            exchanges["anthropic"] = post_path(server, "/v1/messages", messages, "request-id")
            count = {key: value for key, value in messages.items() if key != "max_tokens"}
            exchanges["count_tokens"] = post_path(server, "/v1/messages/count_tokens", count, "request-id")
        # 80 tokens at 30 ms per round outlast the 1.5 s pending timeout of the request queued behind them
        exchanges["holder"], exchanges["timed_out"] = while_streaming(
            server, body(prompt(100), stream=True, max_tokens=80), lambda: post(server, body(prompt(2), max_tokens=4))
        )
    finally:
        server.stop()
    assert server.process.returncode == 0, server.log()
    return Scenario(server, read_records(log_path), server.log(), log_path.read_text(encoding="utf-8"), exchanges)


# -- the file as a whole -------------------------------------------------------------------------------------------


def test_every_line_validates_against_the_schema(scenario):
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))
    assert scenario.records
    for record in scenario.records:
        errors = [error.message for error in validator.iter_errors(record)]
        assert not errors, (record["event"], errors)
    assert scenario.records[0]["event"] == "server_start"
    assert scenario.records[0]["context_cost"]["source"] == "generic"
    assert len({r["server_instance_id"] for r in scenario.records}) == 1


def test_one_terminal_per_started_request_and_none_for_rejections(scenario):
    per_id: dict[int, list[str]] = {}
    for record in scenario.records:
        if "request_id" in record:
            per_id.setdefault(record["request_id"], []).append(record["event"])
    assert sorted(per_id) == list(range(1, len(per_id) + 1))  # ids are dense and start at 1
    for events in per_id.values():
        assert events in (["request_start", "request_done"], ["request_start", "request_error"], ["request_rejected"])


def test_requests_outside_preparation_get_no_record(scenario):
    invalid = scenario.exchanges["invalid"]
    assert invalid.status == 400 and scenario.events(invalid.request_id) == []
    burst = scenario.exchanges["burst"]
    statuses = Counter(exchange.status for exchange in burst)
    assert statuses[429] >= 2, statuses  # one pending place for three requests
    for exchange in burst:
        events = scenario.events(exchange.request_id)
        if exchange.status == 429:
            assert events == []
        else:  # the one that queued: admitted after the holder, or timed out waiting for it
            assert events in (["request_start", "request_done"], ["request_start", "request_error"])


# -- per-request contents ------------------------------------------------------------------------------------------


def assert_tokens_match(done: dict[str, Any], usage: dict[str, Any]) -> None:
    result = done["result"]
    assert result["prompt_tokens"] == usage["prompt_tokens"]
    assert result["completion_tokens"] == usage["completion_tokens"]
    assert result["prefix_cache_hit_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert result["computed_prefill_tokens"] == usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    # root exactly when nothing was reused; a hit names the kind of checkpoint it resumed from
    assert (result["prefix_reuse_path"] == "root") == (result["prefix_cache_hit_tokens"] == 0)
    decision = done["materialization"]  # every admitted request commits one decision: root is always a candidate
    assert decision is not None and decision["evaluated_targets"] >= 1 + (result["prefix_cache_hit_tokens"] > 0)
    predicted = decision["predicted_ns"]
    assert predicted["total"] == predicted["immediate"] + predicted["future_loss"] and predicted["immediate"] > 0
    assert decision["stop_reason"] == ("queue_exhausted" if decision["degradation_units"] else "no_pressure")


def test_done_tokens_agree_with_http_usage(scenario):
    plain = scenario.exchanges["plain"]
    assert plain.status == 200
    assert_tokens_match(scenario.one(plain.request_id, "request_done"), plain.body["usage"])
    streamed = scenario.exchanges["streamed"]
    [usage] = [chunk["usage"] for chunk in streamed.body if isinstance(chunk, dict) and chunk.get("usage")]
    assert_tokens_match(scenario.one(streamed.request_id, "request_done"), usage)
    for exchange in scenario.exchanges["burst"]:
        if exchange.status == 200:
            assert_tokens_match(scenario.one(exchange.request_id, "request_done"), exchange.body["usage"])


def test_start_records_the_resolved_configuration(scenario):
    plain = scenario.exchanges["plain"]
    start = scenario.one(plain.request_id, "request_start")
    assert start["protocol"] == "openai_chat" and start["thinking"] is False
    assert start["output_budget"] == 6 and start["sampler"]["max_tokens"] == 6
    assert start["requested_reasoning_effort"] is None
    assert start["shape"] == {"stream": False, "messages": 1, "tools": 0, "tool_choice": "auto", "media_items": 0,
                              "ignored_tools": []}
    assert start["prompt_tokens"] == plain.body["usage"]["prompt_tokens"]
    streamed = scenario.one(scenario.exchanges["streamed"].request_id, "request_start")
    assert streamed["shape"]["stream"] is True and streamed["output_budget"] == 64  # --default-max-tokens


def test_done_timings_and_engine_timing_are_consistent(scenario):
    done = scenario.one(scenario.exchanges["plain"].request_id, "request_done")
    timings = done["timings_seconds"]
    assert timings["ttft"] is not None and 0.0 < timings["ttft"] <= timings["total"]
    assert timings["decode"] > 0.0 and timings["prefill"] > 0.0 and timings["speculative"] is None
    engine = done["engine_timing"]
    host = engine["host_exposed_seconds"]
    phases = [host[name] for name in ("engine_boundary", "program_submit", "program_post", "engine_commit_output",
                                      "engine_maintenance")]
    assert host["total"] == sum(phases) and host["total"] > 0.0
    assert engine["queue_wait_seconds"] + host["total"] <= timings["total"]
    # one lane, no speculation: the first token comes from prefill, every later one from its own decode round
    assert engine["decode"]["rounds"] == done["result"]["completion_tokens"] - 1
    # a short prompt is two prefill chunks: up to the response's prologue (a reuse frontier) and the prologue
    assert engine["units"] == {"prefill": 2, "control": 0}  # no budget close


PHASES = ("engine_boundary", "program_submit", "program_post", "engine_commit_output", "engine_maintenance")


def test_every_done_reports_measured_exclusive_engine_phases(scenario):
    done = [r for r in scenario.records if r["event"] == "request_done"]
    assert done
    for record in done:
        engine = record["engine_timing"]
        host = engine["host_exposed_seconds"]
        phases = [host[name] for name in PHASES]
        assert all(value >= 0.0 for value in phases) and engine["device_wait_exposed_seconds"] >= 0.0
        assert host["total"] == sum(phases)  # exactly: computed from the written numbers
        decode = engine["decode"]
        assert decode["host_exposed_seconds"] <= host["total"]
        assert decode["device_wait_seconds"] <= engine["device_wait_exposed_seconds"]
        # the exposure lies inside the request's engine residence (submission to finish, less the FIFO wait)
        residence = record["timings_seconds"]["total"] - record["timings_seconds"]["prepare"]
        assert engine["queue_wait_seconds"] + host["total"] + engine["device_wait_exposed_seconds"] <= residence + 1e-3
        if record["result"]["completion_tokens"] > 0:  # it ran: the model was submitted work for it
            assert host["program_submit"] > 0.0 and host["engine_commit_output"] > 0.0
        if record["result"]["completion_tokens"] > 1:
            assert decode["host_exposed_seconds"] > 0.0 and decode["rounds"] > 0


def test_throughput_host_work_is_measured_on_every_reported_interval(scenario):
    throughput = [r for r in scenario.records if r["event"] == "throughput"]
    for record in throughput:
        work = record["host_work"]
        elapsed = work["elapsed_seconds"]
        assert elapsed["total"] == sum(elapsed[name] for name in PHASES)
        classes = work["work_class_seconds"]
        assert sum(c["host_seconds"] for c in classes.values()) == pytest.approx(elapsed["total"], abs=1e-6)
        assert sum(c["device_wait_seconds"] for c in classes.values()) == pytest.approx(work["device_wait_seconds"],
                                                                                     abs=1e-6)
        for name, seconds in work["detail_subset_seconds"].items():
            assert seconds <= elapsed["total"] + 1e-9  # a subset of the host phases
            per_invocation = work["normalized"]["detail_seconds_per_invocation"][name]
            assert (per_invocation is None) == (work["detail_invocations"][name] == 0)
        rounds = record["decode_rounds"]["rounds"]
        assert (work["normalized"]["decode_host_seconds_per_round"] is None) == (rounds == 0)
    # one worker thread: its host work cannot exceed the wall time since the reporter started (a segment is
    # reported in the interval in which it ends, so single intervals may hold more than their own length)
    reported_span = (throughput[-1]["timestamp_unix_ms"] - throughput[0]["timestamp_unix_ms"]) / 1000.0
    wall = reported_span + throughput[0]["interval_seconds"] + 0.01
    assert sum(r["host_work"]["elapsed_seconds"]["total"] for r in throughput) <= wall
    assert sum(r["host_work"]["elapsed_seconds"]["program_submit"] for r in throughput) > 0.0
    assert sum(r["host_work"]["detail_invocations"]["admission"] for r in throughput) > 0
    assert sum(r["host_work"]["detail_invocations"]["stats_publication"] for r in throughput) > 0
    assert all(r["host_work"]["detail_invocations"]["replica"] == 0 for r in throughput)
    stderr_reports = [line for line in scenario.stderr.splitlines() if " INFO throughput " in line]
    assert stderr_reports and all(re.search(r"host active \d+\.\d\d s \(\d+\.\d%\)", line) for line in stderr_reports)


def test_preparation_rejection_records_the_exact_http_error(scenario):
    effort = scenario.exchanges["effort"]
    assert effort.status == 400
    rejected = scenario.one(effort.request_id, "request_rejected")
    error = effort.body["error"]
    assert rejected["error"] == {"status": 400, "type": error["type"], "code": error["code"], "param": error["param"],
                                 "message": error["message"]}
    assert rejected["requested_reasoning_effort"] == "high" and rejected["resolved_reasoning_effort"] is None
    assert rejected["phase"] == "prepare"


def test_disconnect_ends_with_a_cancelled_done(scenario):
    disconnected = scenario.exchanges["disconnected"]
    done = scenario.one(disconnected.request_id, "request_done")
    assert done["result"]["finish_reason"] == "cancelled"
    assert 0 < done["result"]["completion_tokens"] < 150


def test_queue_timeout_is_a_request_error(scenario):
    timed_out = scenario.exchanges["timed_out"]
    assert timed_out.status == 503 and timed_out.body["error"]["code"] == "request_queue_timeout"
    assert scenario.events(timed_out.request_id) == ["request_start", "request_error"]
    error = scenario.one(timed_out.request_id, "request_error")
    assert error["error"]["status"] == 503 and error["error"]["code"] == "request_queue_timeout"
    assert error["error"]["message"] == timed_out.body["error"]["message"]
    assert error["configuration"]["output_budget"] == 4
    holder = scenario.one(scenario.exchanges["holder"].request_id, "request_done")
    assert holder["result"]["finish_reason"] == "length" and holder["result"]["completion_tokens"] == 80


def test_throughput_deltas_add_up_to_the_request_totals(scenario):
    throughput = [r for r in scenario.records if r["event"] == "throughput"]
    done = [r["result"] for r in scenario.records if r["event"] == "request_done"]
    assert throughput
    assert sum(r["tokens"]["prefill"] for r in throughput) == sum(d["computed_prefill_tokens"] for d in done)
    assert sum(r["tokens"]["decode"] for r in throughput) == sum(max(d["completion_tokens"] - 1, 0) for d in done)
    stderr_reports = [line for line in scenario.stderr.splitlines() if " INFO throughput " in line]
    assert len(stderr_reports) == len(throughput)
    rounds = [r["decode_rounds"] for r in throughput]
    assert sum(r["rounds"] for r in rounds) > 0
    for r in rounds:  # one lane: every round has exactly one row
        assert r["row_rounds"] == r["rounds"] and r["average_size"] == (1.0 if r["rounds"] else None)
    # on this single-lane server without speculation each round commits one token (uncounted after a disconnect)
    assert sum(r["rounds"] for r in rounds) >= sum(r["tokens"]["decode"] for r in throughput)


def test_responses_requests_are_recorded(scenario):
    if "responses" not in scenario.exchanges:
        pytest.skip("the OpenAI Responses adapter is not mounted in this tree")
    exchange = scenario.exchanges["responses"]
    assert exchange.status == 200, exchange.body
    assert scenario.events(exchange.request_id) == ["request_start", "request_done"]
    result = scenario.one(exchange.request_id, "request_done")["result"]
    usage = exchange.body["usage"]
    assert scenario.one(exchange.request_id, "request_start")["protocol"] == "openai_responses"
    assert result["prompt_tokens"] == usage["input_tokens"] and result["completion_tokens"] == usage["output_tokens"]
    assert result["prefix_cache_hit_tokens"] == usage["input_tokens_details"]["cached_tokens"]


def test_anthropic_requests_are_recorded_and_token_counts_are_not(scenario):
    if "anthropic" not in scenario.exchanges:
        pytest.skip("the Anthropic Messages adapter is not mounted in this tree")
    exchange = scenario.exchanges["anthropic"]
    assert exchange.status == 200, exchange.body
    assert scenario.events(exchange.request_id) == ["request_start", "request_done"]
    result = scenario.one(exchange.request_id, "request_done")["result"]
    usage = exchange.body["usage"]
    assert scenario.one(exchange.request_id, "request_start")["protocol"] == "anthropic_messages"
    assert result["prefix_cache_hit_tokens"] == (usage.get("cache_read_input_tokens") or 0) == 0  # a fresh prompt
    assert result["prompt_tokens"] == usage["input_tokens"] and result["completion_tokens"] == usage["output_tokens"]
    count = scenario.exchanges["count_tokens"]
    assert count.status == 200 and count.body["input_tokens"] == result["prompt_tokens"]
    assert scenario.events(count.request_id) == []


# -- privacy and format ----------------------------------------------------------------------------------------------


def test_no_secret_prompt_or_generated_text_in_logs(scenario):
    plain_text = scenario.exchanges["plain"].body["choices"][0]["message"]["content"]
    assert SECRET_WORD in plain_text  # the echo model said the prompt back: it is generated text too
    for text in (scenario.jsonl_text, scenario.stderr):
        assert API_KEY not in text and SECRET_WORD not in text and "river stone" not in text
    argv = scenario.records[0]["argv"]
    assert argv[argv.index("--api-key") + 1] == "<redacted>"


def test_stderr_lines_have_the_operational_format(scenario):
    lines = scenario.stderr.splitlines()
    assert lines and "\x1b" not in scenario.stderr
    for line in lines:
        assert STDERR_LINE.match(line), line
    assert any(" INFO ready: serving " in line for line in lines)
    # every context-cache option of the scenario takes effect: startup warns about none of them
    assert not any(" WARNING context cache" in line for line in lines)
    assert not any("--host-state-slots" in line or "--host-kv-mib" in line for line in lines)  # the host tier exists
    assert re.search(r"openai_chat done: \w+, prompt \d+ \(cache \d+ \(\d+%, (root|private [a-z ]+|shared stable prefix)\)\)", scenario.stderr)
    assert "openai_chat cancelled" in scenario.stderr and lines[-1].endswith(" INFO stopped")


# -- startup ---------------------------------------------------------------------------------------------------------


def test_unopenable_log_file_aborts_startup(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory):
    artifact = tiny_artifact(tmp_path_factory, "echo")
    dangling = tmp_path / "requests.jsonl"
    dangling.symlink_to(tmp_path / "missing" / "requests.jsonl")
    command = [sys.executable, "-c", "from ninfer.cli import main; main()", "serve", str(artifact), "--host",
               "127.0.0.1", "--port", str(free_port()), "--request-log-jsonl", str(dangling)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert completed.returncode != 0
    assert "--request-log-jsonl" in completed.stderr and "Traceback" not in completed.stderr
    assert "ready:" not in completed.stderr
