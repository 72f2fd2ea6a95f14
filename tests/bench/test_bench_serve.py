"""``ninfer bench serve`` against a live echo server (default flags plus an API key and the request log): every
endpoint streams, the report's token totals are the server's own usage (its request log), multiturn conversations
send every turn and reuse their history, tool turns are valid wire shapes, and failures are counted, not fatal."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from click.testing import CliRunner
from live_server import API_KEY, ECHO_MODEL, LiveServer, free_port, start_servers, tiny_artifact

from ninfer.bench.datasets import WORDS, is_tool_turn, multiturn_dataset, sample_length, words
from ninfer.cli import cli

ENDPOINTS = ("chat", "responses", "messages")
STATS = ("mean", "p50", "p90", "p99")
METRICS = ("ttft", "tpot", "itl", "e2e")
METRIC_KEYS = {f"{stat}_{metric}_ms" for stat in STATS for metric in METRICS}
REPORT_KEYS = METRIC_KEYS | {
    "endpoint", "path", "base_url", "model", "dataset", "num_requests", "concurrency", "request_rate", "input_len",
    "output_len", "range_ratio", "turns", "system_prompt_len", "tool_turns", "seed", "total_requests", "completed",
    "failed", "errors", "duration_s", "request_throughput", "input_throughput", "output_throughput",
    "total_input_tokens", "total_output_tokens", "total_cached_tokens", "cached_token_ratio", "per_turn", "requests",
}


@attrs.frozen
class BenchServer:
    """The live echo server and its request log."""

    live: LiveServer
    request_log: Path

    @property
    def base_url(self) -> str:
        return self.live.base_url


@pytest.fixture(scope="module")
def echo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_artifact(tmp_path_factory, "echo", "qwen3_6")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, echo: Path):
    folder = tmp_path_factory.mktemp("bench-serve")
    log = folder / "requests.jsonl"
    (live,) = start_servers(folder, [(echo, ["--api-key", API_KEY, "--request-log-jsonl", str(log)], {})],
                            [ECHO_MODEL])
    yield BenchServer(live, log)
    live.stop()


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, ["bench", "serve", *args])


def bench(server: BenchServer, *args: str, key: str = API_KEY) -> dict[str, Any]:
    """Run the benchmark with ``--json``; its report, with ``logged``: the server's ``request_done`` records of
    its requests, and ``started``: their ``request_start`` records."""
    before = len(log_records(server))
    result = invoke("--base-url", server.base_url, "--api-key", key, "--json", *args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    new = wait_for_records(server, before, report["total_requests"] - count_unlogged(report))
    report["logged"] = done(new)
    report["started"] = [record for record in new if record["event"] == "request_start"]
    return report


def count_unlogged(report: dict[str, Any]) -> int:
    """Requests refused before preparation (401) leave no record (docs/request-log.md)."""
    return sum(1 for request in report["requests"] if (request["error"] or "").startswith("HTTP 401"))


def log_records(server: BenchServer) -> list[dict[str, Any]]:
    """The request log's complete lines (a line still being written is read next time)."""
    if not server.request_log.exists():
        return []
    text = server.request_log.read_text(encoding="utf-8")
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]


