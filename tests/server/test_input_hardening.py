"""The hardened JSON front door and the no-500 rule, against a live echo server.

Every class of client input that used to end in an HTTP 500 or a dropped stream is replayed on every POST endpoint
it applies to, aggregate and streaming: deep nesting anywhere (also in an ignored field), integer literals beyond
Python's digit limit, huge integers in float fields, a non-string where a type string belongs, lone UTF-16
surrogates in echoed fields, and tool schemas / tool inputs nested deeper than the limit. Each must be a 400 in the
protocol's own error shape naming the field, with the server healthy afterwards. Nesting exactly at the limit is
accepted, rendered into the prompt and served. The streaming-failure path, the 500 handler and the Retry-After of
admission refusals are checked too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from live_server import ECHO_MODEL, LiveServer, start_servers, tiny_artifact, words

MAX_DEPTH = 64  # docs/serving.md, JSON input limits

# -- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def echo_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_artifact(tmp_path_factory, "echo")


@pytest.fixture(scope="module")
def echo(echo_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    args = ["--no-thinking", "--max-context", "8192", "--default-max-tokens", "16"]
    [server] = start_servers(tmp_path_factory.mktemp("hardening"), [(echo_artifact, args, {})], [ECHO_MODEL])
    yield server
    server.stop()


# -- building bodies with raw JSON ---------------------------------------------------------------------------------


class Raw:
    """JSON text to splice into a body verbatim (a literal no Python value serializes to)."""

    def __init__(self, text: str) -> None:
        self.text = text


def body_text(body: Any) -> str:
    """``body`` as JSON with every :class:`Raw` spliced in."""
    raws: list[str] = []

    def encode(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {(key.text if isinstance(key, Raw) else key): encode(item) for key, item in value.items()}
        if isinstance(value, list):
            return [encode(item) for item in value]
        return value

    text = json.dumps(encode(body))
    for index, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{index}\x00"), raw)
    return text


def nested_arrays(levels: int) -> Raw:
    return Raw("[" * levels + "0" + "]" * levels)


LONE = Raw('"\\ud800"')
HUGE_INT = Raw("7" * 4301)  # one digit beyond Python's int-string limit
FLOAT_OVERFLOW = Raw("9" * 400)  # an integer math.isfinite() cannot convert


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": ECHO_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}


def responses(**fields: Any) -> dict[str, Any]:
    return {"model": ECHO_MODEL, "max_output_tokens": 4, "input": "hi", "store": False, **fields}


def messages(**fields: Any) -> dict[str, Any]:
    return {"model": "local", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}


def count_tokens(**fields: Any) -> dict[str, Any]:
    return {"model": "local", "messages": [{"role": "user", "content": "hi"}], **fields}


CHAT, RESPONSES = "/v1/chat/completions", "/v1/responses"
MESSAGES, COUNT = "/v1/messages", "/v1/messages/count_tokens"
STREAMING = (CHAT, RESPONSES, MESSAGES)
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
TOOL_RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}


def tool_turns(block: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A history whose user (``where="user"``), assistant or tool_result turn holds ``block``."""
    if where == "assistant":
        return [{"role": "user", "content": "go"}, {"role": "assistant", "content": [block]},
                {"role": "user", "content": "again"}]
    if where == "tool_result":
        return [{"role": "user", "content": "go"}, {"role": "assistant", "content": [TOOL_USE]},
                {"role": "user", "content": [{**TOOL_RESULT, "content": [block]}]}]
    return [{"role": "user", "content": [block]}]


DEEP_ARGUMENTS = '{"x": ' + nested_arrays(600).text + "}"  # a JSON-object string nested 601 deep

