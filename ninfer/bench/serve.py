"""``ninfer bench serve``: a streaming client benchmark against a running server, after ``vllm bench serve``.

Rules:

- Conversations (the ``random`` dataset: one request each) arrive as a Poisson process of ``--request-rate`` per
  second (``inf``: all at once) and at most ``--concurrency`` are in flight; a conversation sends its turns one
  after another, each replaying the history (``ninfer.bench.datasets``). Every request streams (SSE).
- Times are the client's (``time.perf_counter``), from just before a request is sent. TTFT ends at the first
  output delta (content, reasoning or tool-call arguments); ITL are the gaps between successive output deltas;
  E2E ends when the stream closes; TPOT = (E2E - TTFT) / (completion tokens - 1), for requests of at least two.
- Token counts are the server's final usage; cached tokens are the prompt tokens it says came from its cache.
- A request fails on a non-200 status, an error event, a transport error or a stream that ends before its final
  event; it is counted with its message and its conversation stops there. Only the setup (an unreachable server,
  no model id) stops the benchmark, as a ``click.ClickException`` (one ``Error:`` line).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Any, AsyncIterator, Callable, Sequence

import attrs
import click
import httpx

from ninfer.bench.datasets import (
    DATASETS,
    ENDPOINTS,
    Conversation,
    Message,
    Reply,
    extend_history,
    multiturn_dataset,
    random_dataset,
    request_body,
)
from ninfer.bench.stats import percentile

ANTHROPIC_VERSION = "2023-06-01"
ERRORS_SHOWN = 5
METRICS = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p99")
MULTITURN_DEFAULTS = {"turns": 4, "system_prompt_len": 0, "tool_turns": 0.0}
CONNECT_TIMEOUT_S = 10.0
JSON_CONTENT = {"content-type": "application/json"}


@attrs.frozen
class ServeSettings:
    """The resolved options of one run; the three multiturn-only fields are None for ``random``."""

    base_url: str
    api_key: str | None
    model: str | None
    endpoint: str
    dataset: str
    num_requests: int
    concurrency: int
    request_rate: float
    input_len: int
    output_len: int
    range_ratio: float
    turns: int | None
    system_prompt_len: int | None
    tool_turns: float | None
    seed: int
    timeout: float


@attrs.define
class RequestRecord:
    """What one request measured (seconds) and what the server's usage said."""

    conversation: int
    turn: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = attrs.Factory(list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)

    def as_json(self) -> dict[str, Any]:
        return {
            "conversation": self.conversation, "turn": self.turn, "ok": self.ok, "error": self.error,
            "ttft_ms": _ms(self.ttft), "tpot_ms": _ms(self.tpot), "e2e_ms": _ms(self.e2e),
            "output_deltas": len(self.itl) + (self.ttft is not None),
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


# -- reading a stream ----------------------------------------------------------------------------------------------


@attrs.define
class StreamState:
    """What a stream said so far: its output text, the final usage, an error, whether its final event came."""

    content: list[str] = attrs.Factory(list)
    reasoning: list[str] = attrs.Factory(list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    done: bool = False


def error_text(payload: Any) -> str:
    """A one-line message of an error payload in the OpenAI (``{"error": {...}}``), Anthropic (``{"type": "error",
    "error": {...}}``) or Responses event (``{"code", "message"}``) shape; else the payload as text."""
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(error, dict) and (error.get("message") or error.get("code")):
        code = error.get("code") or error.get("type")
        message = error.get("message")
        text = f"{code}: {message}" if code and message else str(message or code)
    else:
        text = str(error)
    return " ".join(text.split())


def _append(sink: list[str], text: Any) -> bool:
    if isinstance(text, str) and text:
        sink.append(text)
        return True
    return False


def _count(value: Any) -> int:
    return value if isinstance(value, int) else 0


def read_chat(state: StreamState, data: str) -> bool:
    """One Chat Completions chunk (or ``[DONE]``); True when it carried output."""
    if data == "[DONE]":
        state.done = True
        return False
    payload = json.loads(data)
    if "error" in payload:
        state.error = error_text(payload)
        return False
    usage = payload.get("usage")
    if isinstance(usage, dict):
        state.prompt_tokens = _count(usage.get("prompt_tokens"))
        state.completion_tokens = _count(usage.get("completion_tokens"))
        state.cached_tokens = _count((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    output = False
    for choice in payload.get("choices") or ():
        delta = choice.get("delta") or {}
        output |= _append(state.content, delta.get("content"))
        output |= _append(state.reasoning, delta.get("reasoning_content") or delta.get("reasoning"))
        output |= bool(delta.get("tool_calls"))
    return output


RESPONSES_TEXT = {"response.output_text.delta": "content", "response.reasoning_text.delta": "reasoning",
                  "response.reasoning_summary_text.delta": "reasoning"}
RESPONSES_CALLS = ("response.function_call_arguments.delta", "response.custom_tool_call_input.delta")


def read_responses(state: StreamState, data: str) -> bool:
    """One Responses event; ``response.completed`` / ``response.incomplete`` (an output limit) end it."""
    payload = json.loads(data)
    kind = payload.get("type")
    if kind in RESPONSES_TEXT:
        return _append(getattr(state, RESPONSES_TEXT[kind]), payload.get("delta"))
    if kind in RESPONSES_CALLS:
        return bool(payload.get("delta"))
    if kind in ("response.completed", "response.incomplete"):
        usage = (payload.get("response") or {}).get("usage") or {}
        state.prompt_tokens = _count(usage.get("input_tokens"))
        state.completion_tokens = _count(usage.get("output_tokens"))
        state.cached_tokens = _count((usage.get("input_tokens_details") or {}).get("cached_tokens"))
        state.done = True
    elif kind == "response.failed":
        state.error = error_text(payload.get("response") or payload)
    elif kind == "error":
        state.error = error_text(payload)
    return False


def _anthropic_usage(state: StreamState, usage: Any) -> None:
    """Anthropic ``input_tokens`` leave out the cache reads and writes; the prompt is their sum."""
    if not isinstance(usage, dict):
        return
    if "output_tokens" in usage:
        state.completion_tokens = _count(usage["output_tokens"])
    if isinstance(usage.get("input_tokens"), int):
        cached = _count(usage.get("cache_read_input_tokens"))
        state.prompt_tokens = usage["input_tokens"] + cached + _count(usage.get("cache_creation_input_tokens"))
        state.cached_tokens = cached


ANTHROPIC_DELTAS = {"text_delta": ("content", "text"), "thinking_delta": ("reasoning", "thinking")}


def read_messages(state: StreamState, data: str) -> bool:
    """One Anthropic Messages event; usage from ``message_start`` (prompt) and ``message_delta`` (output)."""
    payload = json.loads(data)
    kind = payload.get("type")
    if kind == "content_block_delta":
        delta = payload.get("delta") or {}
        if delta.get("type") in ANTHROPIC_DELTAS:
            sink, key = ANTHROPIC_DELTAS[delta["type"]]
            return _append(getattr(state, sink), delta.get(key))
        return delta.get("type") == "input_json_delta" and bool(delta.get("partial_json"))
    if kind == "message_start":
        _anthropic_usage(state, (payload.get("message") or {}).get("usage"))
    elif kind == "message_delta":
        _anthropic_usage(state, payload.get("usage"))
    elif kind == "message_stop":
        state.done = True
    elif kind == "error":
        state.error = error_text(payload)
    return False


READERS: dict[str, Callable[[StreamState, str], bool]] = {
    "chat": read_chat, "responses": read_responses, "messages": read_messages,
}


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data`` of each SSE event (several ``data:`` lines joined by newlines); comments and other fields are
    skipped."""
    lines: list[str] = []
    async for line in response.aiter_lines():
        if not line:
            if lines:
                yield "\n".join(lines)
                lines = []
        elif line.startswith("data:"):
            value = line[len("data:"):]
            lines.append(value[1:] if value.startswith(" ") else value)
    if lines:
        yield "\n".join(lines)


def _response_error(response: httpx.Response) -> str:
    try:
        detail = error_text(response.json())
    except ValueError:
        detail = " ".join(response.text.split())[:200] or response.reason_phrase
    return f"HTTP {response.status_code}: {detail}"


def _exception_text(exc: BaseException) -> str:
    detail = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


# -- the client loop -----------------------------------------------------------------------------------------------


async def send(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any], record: RequestRecord) -> Reply | None:
    """Stream one request into ``record``; the reply when it succeeded, else None (``record.error`` says why)."""
    reader = READERS[endpoint]
    state = StreamState()
    payload = json.dumps(body, ensure_ascii=False).encode("utf-8")  # encoded before the clock starts
    start = time.perf_counter()
    last: float | None = None
    try:
        async with client.stream("POST", ENDPOINTS[endpoint], content=payload, headers=JSON_CONTENT) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = _response_error(response)
                return None
            async for data in sse_data(response):
                if reader(state, data):
                    now = time.perf_counter()
                    if last is None:
                        record.ttft = now - start
                    else:
                        record.itl.append(now - last)
                    last = now
                if state.error is not None:
                    break
    except Exception as exc:  # one request's failure, whatever it is, is counted and never ends the benchmark
        record.error = _exception_text(exc)
        return None
    record.e2e = time.perf_counter() - start
    record.prompt_tokens, record.completion_tokens = state.prompt_tokens, state.completion_tokens
    record.cached_tokens = state.cached_tokens
    if state.error is not None:
        record.error = state.error
    elif not state.done:
        record.error = "the stream ended before its final event"
    else:
        record.ok = True
        return Reply("".join(state.content), "".join(state.reasoning))
    return None


async def run_conversation(client: httpx.AsyncClient, settings: ServeSettings, model: str,
                           conversation: Conversation, records: list[RequestRecord]) -> None:
    """Send the conversation's turns in order, each with the history so far; stop at the first failure."""
    history: list[Message] = []
    reply: Reply | None = None
    for number, turn in enumerate(conversation.turns, 1):
        history = extend_history(history, reply, turn)
        record = RequestRecord(conversation.index, number)
        records.append(record)
        body = request_body(settings.endpoint, model, conversation, history, turn.max_tokens)
        reply = await send(client, settings.endpoint, body, record)
        if reply is None:
            return


def arrival_offsets(rng: random.Random, count: int, rate: float) -> list[float]:
    """Start offsets (seconds) of a Poisson process of ``rate`` per second, the first at 0; all 0 when infinite."""
    if math.isinf(rate):
        return [0.0] * count
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


async def drive(client: httpx.AsyncClient, settings: ServeSettings, model: str,
                conversations: Sequence[Conversation]) -> tuple[list[RequestRecord], float]:
    """Every conversation at its arrival time, at most ``concurrency`` at once; the records and the duration."""
    records: list[RequestRecord] = []
    gate = asyncio.Semaphore(settings.concurrency)
    offsets = arrival_offsets(random.Random(f"{settings.seed}:arrivals"), len(conversations), settings.request_rate)
    start = time.perf_counter()

    async def arrive(conversation: Conversation, offset: float) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with gate:
            await run_conversation(client, settings, model, conversation, records)

    await asyncio.gather(*(arrive(conversation, offset) for conversation, offset in zip(conversations, offsets)))
    duration = time.perf_counter() - start
    return sorted(records, key=lambda record: (record.conversation, record.turn)), duration


def build_dataset(settings: ServeSettings) -> list[Conversation]:
    rng = random.Random(settings.seed)
    if settings.dataset == "random":
        return random_dataset(
            rng, settings.num_requests, settings.input_len, settings.output_len, settings.range_ratio
        )
    assert settings.turns is not None and settings.system_prompt_len is not None and settings.tool_turns is not None
    return multiturn_dataset(
        rng, settings.num_requests, turns=settings.turns, input_len=settings.input_len,
        output_len=settings.output_len, ratio=settings.range_ratio, system_prompt_len=settings.system_prompt_len,
        tool_turns=settings.tool_turns,
    )


def _headers(settings: ServeSettings) -> dict[str, str]:
    headers = {"accept": "text/event-stream"}
    if settings.endpoint == "messages":
        headers["anthropic-version"] = ANTHROPIC_VERSION
    if settings.api_key:
        headers["authorization"] = f"Bearer {settings.api_key}"
        headers["x-api-key"] = settings.api_key
    return headers


async def resolve_model(client: httpx.AsyncClient, settings: ServeSettings) -> str:
    """``--model``, else the first id of ``GET /v1/models``; the request doubles as the reachability check."""
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        message = f"cannot reach the server at {settings.base_url}: {_exception_text(exc)}"
        raise click.ClickException(message) from None
    if settings.model:
        return settings.model
    if response.status_code != 200:
        raise click.ClickException(f"GET /v1/models failed ({_response_error(response)}); pass --model")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise click.ClickException("GET /v1/models names no model; pass --model") from None


async def run_serve_bench(settings: ServeSettings) -> dict[str, Any]:
    """Run the benchmark of ``settings``; the report (:func:`summarize`)."""
    timeout = httpx.Timeout(settings.timeout, connect=min(settings.timeout, CONNECT_TIMEOUT_S))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=settings.concurrency)
    async with httpx.AsyncClient(base_url=settings.base_url, headers=_headers(settings), timeout=timeout,
                                 limits=limits) as client:
        model = await resolve_model(client, settings)
        records, duration = await drive(client, settings, model, build_dataset(settings))
    return summarize(settings, model, records, duration)


# -- metrics and the report ----------------------------------------------------------------------------------------


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """Mean and p50/p90/p99 of ``values``; None each when there are none."""
    if not values:
        return dict.fromkeys(STATS)
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99)}


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def metric_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Milliseconds per metric over the successful requests (ITL: every gap of every request)."""
    done = [record for record in records if record.ok]
    return {
        "ttft": [record.ttft * 1000.0 for record in done if record.ttft is not None],
        "tpot": [record.tpot * 1000.0 for record in done if record.tpot is not None],
        "itl": [gap * 1000.0 for record in done for gap in record.itl],
        "e2e": [record.e2e * 1000.0 for record in done if record.e2e is not None],
    }


def per_turn(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Per turn index: requests sent and completed, prompt and cached tokens of the completed, their ratio."""
    rows = []
    for turn in sorted({record.turn for record in records}):
        sent = [record for record in records if record.turn == turn]
        done = [record for record in sent if record.ok]
        prompt, cached = sum(r.prompt_tokens for r in done), sum(r.cached_tokens for r in done)
        rows.append({"turn": turn, "requests": len(sent), "completed": len(done), "prompt_tokens": prompt,
                     "cached_tokens": cached, "cached_token_ratio": _ratio(cached, prompt)})
    return rows


def error_summary(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """The first :data:`ERRORS_SHOWN` distinct error messages, in order of first occurrence, with their counts."""
    counts: dict[str, int] = {}
    for record in records:
        if record.error is not None:
            counts[record.error] = counts.get(record.error, 0) + 1
    return [{"message": message, "count": count} for message, count in list(counts.items())[:ERRORS_SHOWN]]


def summarize(
    settings: ServeSettings, model: str, records: Sequence[RequestRecord], duration: float
) -> dict[str, Any]:
    """The report: the settings, counts, throughputs, token totals, metric distributions, per turn and per request."""
    done = [record for record in records if record.ok]
    prompt, output = sum(r.prompt_tokens for r in done), sum(r.completion_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    report: dict[str, Any] = {
        "endpoint": settings.endpoint, "path": ENDPOINTS[settings.endpoint], "base_url": settings.base_url,
        "model": model, "dataset": settings.dataset, "num_requests": settings.num_requests,
        "concurrency": settings.concurrency,
        "request_rate": None if math.isinf(settings.request_rate) else settings.request_rate,
        "input_len": settings.input_len, "output_len": settings.output_len, "range_ratio": settings.range_ratio,
        "turns": settings.turns, "system_prompt_len": settings.system_prompt_len, "tool_turns": settings.tool_turns,
        "seed": settings.seed,
        "total_requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "errors": error_summary(records),
        "duration_s": duration,
        "request_throughput": _rate(len(done), duration),
        "input_throughput": _rate(prompt, duration),
        "output_throughput": _rate(output, duration),
        "total_input_tokens": prompt, "total_output_tokens": output, "total_cached_tokens": cached,
        "cached_token_ratio": _ratio(cached, prompt),
    }
    for metric, values in metric_samples(records).items():
        for stat, value in distribution(values).items():
            report[f"{stat}_{metric}_ms"] = value
    report["per_turn"] = per_turn(records)
    report["requests"] = [record.as_json() for record in records]
    return report


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.1f} %"


def format_report(report: dict[str, Any]) -> str:
    """The report as a table (``--json`` prints the object instead)."""
    rate = "inf" if report["request_rate"] is None else f"{report['request_rate']:g}"
    shape = f"input {report['input_len']}, output {report['output_len']}, range ratio {report['range_ratio']:g}"
    if report["dataset"] == "multiturn":
        shape += (f", {report['turns']} turns, system prompt {report['system_prompt_len']}, "
                  f"tool turns {report['tool_turns']:g}")
    lines = [
        f"ninfer bench serve: {report['endpoint']} ({report['path']}) at {report['base_url']}, "
        f"model {report['model']}",
        f"dataset {report['dataset']} ({shape}); {report['num_requests']} "
        f"{'conversations' if report['dataset'] == 'multiturn' else 'requests'}, concurrency "
        f"{report['concurrency']}, request rate {rate}/s, seed {report['seed']}",
    ]
    rows = [
        ("Successful requests", str(report["completed"])),
        ("Failed requests", str(report["failed"])),
        ("Benchmark duration (s)", _number(report["duration_s"])),
        ("Request throughput (req/s)", _number(report["request_throughput"])),
        ("Input token throughput (tok/s)", _number(report["input_throughput"])),
        ("Output token throughput (tok/s)", _number(report["output_throughput"])),
        ("Total prompt tokens", str(report["total_input_tokens"])),
        ("Total completion tokens", str(report["total_output_tokens"])),
        ("Cached prompt tokens", f"{report['total_cached_tokens']} ({_percent(report['cached_token_ratio'])})"),
    ]
    lines += [f"  {label:<34}{value:>16}" for label, value in rows]
    lines.append(f"  {'(ms)':<10}" + "".join(f"{stat:>11}" for stat in STATS))
    for metric in METRICS:
        values = "".join(f"{_number(report[f'{stat}_{metric}_ms']):>11}" for stat in STATS)
        lines.append(f"  {metric.upper():<10}{values}")
    if report["dataset"] == "multiturn":
        lines.append("  cached-token ratio per turn:")
        for row in report["per_turn"]:
            lines.append(f"    turn {row['turn']:<3} {row['cached_tokens']:>8} / {row['prompt_tokens']:<8} "
                         f"{_percent(row['cached_token_ratio']):>8}   {row['completed']}/{row['requests']} completed")
    if report["errors"]:
        lines.append(f"  errors (first {ERRORS_SHOWN} distinct):")
        lines += [f"    {error['count']}x {error['message']}" for error in report["errors"]]
    return "\n".join(lines)


# -- the command ---------------------------------------------------------------------------------------------------


def _base_url(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    """The server root: no trailing slash, a trailing ``/v1`` dropped (an OpenAI SDK base URL works too)."""
    url = value.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise click.BadParameter(f"expected an http:// or https:// URL, got {value!r}")
    return url.removesuffix("/v1")


@click.command("serve")
@click.option("--base-url", default="http://127.0.0.1:8080", show_default=True, callback=_base_url,
              help="the server's root URL (a trailing /v1 is dropped)")
@click.option("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' and 'x-api-key: KEY'")
@click.option("--model", default=None, help="the model id to request  [default: the first id of GET /v1/models]")
@click.option("--endpoint", type=click.Choice(tuple(ENDPOINTS)), default="chat", show_default=True,
              help="chat: /v1/chat/completions, responses: /v1/responses, messages: /v1/messages (Anthropic)")
@click.option("--dataset", type=click.Choice(DATASETS), default="random", show_default=True,
              help="random: one-turn requests of random words; multiturn: conversations replaying each answer")
@click.option("--num-requests", type=click.IntRange(min=1), default=16, show_default=True,
              help="requests to send (multiturn: conversations)")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="requests (multiturn: conversations) in flight at most")
@click.option("--request-rate", type=click.FloatRange(min=0, min_open=True), default=math.inf, show_default=True,
              help="arrivals per second, Poisson (multiturn: conversations); inf: all at once")
@click.option("--input-len", type=click.IntRange(min=1), default=1024, show_default=True,
              help="about this many prompt tokens of text (multiturn: per new user message or tool result)")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True,
              help="max_tokens / max_output_tokens of every request")
@click.option("--range-ratio", type=click.FloatRange(0, 1, max_open=True), default=0.0, show_default=True,
              help="draw each length uniformly from [len*(1-R), len*(1+R)]")
@click.option("--turns", type=click.IntRange(min=1), default=None,
              help="multiturn: requests per conversation  [default: 4]")
@click.option("--system-prompt-len", type=click.IntRange(min=0), default=None,
              help="multiturn: tokens of a system prompt shared by every conversation  [default: 0]")
@click.option("--tool-turns", type=click.FloatRange(0, 1), default=None, metavar="FRACTION",
              help="multiturn: the fraction of turns after the first that replay the answer with a tool call and "
                   "send the tool's result instead of a user message  [default: 0]")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the prompts and the arrivals")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="seconds to wait for the next bytes of a response")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of the table")
@click.option("--output-json", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="also write the JSON object to FILE")
def serve_command(as_json: bool, output_json: str | None, **options: Any) -> None:
    """Benchmark a running server over HTTP: streamed requests, TTFT / TPOT / ITL / E2E percentiles, throughput
    and the prompt tokens the server's cache served."""
    multiturn = {name: options[name] for name in MULTITURN_DEFAULTS}
    if options["dataset"] == "random":
        given = [f"--{name.replace('_', '-')}" for name, value in multiturn.items() if value is not None]
        if given:
            raise click.UsageError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --dataset multiturn")
    else:
        options.update({name: value if value is not None else MULTITURN_DEFAULTS[name]
                        for name, value in multiturn.items()})
    report = asyncio.run(run_serve_bench(ServeSettings(**options)))
    if output_json is not None:
        try:
            with open(output_json, "w", encoding="utf-8") as out:
                out.write(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            raise click.ClickException(f"cannot write {output_json}: {exc.strerror or exc}") from None
    click.echo(json.dumps(report) if as_json else format_report(report))