def done(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [record for record in records if record["event"] == "request_done"]


def wait_for_records(server: BenchServer, since: int, count: int, timeout: float = 10.0) -> list[dict[str, Any]]:
    """The log's records after its first ``since``, once ``count`` of them are ``request_done`` (the server writes
    one after the stream has closed)."""
    deadline = time.monotonic() + timeout
    while True:
        new = log_records(server)[since:]
        if len(done(new)) >= count:
            return new
        assert time.monotonic() < deadline, f"the request log has fewer than {count} new finished requests"
        time.sleep(0.05)


def assert_sane(report: dict[str, Any]) -> None:
    assert REPORT_KEYS <= set(report)
    assert report["duration_s"] > 0 and report["request_throughput"] > 0 and report["output_throughput"] > 0
    assert report["mean_ttft_ms"] <= report["mean_e2e_ms"]
    for metric in METRICS:
        p50, p90, p99 = (report[f"{stat}_{metric}_ms"] for stat in STATS[1:])
        assert 0 <= p50 <= p90 <= p99, (metric, p50, p90, p99)
    for request in report["requests"]:
        if request["ok"]:
            assert 0 < request["ttft_ms"] <= request["e2e_ms"]


def assert_usage_matches_the_log(report: dict[str, Any]) -> None:
    logged = [record["result"] for record in report["logged"]]
    assert len(logged) == report["completed"]
    assert report["total_input_tokens"] == sum(result["prompt_tokens"] for result in logged)
    assert report["total_output_tokens"] == sum(result["completion_tokens"] for result in logged)
    assert report["total_cached_tokens"] == sum(result["prefix_cache_hit_tokens"] for result in logged)


# -- the datasets --------------------------------------------------------------------------------------------------


def test_prompt_words_are_one_token_each(echo: Path):
    from ninfer.core.artifact.source import open_model_source
    from ninfer.core.plugins import load_plugin_manager
    from ninfer.core.tokenizer import Tokenizer

    with open_model_source(str(echo), load_plugin_manager().registries) as artifact:
        tokenizer = Tokenizer.from_artifact(artifact)
    assert all(len(tokenizer.encode(word)) == 1 == len(tokenizer.encode(" " + word)) for word in WORDS)
    assert len(tokenizer.encode(words(random.Random(3), 300))) == 300


def test_multiturn_conversations_share_the_system_prompt_only():
    conversations = multiturn_dataset(random.Random(1), 3, turns=4, input_len=20, output_len=5, ratio=0.0,
                                      system_prompt_len=50, tool_turns=0.5)
    assert len({conversation.system for conversation in conversations}) == 1
    assert len({conversation.turns[0].text for conversation in conversations}) == 3
    assert [turn.tool_call is not None for turn in conversations[0].turns] == [False, True, False, True]
    assert [is_tool_turn(turn, 1.0) for turn in (1, 2, 3)] == [False, True, True]
    rng = random.Random(0)
    assert all(50 <= sample_length(rng, 100, 0.5) <= 150 for _ in range(200)) and sample_length(rng, 7, 0.0) == 7


# -- live runs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_random_requests_on_each_endpoint_report_the_servers_usage(server, endpoint: str):
    report = bench(server, "--endpoint", endpoint, "--num-requests", "3", "--concurrency", "2",
                   "--input-len", "40", "--output-len", "8")
    assert (report["completed"], report["failed"], report["total_requests"]) == (3, 0, 3)
    assert report["model"] == ECHO_MODEL and report["errors"] == []
    assert_sane(report)
    assert_usage_matches_the_log(report)
    # the echo model repeats the 40-word prompt, so every answer runs into the 8-token limit
    assert [request["completion_tokens"] for request in report["requests"]] == [8, 8, 8]
    assert all(request["prompt_tokens"] >= 40 for request in report["requests"])


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_multiturn_sends_every_turn_and_reuses_the_history(server, endpoint: str):
    report = bench(server, "--endpoint", endpoint, "--dataset", "multiturn", "--turns", "3", "--num-requests", "2",
                   "--concurrency", "2", "--system-prompt-len", "60", "--input-len", "30", "--output-len", "6")
    assert (report["completed"], report["total_requests"]) == (6, 6)
    assert_sane(report)
    assert_usage_matches_the_log(report)
    for conversation in (0, 1):
        turns = [request for request in report["requests"] if request["conversation"] == conversation]
        assert [request["turn"] for request in turns] == [1, 2, 3]
        prompts = [request["prompt_tokens"] for request in turns]
        assert prompts == sorted(prompts) and prompts[0] < prompts[-1]  # each turn replays the history
    rows = {row["turn"]: row for row in report["per_turn"]}
    assert [rows[turn]["requests"] for turn in (1, 2, 3)] == [2, 2, 2]
    assert rows[2]["cached_token_ratio"] > 0 and rows[3]["cached_token_ratio"] > 0
    assert report["cached_token_ratio"] > 0


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_tool_turns_are_valid_tool_calls_and_results(server, endpoint: str):
    report = bench(server, "--endpoint", endpoint, "--dataset", "multiturn", "--turns", "3", "--num-requests", "1",
                   "--tool-turns", "1", "--input-len", "20", "--output-len", "4")
    assert (report["completed"], report["failed"]) == (3, 0), report["errors"]
    assert_usage_matches_the_log(report)
    # every request declared the tool; turns 2 and 3 carry one more call and result each
    assert [record["shape"]["tools"] for record in report["started"]] == [1, 1, 1]
    assert [record["shape"]["messages"] for record in report["started"]] == [1, 3, 5]


def test_rejected_requests_are_counted_with_their_message(server):
    report = bench(server, "--model", ECHO_MODEL, "--num-requests", "3", "--input-len", "10", "--output-len", "4",
                   key="wrong-key")
    assert (report["completed"], report["failed"]) == (0, 3)
    assert len(report["errors"]) == 1 and report["errors"][0]["count"] == 3
    assert report["errors"][0]["message"].startswith("HTTP 401")
    assert report["mean_ttft_ms"] is None and report["cached_token_ratio"] is None
    table = invoke("--base-url", server.base_url, "--api-key", "wrong-key", "--model", ECHO_MODEL,
                   "--num-requests", "2", "--input-len", "10", "--output-len", "4", "--endpoint", "messages")
    assert table.exit_code == 0, table.output
    assert "Failed requests" in table.stdout and "2x HTTP 401" in table.stdout


def test_an_unreachable_server_is_one_error_line():
    result = invoke("--base-url", f"http://127.0.0.1:{free_port()}", "--num-requests", "1")
    assert result.exit_code in (1, 2)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: cannot reach the server"), result.stderr


def test_usage_errors_exit_2_and_bench_help_names_both_benchmarks():
    misplaced = invoke("--turns", "3")
    assert misplaced.exit_code == 2 and misplaced.stderr.splitlines() == [
        "Error: --turns needs --dataset multiturn"
    ]
    help_text = CliRunner().invoke(cli, ["bench", "--help"])
    assert help_text.exit_code == 0
    assert "serve" in help_text.stdout and "--synthetic" in help_text.stdout and "ARTIFACT" in help_text.stdout
    engine = CliRunner().invoke(cli, ["bench"])  # still the engine benchmark
    assert engine.exit_code == 2 and "--synthetic" in engine.stderr