#: (case id, endpoint, body, code, param: the exact field, or the start of a deep path ending in "...")
CASES: list[tuple[str, str, Any, str, str]] = []
WRONG_TYPE = "expected a string, got"  # the message of every non-string where a string belongs
for path, build, param_style in ((CHAT, chat, "[0]"), (RESPONSES, responses, "[0]"), (MESSAGES, messages, ".0"),
                                 (COUNT, count_tokens, ".0")):
    name = path.rsplit("/", 1)[-1]
    CASES += [
        (f"{name}-deep-in-ignored-field", path, build(x_ignored=nested_arrays(1000)), "invalid_json",
         f"x_ignored{param_style}..."),
        (f"{name}-int-digit-limit", path, build(max_tokens=HUGE_INT) if path != RESPONSES
         else build(max_output_tokens=HUGE_INT), "invalid_json", "max_output_tokens" if path == RESPONSES
         else "max_tokens"),
        (f"{name}-float-field-overflow", path, build(temperature=FLOAT_OVERFLOW), "invalid_json", "temperature"),
        (f"{name}-non-finite-float", path, build(top_p=Raw("1e999")), "invalid_json", "top_p"),
        (f"{name}-nan-literal", path, build(top_p=Raw("NaN")), "invalid_json", "top_p"),
        (f"{name}-lone-surrogate-model", path, build(model=LONE), "invalid_json", "model"),
        (f"{name}-lone-surrogate-key", path, build(**{"x\ud800": 1}), "invalid_json", "['x\\ud800']"),
        (f"{name}-not-utf8", path, Raw(body_text(build())[:-1] + ', "x": "\udcff"}'), "invalid_json",
         "request body"),  # \udcff: the byte 0xff on the wire (surrogateescape)
    ]
CASES += [
    # a non-string where a type string belongs
    ("chat-type-object", CHAT, chat(messages=[{"role": "user", "content": [{"type": {}}]}]), "invalid_value",
     "messages[0].content[0].type"),
    ("chat-role-object", CHAT, chat(messages=[{"role": {}, "content": "x"}]), "invalid_value", "messages[0].role"),
    ("responses-type-object", RESPONSES, responses(input=[{"role": "user", "content": [{"type": {}}]}]),
     "invalid_value", "input[0].content[0].type"),
    ("responses-item-type-object", RESPONSES, responses(input=[{"type": {}}]), "invalid_value", "input[0].type"),
    ("responses-tool-type-object", RESPONSES, responses(tools=[{"type": {}}]), "invalid_value", "tools[0].type"),
    ("responses-allowed-tool-name-object", RESPONSES, responses(
        tools=[{"type": "function", "name": "f"}],
        tool_choice={"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": {}}]}),
     "invalid_value", "tool_choice.tools[0].name"),
    *[(f"{name}-{where}-block-type-object", path, build(messages=tool_turns({"type": {}}, where)), "invalid_value",
       {"user": "messages.0.content.0.type", "assistant": "messages.1.content.0.type",
        "tool_result": "messages.2.content.0.content.0.type"}[where])
      for path, build, name in ((MESSAGES, messages, "messages"), (COUNT, count_tokens, "count_tokens"))
      for where in ("user", "assistant", "tool_result")],
    ("messages-system-type-list", MESSAGES, messages(system=[{"type": [], "text": "s"}]), "invalid_value",
     "system.0.type"),
    ("messages-tool-choice-type-object", MESSAGES, messages(tool_choice={"type": {}}), "invalid_value",
     "tool_choice.type"),
    # lone surrogates in fields that are echoed back or rendered
    ("chat-surrogate-content", CHAT, chat(messages=[{"role": "user", "content": LONE}]), "invalid_json",
     "messages[0].content"),
    ("chat-surrogate-metadata", CHAT, chat(metadata={"k": LONE}), "invalid_json", "metadata.k"),
    *[(f"responses-surrogate-{field}", RESPONSES, responses(**{field: LONE}), "invalid_json", field)
      for field in ("instructions", "user", "prompt_cache_key", "input")],
    ("responses-surrogate-metadata", RESPONSES, responses(metadata={"k": LONE}), "invalid_json", "metadata.k"),
    ("responses-surrogate-input-text", RESPONSES, responses(
        input=[{"role": "user", "content": [{"type": "input_text", "text": Raw('"a\\udfffb"')}]}]),
     "invalid_json", "input[0].content[0].text"),
    ("responses-surrogate-unknown-key", RESPONSES, responses(**{"\ud83d": 1}), "invalid_json", "['\\ud83d']"),
    ("messages-surrogate-system", MESSAGES, messages(system=LONE), "invalid_json", "system"),
    ("count-surrogate-tool-name", COUNT, count_tokens(tools=[{"name": LONE, "input_schema": {"type": "object"}}]),
     "invalid_json", "tools.0.name"),
    # nesting beyond the limit inside accepted values (used to pass the parser and fail in prompt rendering)
    ("chat-deep-tool-schema", CHAT, chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"default": nested_arrays(600)}}}}}]),
     "invalid_json", "tools[0].function.parameters.properties.x.default[0]..."),
    ("responses-deep-tool-schema", RESPONSES, responses(tools=[{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"x": {"default": nested_arrays(600)}}}}]),
     "invalid_json", "tools[0].parameters.properties.x.default[0]..."),
    *[(f"{name}-deep-tool-use-input", path, build(messages=tool_turns(
        {**TOOL_USE, "input": {"city": nested_arrays(600)}}, "assistant")), "invalid_json",
       "messages.1.content.0.input.city.0...")
      for path, build, name in ((MESSAGES, messages, "messages"), (COUNT, count_tokens, "count_tokens"))],
    ("chat-deep-arguments-string", CHAT, chat(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": DEEP_ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]),
     "invalid_value", "messages[1].tool_calls[0].function.arguments"),
    ("responses-deep-arguments-string", RESPONSES, responses(input=[
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "f",
         "arguments": DEEP_ARGUMENTS},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]),
     "invalid_value", "input[1].arguments"),
]


def send(server: LiveServer, path: str, body: Any, stream: bool = False) -> httpx.Response:
    text = body.text if isinstance(body, Raw) else body_text({**body, "stream": True} if stream else body)
    return httpx.post(server.url(path), content=text.encode("utf-8", "surrogateescape"),
                      headers={"content-type": "application/json"}, timeout=60)


def assert_field_error(response: httpx.Response, path: str, code: str, param: str) -> None:
    """A 400 in the protocol's own error shape that names ``param`` (a prefix when it ends in "...")."""
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    error = body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["request_id"] == response.headers["request-id"]
        assert (error["type"], error["code"]) == ("invalid_request_error", code), error
        named = error["message"].split(": ", 1)[0]
    else:
        assert (error["type"], error["code"]) == ("invalid_request_error", code), error
        named = error["param"] or error["message"].split(": ", 1)[0]  # a body-wide problem has no param
        assert error["message"].startswith(named), error
    if param.endswith("..."):
        assert named.startswith(param[:-3]), (named, param)
    else:
        assert named == param, (named, param)
    assert len(error["message"]) < 4200


@pytest.mark.parametrize(("path", "body", "code", "param"), [case[1:] for case in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("stream", [False, True], ids=["aggregate", "stream"])
def test_client_input_is_a_field_specific_400_never_a_500(echo, path, body, code, param, stream):
    if stream and (path not in STREAMING or isinstance(body, Raw)):
        pytest.skip("no streaming variant")
    response = send(echo, path, body, stream)
    assert_field_error(response, path, code, param)
    if code == "invalid_value" and param.endswith((".type", ".role", ".name")):
        assert WRONG_TYPE in response.json()["error"]["message"]
    assert httpx.get(echo.url("/health")).json() == {"status": "ok"}


def test_the_sdks_see_the_front_door_errors(echo):
    with pytest.raises(openai.BadRequestError) as chat_error:
        echo.client().chat.completions.create(model=ECHO_MODEL, messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"x": json.loads("[" * 70 + "]" * 70)})
    assert chat_error.value.body["code"] == "invalid_json" and chat_error.value.body["param"].startswith("x[0]")
    sdk = anthropic.Anthropic(base_url=echo.base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as messages_error:
        sdk.messages.create(model="local", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                            extra_body={"x": json.loads("[" * 70 + "]" * 70)})
    assert messages_error.value.body["error"]["code"] == "invalid_json"
    assert "nests deeper than 64 levels" in messages_error.value.body["error"]["message"]


def test_error_messages_quote_only_a_bounded_escaped_slice(echo):
    long_key = "k" * 5000
    response = send(echo, RESPONSES, responses(**{long_key: 1}))
    assert response.status_code == 400 and response.json()["error"]["code"] == "unknown_parameter"
    error = response.json()["error"]
    assert len(error["message"]) < 200 and len(error["param"]) < 200 and "..." in error["message"]
    unknown = send(echo, CHAT, chat(messages=[{"role": "user", "content": [{"type": "x" * 100_000}]}]))
    assert unknown.status_code == 400 and len(unknown.json()["error"]["message"]) < 300
    control = send(echo, MESSAGES, messages(messages=[{"role": "user", "content": [{"type": "\x1b[31mred\n"}]}]))
    message = control.json()["error"]["message"]
    assert "\x1b" not in message and "\n" not in message and "\\x1b" in message


# -- the parser itself ----------------------------------------------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers(-10**30, 10**30) | st.floats(allow_nan=False, allow_infinity=False)
           | st.text(st.characters(max_codepoint=0x1F600) | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                     max_size=6))
VALUES = st.recursive(SCALARS, lambda children: st.lists(children, max_size=4)
                      | st.dictionaries(st.text(max_size=4) | SCALARS.filter(lambda v: isinstance(v, str)), children,
                                        max_size=4), max_leaves=30)


def lone_surrogates(value: Any) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(char) <= 0xDFFF for char in value)
    if isinstance(value, list):
        return any(lone_surrogates(item) for item in value)
    if isinstance(value, dict):
        return any(lone_surrogates(key) or lone_surrogates(item) for key, item in value.items())
    return False


@settings(max_examples=1500, deadline=None, database=None)
@given(VALUES)
def test_the_parser_agrees_with_json_within_the_limits_and_rejects_only_lone_surrogates(value):
    from ninfer.core.json_input import JsonInputError, parse_json

    text = json.dumps(value)  # ASCII: astral characters as surrogate pairs, other surrogates as escapes
    meaning = json.loads(text)  # adjacent high + low escapes mean one astral character
    if lone_surrogates(meaning):
        with pytest.raises(JsonInputError, match="lone UTF-16 surrogate"):
            parse_json(text.encode())
    else:
        assert parse_json(text.encode()) == meaning
        assert parse_json(json.dumps(meaning, ensure_ascii=False).encode()) == meaning


@settings(max_examples=3000, deadline=None, database=None)
@given(st.text(st.sampled_from(list('[]{},:"\\u0d89eE.+-12 \ntrufalsNIy')), max_size=300))
def test_the_parser_raises_nothing_but_its_400_on_arbitrary_text(text):
    from ninfer.core.json_input import JsonInputError, parse_json

    for form in (text, text.encode()):
        try:
            parse_json(form)
        except JsonInputError as exc:
            assert exc.status == 400 and exc.code == "invalid_json"


# -- nesting exactly at the limit ----------------------------------------------------------------------------------


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((depth(item) for item in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth(item) for item in value), default=0)
    return 0


def at_depth(body_with: Any, total: int) -> Any:
    """``body_with(value)`` where ``value`` is nested arrays that make the whole body exactly ``total`` deep."""
    inner = total - depth(body_with(0))
    value: Any = 0
    for _ in range(inner):
        value = [value]
    body = body_with(value)
    assert depth(body) == total
    return body


def chat_schema_body(value: Any) -> dict[str, Any]:
    return chat(max_tokens=8, tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "default": value}}}}}],
        messages=[{"role": "user", "content": "at the limit"}])


def responses_schema_body(value: Any) -> dict[str, Any]:
    return responses(max_output_tokens=8, input="at the limit", tools=[{"type": "function", "name": "f",
                     "parameters": {"type": "object", "properties": {"x": {"type": "array", "default": value}}}}])


def messages_tool_use_body(value: Any) -> dict[str, Any]:
    return messages(max_tokens=8, tools=[{"name": "get_weather", "input_schema": {
        "type": "object", "properties": {"city": {"default": value}}}}],
        messages=[{"role": "user", "content": "go"}, {"role": "assistant", "content": [{**TOOL_USE, "input": {
            "city": value}}]}, {"role": "user", "content": [{**TOOL_RESULT, "content": "at the limit"}]}])


def count_tool_use_body(value: Any) -> dict[str, Any]:
    return {key: item for key, item in messages_tool_use_body(value).items() if key != "max_tokens"}


def input_tokens_schema_body(value: Any) -> dict[str, Any]:
    return {key: item for key, item in responses_schema_body(value).items() if key in ("model", "input", "tools")}


CHAT_DEFAULT = "tools[0].function.parameters.properties.x.default[0]..."
RESPONSES_DEFAULT = "tools[0].parameters.properties.x.default[0]..."
TOOL_USE_CITY = "messages.1.content.0.input.city.0..."
LIMIT_CASES = [(CHAT, chat_schema_body, CHAT_DEFAULT), (RESPONSES, responses_schema_body, RESPONSES_DEFAULT),
               (MESSAGES, messages_tool_use_body, TOOL_USE_CITY), (COUNT, count_tool_use_body, TOOL_USE_CITY),
               ("/v1/responses/input_tokens", input_tokens_schema_body, RESPONSES_DEFAULT)]


@pytest.mark.parametrize(("path", "body_with", "deepest"), LIMIT_CASES, ids=[case[0] for case in LIMIT_CASES])
def test_nesting_at_the_limit_is_rendered_and_served_and_one_more_level_is_a_400(echo, path, body_with, deepest):
    limit, over = at_depth(body_with, MAX_DEPTH), at_depth(body_with, MAX_DEPTH + 1)
    served = send(echo, path, limit)
    assert served.status_code == 200, served.text
    shallow = send(echo, path, at_depth(body_with, 16)).json()
    if path.endswith(("count_tokens", "input_tokens")):
        key = "input_tokens"
        assert served.json()[key] > shallow[key]  # the deep value is part of the rendered prompt
    else:
        usage = served.json()["usage"]
        tokens = usage.get("prompt_tokens", usage.get("input_tokens"))
        shallow_tokens = shallow["usage"].get("prompt_tokens", shallow["usage"].get("input_tokens"))
        assert tokens > shallow_tokens
        if path in STREAMING:
            streamed = send(echo, path, limit, stream=True)
            assert streamed.status_code == 200, streamed.text
            assert not any(marker in streamed.text for marker in ('"error":{', "event: error", "response.failed"))
    rejected = send(echo, path, over)
    assert_field_error(rejected, path, "invalid_json", deepest)
    assert "nests deeper than 64 levels" in rejected.text


def test_a_generated_call_too_deep_to_replay_stays_text_and_replays(echo):
    """Model output is read as JSON only while a replay stays within the limit (57 levels for an argument value)."""
    for levels, kind in ((57, list), (58, str), (900, str)):
        script = (f"<tool_call>\n<function=f>\n<parameter=x>\n{'[' * levels}1{']' * levels}\n</parameter>\n"
                  "</function>\n</tool_call>")
        body = chat(max_tokens=4000, tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {}}}}}],
            messages=[{"role": "user", "content": f"```ninfer-echo\n{script}\n```"}])
        response = send(echo, CHAT, body)
        assert response.status_code == 200, response.text
        message = response.json()["choices"][0]["message"]
        arguments = json.loads(message["tool_calls"][0]["function"]["arguments"])
        assert isinstance(arguments["x"], kind)
        call = message["tool_calls"][0]
        replay = [*body["messages"], {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
        for form in (call["function"]["arguments"], arguments):  # string and object form
            replay[1]["tool_calls"][0]["function"]["arguments"] = form
            assert send(echo, CHAT, {**body, "messages": replay, "max_tokens": 2}).status_code == 200


# -- streams that fail after the first byte ------------------------------------------------------------------------


@pytest.fixture
def error_log() -> Iterator[list[logging.LogRecord]]:
    """ERROR records of the ``ninfer`` operational logger (which may not propagate to the root logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ninfer")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level or logging.ERROR, logging.ERROR))
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


class _Generation:
    request_id = "req-test"

    def __init__(self) -> None:
        self.closed = False

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class _Request:
    scope: dict[str, Any] = {}


async def _failing_frames() -> Any:
    yield b"data: first\n\n"
    raise KeyError("an internal invariant broke")


def _drain(error_frame: Any) -> list[bytes]:
    from ninfer.server.generation import GenerationStream

    async def run() -> list[bytes]:
        stream = GenerationStream(_Request(), _Generation(), _failing_frames(), error_frame)
        frames = [frame async for frame in stream]
        await stream.close()
        return frames

    return asyncio.run(run())


def test_a_stream_failing_mid_response_ends_with_the_chat_error_frame(error_log):
    from ninfer.protocols.openai_chat.adapter import error_frame

    frames = _drain(lambda error: error_frame(error, "req-test"))
    assert frames[0] == b"data: first\n\n" and len(frames) == 2
    payload = json.loads(frames[1].decode().removeprefix("data: "))
    assert payload == {"error": {"message": "internal server error", "type": "server_error", "param": None,
                                 "code": "internal_error"}}
    [record] = error_log
    assert "req-test" in record.getMessage() and "KeyError" in record.getMessage()
    assert "_failing_frames" in record.getMessage()  # the traceback


def test_a_stream_failing_mid_response_ends_with_the_anthropic_error_event():
    from ninfer.protocols.anthropic.adapter import error_frame

    frames = _drain(lambda error: error_frame(error, "req_test"))
    head, data = frames[1].decode().split("\n", 1)
    assert head == "event: error"
    payload = json.loads(data.removeprefix("data: "))
    assert payload["type"] == "error" and payload["request_id"] == "req_test"
    assert payload["error"] == {"type": "api_error", "message": "internal server error", "code": "internal_error"}


def test_a_stream_failing_mid_response_ends_with_response_failed():
    from ninfer.protocols.openai_responses.adapter import ResponseEvents

    class Run:
        def snapshot(self, status: str, **fields: Any) -> dict[str, Any]:
            return {"id": "resp_1", "object": "response", "status": status, **fields}

    events = ResponseEvents(Run())  # type: ignore[arg-type]
    frames = _drain(events.failed_frame)
    head, data = frames[1].decode().split("\n", 1)
    assert head == "event: response.failed"
    payload = json.loads(data.removeprefix("data: "))
    assert payload["type"] == "response.failed" and payload["response"]["status"] == "failed"
    assert payload["response"]["error"] == {"code": "internal_error", "message": "internal server error"}


def test_a_typed_error_mid_stream_is_rendered_as_itself_without_an_error_log(error_log):
    from ninfer.core.errors import EngineUnavailableError
    from ninfer.protocols.openai_chat.adapter import error_frame
    from ninfer.server.generation import GenerationStream

    async def frames() -> Any:
        yield b"data: first\n\n"
        raise EngineUnavailableError("the engine failed")

    async def run() -> list[bytes]:
        stream = GenerationStream(_Request(), _Generation(), frames(), lambda error: error_frame(error, "r"))
        collected = [frame async for frame in stream]
        await stream.close()
        return collected

    collected = asyncio.run(run())
    assert json.loads(collected[1].decode().removeprefix("data: "))["error"]["code"] == "engine_unavailable"
    assert not error_log


def test_encoders_cannot_fail_on_text_encoding():
    from ninfer.server.http import json_bytes, sse_frame

    assert json.loads(json_bytes({"text": "caf\u00e9 \ud800"})) == {"text": "caf\u00e9 \ud800"}
    assert json_bytes({"text": "caf\u00e9"}) == '{"text":"caf\u00e9"}'.encode()  # non-ASCII stays literal
    frame = sse_frame({"delta": "\udfff"}, event="x")
    assert frame.startswith(b"event: x\ndata: ") and json.loads(frame.split(b"data: ")[1]) == {"delta": "\udfff"}


def test_the_500_handler_logs_the_traceback_and_request_id_and_cannot_fail_on_encoding(error_log):
    from ninfer.server.app import _handle_unexpected

    class Context:
        protocol, request_id = "openai", "req-500"

    class Req:
        context, method, path = Context(), "POST", "/v1/chat/completions"

    class Resp:
        headers: dict[str, str] = {}

        def set_header(self, name: str, value: str) -> None:
            self.headers[name] = value

    def broken() -> None:
        raise TypeError("unhashable type: 'dict' \ud800")

    try:
        broken()
    except TypeError as caught:
        error = caught
    resp = Resp()
    asyncio.run(_handle_unexpected(Req(), resp, error, {}))
    assert resp.status == 500
    assert json.loads(resp.data) == {"error": {"message": "internal server error", "type": "server_error",
                                               "param": None, "code": "internal_error"}}
    [record] = error_log
    text = record.getMessage()
    assert "req-500" in text and "TypeError" in text and "in broken" in text and "\\ud800" in text
    text.encode("utf-8")  # the log line itself is encodable


def test_number_readers_reject_huge_integers_without_overflow():
    from ninfer.core.errors import InvalidRequestError
    from ninfer.protocols.fields import optional_number

    with pytest.raises(InvalidRequestError) as caught:
        optional_number({"temperature": 10**400}, "temperature", 0.0, 2.0)
    assert caught.value.param == "temperature" and caught.value.code == "invalid_value"
    assert len(caught.value.message) < 200
    assert optional_number({"temperature": 1}, "temperature", 0.0, 2.0) == 1.0


# -- Retry-After on admission refusals -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def busy(echo_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    """One active request, one waiting, a 2 s pending timeout, a slow echo model."""
    args = ["--no-thinking", "--max-concurrency", "1", "--max-pending-requests", "1", "--pending-timeout-ms", "2000",
            "--default-max-tokens", "512"]
    slow = {"NINFER_ECHO_DELAY_MS": "100"}
    [server] = start_servers(tmp_path_factory.mktemp("busy"), [(echo_artifact, args, slow)], [ECHO_MODEL])
    yield server
    server.stop()


class HeldLane:
    """A streamed echo request decoding for ~20 s, read in a thread; leaving the block disconnects it."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self.decoding = threading.Event()
        self.leave = threading.Event()
        self.thread = threading.Thread(target=self._consume)

    def _consume(self) -> None:
        body = chat(stream=True, max_tokens=200, messages=[{"role": "user", "content": words(200)}])
        with httpx.stream("POST", self.server.url(CHAT), json=body, timeout=60) as stream:
            for line in stream.iter_lines():
                if '"content":"alpha' in line:
                    self.decoding.set()
                if self.leave.is_set():
                    return

    def __enter__(self) -> "HeldLane":
        self.thread.start()
        assert self.decoding.wait(60), self.server.log()
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave.set()
        self.thread.join(60)


def refusals(server: LiveServer, waiting: tuple[str, dict[str, Any]],
             refused: tuple[str, dict[str, Any]]) -> Iterator[httpx.Response]:
    """With the lane held: ``waiting`` takes the pending slot (and times out), ``refused`` finds capacity full."""
    released = server.log().count("openai_chat cancelled")
    with HeldLane(server), ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(httpx.post, server.url(waiting[0]), json=waiting[1], timeout=60)
        time.sleep(1.0)  # the waiting request has reserved the pending slot (it is refused only after 2 s)
        refused_response = httpx.post(server.url(refused[0]), json=refused[1], timeout=60)
        waited_response = pending.result()
    server.wait_for_log(lambda text: text.count("openai_chat cancelled") > released)  # the held lane is free
    yield refused_response
    yield waited_response


@pytest.mark.slow
def test_overload_and_queue_timeout_carry_retry_after(busy):
    overloaded, timed_out = refusals(busy, (CHAT, chat(stream=True)), (CHAT, chat()))
    assert overloaded.status_code == 429 and overloaded.json()["error"]["code"] == "server_overloaded"
    assert timed_out.status_code == 503 and timed_out.json()["error"]["code"] == "request_queue_timeout"
    overloaded_529, timed_out_504 = refusals(busy, (MESSAGES, messages()), (MESSAGES, messages(stream=True)))
    assert overloaded_529.status_code == 529 and overloaded_529.json()["error"]["type"] == "overloaded_error"
    assert timed_out_504.status_code == 504 and timed_out_504.json()["error"]["code"] == "request_queue_timeout"
    for response in (overloaded, timed_out, overloaded_529, timed_out_504):
        assert response.headers["retry-after"] == "1"
    assert httpx.post(busy.url(CHAT), json=chat(), timeout=60).status_code == 200
