"""Property-based fuzzing of every POST endpoint that reads a body, over raw bytes against one live server.

Each example starts from a valid request (the shapes tests/protocols sends) and mutates it: a value replaced by
another JSON type; sizes (long strings, huge numbers, 4,301-digit integers, 400-digit floats); nesting (arrays and
objects up to thousands deep, also under an unknown field, a tool schema or a tool_use input); encoding (lone
UTF-16 surrogate escapes, invalid UTF-8, a BOM, UTF-16); a missing key; the body cut at an offset; the content-type
(missing, text/plain, a form, multipart). Every answer must be a 2xx or a 4xx, a 4xx in its protocol's error shape,
a 200 stream must end with its protocol's terminal event over an intact connection, and ``/health`` must stay 200.

The regression corpus below pins the failure classes found so far as explicit bodies. Run a long exploration with
``pytest tests/reliability/test_fuzz_protocols.py --hypothesis-profile=long``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import attrs
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from live_server import LiveServer, start_servers
from reliability_support import (
    Answer,
    Endpoint,
    Raw,
    answer_problems,
    chat_body,
    encode,
    endpoints,
    healthy,
    messages_body,
    messages_count_body,
    nested_arrays,
    nested_objects,
    nested_schema,
    responses_body,
    responses_count_body,
    send_raw,
)

ENDPOINTS = {endpoint.name: endpoint for endpoint in endpoints()}
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(echo_artifact: Path, tmp_path_factory: pytest.TempPathFactory):
    """One echo server for the module: short outputs, a 1,024-token context, a 4 MiB body limit."""
    args = ["--max-context", "1024", "--default-max-tokens", "8", "--no-thinking", "--max-concurrency", "2",
            "--max-pending-requests", "8", "--max-request-mib", "4", "--response-store-max-records", "16",
            "--log-stats-interval-ms", "0"]
    [live] = start_servers(tmp_path_factory.mktemp("fuzz"), [(echo_artifact, args, {})], ["echo"])
    yield live
    live.stop()


def check(server: LiveServer, path: str, content: bytes, headers: dict[str, str], what: str,
          allowed: set[int] | None = None) -> Answer | None:
    """Send one request and fail with everything wrong about its answer and the server's new log lines."""
    log_before = len(server.log())
    answer = None
    try:
        answer = send_raw(server, path, content, headers)
        problems = answer_problems(path, answer)
        if allowed is not None and answer.status not in allowed:
            problems.append(f"HTTP {answer.status}, expected one of {sorted(allowed)}: {answer.text[:300]!r}")
    except httpx.HTTPError as exc:
        problems = [f"the connection failed: {type(exc).__name__}: {exc}"]
    if not healthy(server):
        problems.append("/health is not 200 afterwards (or the server exited)")
    if problems:
        shown = content if len(content) <= 400 else content[:300] + b"..." + content[-60:]
        raise AssertionError(
            f"POST {path} ({what}), {len(content)} bytes, headers {headers}:\n  body {shown!r}\n  "
            + "\n  ".join(problems) + f"\nserver log since the request:\n{server.log()[log_before:][-3000:]}"
        )
    return answer


# -- mutations -------------------------------------------------------------------------------------------------

JsonPath = tuple[Any, ...]


def value_paths(node: Any, prefix: JsonPath = ()) -> list[JsonPath]:
    """Every position in the tree (the root is ``()``); ``Raw`` fragments are leaves."""
    found = [prefix]
    if isinstance(node, dict):
        for key, item in node.items():
            found += value_paths(item, (*prefix, key))
    elif isinstance(node, list):
        for index, item in enumerate(node):
            found += value_paths(item, (*prefix, index))
    return found


def get_at(node: Any, path: JsonPath) -> Any:
    for step in path:
        node = node[step]
    return node


def replace_at(root: Any, path: JsonPath, value: Any) -> Any:
    if not path:
        return value
    get_at(root, path[:-1])[path[-1]] = value
    return root


DEEP = (2, 100, 600, 999, 1000, 1001, 5000)
BIG_NUMBERS = ("9" * 19, "-" + "9" * 19, "18446744073709551616", "1" + "0" * 308, "1e309", "-1e400", "1e-400",
               "1" * 4300, "1" * 4301, "-" + "7" * 4301, "1" * 10000, "1." + "1" * 400, "0." + "0" * 400 + "1",
               "-0", "0.0", "NaN", "Infinity", "-Infinity", "1E+2", "1e2")
BAD_STRINGS = (b'"\\ud800"', b'"x\\udc00y"', b'"\\udbff"', b'"\\ud800\\ud800"', b'"\\udbff\\udfff"',
               b'"\\u0000"', b'"\xff"', b'"a\xc3"', b'"\xed\xa0\x80"', b'"\xc0\xaf"', '"\ufeff"'.encode(),
               b'"\\ud83d\\ude00"')
FIELD_NAMES = ("x_extra", "type", "role", "content", "text", "model", "stream", "input", "tools", "messages",
               "max_tokens", "temperature", "metadata", "cache_control", "thinking", "reasoning", "tool_choice")

scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)


def type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {dict: "object", list: "array", str: "string", type(None): "null"}.get(type(value), "raw")


big_values = st.one_of(
    st.builds(lambda n, chunk: chunk * n, st.sampled_from([1_000, 20_000, 200_000]),
              st.sampled_from(["a", "é", "\u4e2d", "\U0001f600", " ", "\n", "<|im_end|>", "```ninfer-echo\n"])),
    st.sampled_from(BIG_NUMBERS).map(Raw.of),
    st.sampled_from([2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 1e308, -1e308, 5e-324]),
)
deep_values = st.one_of(
    st.sampled_from(DEEP).map(nested_arrays),
    st.sampled_from(DEEP).map(nested_objects),
    st.sampled_from(DEEP).map(nested_schema),
    st.sampled_from(DEEP).map(lambda depth: Raw(b'[{"a":' * depth + b"0" + b"}]" * depth)),
)
encoded_strings = st.sampled_from(BAD_STRINGS).map(Raw)


@attrs.frozen
class Mutation:
    what: str
    apply: Callable[[Any], Any]


@st.composite
def mutation(draw: st.DrawFn, body: Any) -> Mutation:
    positions = value_paths(body)
    path = draw(st.sampled_from(positions), label="path")
    kind = draw(st.sampled_from(["retype", "size", "nesting", "encoding", "delete", "extra_key", "inject"]),
                label="kind")
    target = get_at(body, path)
    if kind == "retype":
        current = type_name(target)
        value = draw(json_values.filter(lambda candidate: type_name(candidate) != current))
        return Mutation(f"{path}: {current} -> {value!r:.60}", lambda root: replace_at(root, path, value))
    if kind == "size":
        value = draw(big_values)
        return Mutation(f"{path} = {value!r:.60}", lambda root: replace_at(root, path, value))
    if kind == "nesting":
        value = draw(deep_values)
        if isinstance(target, dict) and draw(st.booleans()):
            name = draw(st.sampled_from(FIELD_NAMES))
            return Mutation(f"{path}[{name!r}] = {value!r}", lambda root: _set_key(root, path, name, value))
        return Mutation(f"{path} = {value!r}", lambda root: replace_at(root, path, value))
    if kind == "encoding":
        value = draw(encoded_strings)
        if isinstance(target, dict) and draw(st.booleans()):  # a bad string as a key name
            return Mutation(f"{path}[{value!r}] = 1", lambda root: _set_key(root, path, value, 1))
        return Mutation(f"{path} = {value!r}", lambda root: replace_at(root, path, value))
    if kind == "inject" and isinstance(target, str):  # a lone surrogate inside an existing string
        at = draw(st.integers(0, len(target)))
        surrogate = draw(st.sampled_from(["\ud800", "\udfff", "\x00", "\u2028", "\ufffe"]))
        value = target[:at] + surrogate + target[at:]
        return Mutation(f"{path} = {value!r:.60}", lambda root: replace_at(root, path, value))
    if kind == "delete" and path:
        return Mutation(f"del {path}", lambda root: _delete(root, path))
    name = draw(st.one_of(st.sampled_from(FIELD_NAMES), st.text(max_size=10)))
    value = draw(json_values)
    if isinstance(target, dict):
        return Mutation(f"{path}[{name!r}] = {value!r:.60}", lambda root: _set_key(root, path, name, value))
    return Mutation(f"{path} = {value!r:.60}", lambda root: replace_at(root, path, value))


def _set_key(root: Any, path: JsonPath, key: Any, value: Any) -> Any:
    get_at(root, path)[key] = value
    return root


def _delete(root: Any, path: JsonPath) -> Any:
    del get_at(root, path[:-1])[path[-1]]
    return root


BYTE_MUTATIONS = ("none", "none", "none", "none", "truncate", "bom", "utf16", "bad_byte", "trailing", "empty")
CONTENT_TYPES = ("application/json", "application/json", "application/json", "application/json", None,
                 "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=utf-16")


@attrs.frozen
class Case:
    """One fuzzed request: the body bytes, its headers and how it was made (shown when it fails)."""

    content: bytes = attrs.field(repr=lambda content: f"<{len(content)} bytes>")
    headers: dict[str, str]
    what: str


@st.composite
def fuzzed(draw: st.DrawFn, endpoint: Endpoint) -> Case:
    body = copy.deepcopy(endpoint.body)
    steps = []
    for _ in range(draw(st.integers(1, 3), label="mutations")):
        change = draw(mutation(body))
        body = change.apply(body)
        steps.append(change.what)
    content = encode(body)
    byte_change = draw(st.sampled_from(BYTE_MUTATIONS), label="bytes")
    if byte_change == "truncate":
        content = content[:draw(st.integers(0, len(content) - 1))]
    elif byte_change == "bom":
        content = b"\xef\xbb\xbf" + content
    elif byte_change == "utf16":
        content = content.decode("utf-8", "surrogateescape").encode("utf-16", "surrogatepass")
    elif byte_change == "bad_byte":
        at = draw(st.integers(0, len(content) - 1))
        content = content[:at] + draw(st.sampled_from([b"\xff", b"\x80", b"\xc3", b"\x00"])) + content[at + 1:]
    elif byte_change == "trailing":
        content = content + draw(st.sampled_from([b"}", b" x", b"\x00", b"{}", b"\n\n"]))
    elif byte_change == "empty":
        content = b""
    content_type = draw(st.sampled_from(CONTENT_TYPES), label="content-type")
    headers = {} if content_type is None else {"content-type": content_type}
    if content_type == "application/x-www-form-urlencoded" and draw(st.booleans()):
        content = b"model=echo&messages=hi&stream=true"
    return Case(content, headers, f"{'; '.join(steps)}; bytes: {byte_change}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ENDPOINTS))
@given(data=st.data())
def test_fuzzed_request_gets_a_well_formed_answer(server: LiveServer, name: str, data: st.DataObject) -> None:
    endpoint = ENDPOINTS[name]
    case = data.draw(fuzzed(endpoint), label="case")
    check(server, endpoint.path, case.content, case.headers, case.what)


def test_the_unmutated_bodies_succeed(server: LiveServer) -> None:
    """The fuzz starts from requests the server accepts: a 200 (stream terminated) for every endpoint."""
    for endpoint in ENDPOINTS.values():
        check(server, endpoint.path, encode(endpoint.body), JSON, "valid", allowed={200})


# -- the regression corpus -------------------------------------------------------------------------------------

CHAT, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/responses", "/v1/messages"
RESPONSES_COUNT, MESSAGES_COUNT = "/v1/responses/input_tokens", "/v1/messages/count_tokens"
SURROGATE = Raw(b'"\\ud800"')
OK_OR_REJECTED = {200, 400}
REJECTED = {400}


def _with(body: dict[str, Any], path: JsonPath, value: Any) -> dict[str, Any]:
    return replace_at(copy.deepcopy(body), path, value)


def _block(body: dict[str, Any], message: int, block: int, value: Any) -> dict[str, Any]:
    return _with(body, ("messages", message, "content", block), value)


CORPUS: list[tuple[str, str, bytes, set[int]]] = [
    # deep nesting: at the top level, and under an unknown field that must otherwise be ignored
    ("arrays-1000-top-level", CHAT, encode(nested_arrays(1000)), REJECTED),
    ("arrays-1000-top-level-messages", MESSAGES, encode(nested_arrays(1000)), REJECTED),
    ("arrays-1000-extra-field-chat", CHAT, encode(chat_body(x_extra=nested_arrays(1000))), OK_OR_REJECTED),
    ("arrays-1000-extra-field-chat-stream", CHAT,
     encode(chat_body(stream=True, x_extra=nested_arrays(1000))), OK_OR_REJECTED),
    ("objects-1000-extra-field-chat", CHAT, encode(chat_body(x_extra=nested_objects(1000))), OK_OR_REJECTED),
    ("arrays-1000-extra-field-responses", RESPONSES, encode(responses_body(x_extra=nested_arrays(1000))),
     OK_OR_REJECTED),
    ("arrays-1000-extra-field-messages", MESSAGES, encode(messages_body(x_extra=nested_arrays(1000))),
     OK_OR_REJECTED),
    ("arrays-1000-extra-field-count-tokens", MESSAGES_COUNT,
     encode(messages_count_body(x_extra=nested_arrays(1000))), OK_OR_REJECTED),
    # numbers Python's int/float conversions refuse
    ("int-4301-digits-max-tokens-chat", CHAT, encode(chat_body(max_tokens=Raw.of("1" * 4301))), REJECTED),
    ("int-4301-digits-extra-field-chat", CHAT, encode(chat_body(x_extra=Raw.of("1" * 4301))), OK_OR_REJECTED),
    ("int-4301-digits-max-tokens-messages", MESSAGES, encode(messages_body(max_tokens=Raw.of("1" * 4301))),
     REJECTED),
    ("int-4301-digits-max-output-tokens", RESPONSES,
     encode(responses_body(max_output_tokens=Raw.of("1" * 4301))), REJECTED),
    ("temperature-400-digit-int-chat", CHAT, encode(chat_body(temperature=Raw.of("1" * 400))), REJECTED),
    ("temperature-400-digit-int-responses", RESPONSES, encode(responses_body(temperature=Raw.of("1" * 400))),
     REJECTED),
    ("temperature-400-digit-int-messages", MESSAGES, encode(messages_body(temperature=Raw.of("1" * 400))),
     REJECTED),
    ("temperature-400-digit-float-chat", CHAT, encode(chat_body(temperature=Raw.of("1" * 400 + ".5"))), REJECTED),
    ("temperature-400-fraction-digits-chat", CHAT, encode(chat_body(temperature=Raw.of("1." + "1" * 400))),
     OK_OR_REJECTED),
    ("top-p-400-digit-float-messages", MESSAGES, encode(messages_body(top_p=Raw.of("0." + "9" * 400))),
     OK_OR_REJECTED),
    ("temperature-nan-chat", CHAT, encode(chat_body(temperature=Raw.of("NaN"))), REJECTED),
    ("temperature-infinity-messages", MESSAGES, encode(messages_body(temperature=Raw.of("Infinity"))), REJECTED),
    # a block whose type is not a string
    ("type-object-user-block", MESSAGES, encode(_block(messages_body(), 0, 0, {"type": {}})), REJECTED),
    ("type-object-tool-result-block", MESSAGES,
     encode(_with(messages_body(), ("messages", 2, "content", 0, "content", 0), {"type": {}})), REJECTED),
    ("type-object-assistant-block", MESSAGES, encode(_block(messages_body(), 1, 0, {"type": {}})), REJECTED),
    ("type-object-user-block-count-tokens", MESSAGES_COUNT,
     encode(_block(messages_count_body(), 0, 0, {"type": {}})), REJECTED),
    ("type-object-chat-part", CHAT, encode(_with(chat_body(), ("messages", 1, "content", 0), {"type": {}})),
     REJECTED),
    ("type-object-responses-item", RESPONSES, encode(_with(responses_body(), ("input", 0), {"type": {}})), REJECTED),
    ("type-list-user-block", MESSAGES, encode(_block(messages_body(), 0, 0, {"type": [], "text": "x"})), REJECTED),
    ("type-object-responses-tool", RESPONSES_COUNT, encode(_with(responses_count_body(), ("tools", 0, "type"), {})),
     REJECTED),
    # lone surrogates
    ("surrogate-model-messages", MESSAGES, encode(messages_body(model=SURROGATE)), OK_OR_REJECTED),
    ("surrogate-model-messages-stream", MESSAGES, encode(messages_body(model=SURROGATE, stream=True)),
     OK_OR_REJECTED),
    ("surrogate-model-count-tokens", MESSAGES_COUNT, encode(messages_count_body(model=SURROGATE)), OK_OR_REJECTED),
    ("surrogate-metadata-value-responses", RESPONSES, encode(responses_body(metadata={"trace": SURROGATE})),
     OK_OR_REJECTED),
    ("surrogate-metadata-key-responses", RESPONSES, encode(responses_body(metadata={SURROGATE: "v"})),
     OK_OR_REJECTED),
    ("surrogate-instructions-responses", RESPONSES, encode(responses_body(instructions=SURROGATE)), OK_OR_REJECTED),
    ("surrogate-instructions-responses-stream", RESPONSES,
     encode(responses_body(instructions=SURROGATE, stream=True)), OK_OR_REJECTED),
    ("surrogate-prompt-cache-key-responses-stream", RESPONSES,
     encode(responses_body(prompt_cache_key=SURROGATE, stream=True)), OK_OR_REJECTED),
    ("surrogate-tool-schema-responses", RESPONSES,
     encode(_with(responses_body(), ("tools", 0, "parameters", "properties", "days", "type"),
                  Raw(b'"integ\\udfffer"'))),
     OK_OR_REJECTED),
    ("surrogate-user-responses", RESPONSES, encode(responses_body(user=SURROGATE)), OK_OR_REJECTED),
    ("surrogate-prompt-cache-key-responses", RESPONSES, encode(responses_body(prompt_cache_key=SURROGATE)),
     OK_OR_REJECTED),
    ("surrogate-input-string-responses", RESPONSES, encode(responses_body(input=SURROGATE)), OK_OR_REJECTED),
    ("surrogate-input-text-responses", RESPONSES,
     encode(_with(responses_body(), ("input", 0, "content", 0, "text"), SURROGATE)), OK_OR_REJECTED),
    ("surrogate-input-text-input-tokens", RESPONSES_COUNT, encode(responses_count_body(input=SURROGATE)),
     OK_OR_REJECTED),
    ("surrogate-unknown-key-responses", RESPONSES, encode({**responses_body(), SURROGATE: 1}), OK_OR_REJECTED),
    ("surrogate-unknown-key-chat", CHAT, encode({**chat_body(), SURROGATE: 1}), OK_OR_REJECTED),
    ("surrogate-content-chat", CHAT, encode(chat_body(content=SURROGATE)), OK_OR_REJECTED),
    ("surrogate-content-messages", MESSAGES, encode(_block(messages_body(), 2, 1, {"type": "text", "text": SURROGATE})),
     OK_OR_REJECTED),
    # tool schemas and tool inputs nested 600 deep
    ("schema-600-deep-chat", CHAT, encode(_with(chat_body(), ("tools", 0, "function", "parameters"),
                                                nested_schema(600))), OK_OR_REJECTED),
    ("schema-600-deep-responses", RESPONSES, encode(_with(responses_body(), ("tools", 0, "parameters"),
                                                          nested_schema(600))), OK_OR_REJECTED),
    ("schema-600-deep-messages", MESSAGES, encode(_with(messages_body(), ("tools", 0, "input_schema"),
                                                        nested_schema(600))), OK_OR_REJECTED),
    ("schema-600-deep-count-tokens", MESSAGES_COUNT, encode(_with(messages_count_body(), ("tools", 0, "input_schema"),
                                                                  nested_schema(600))), OK_OR_REJECTED),
    ("tool-use-input-600-deep", MESSAGES, encode(_with(messages_body(), ("messages", 1, "content", 1, "input"),
                                                       nested_objects(600))), OK_OR_REJECTED),
    ("tool-use-input-600-deep-count-tokens", MESSAGES_COUNT,
     encode(_with(messages_count_body(), ("messages", 1, "content", 1, "input"), nested_objects(600))),
     OK_OR_REJECTED),
    ("tool-arguments-600-deep-responses", RESPONSES,
     encode(_with(responses_body(), ("input", 1, "arguments"), encode(nested_objects(600)).decode())),
     OK_OR_REJECTED),
    ("tool-arguments-600-deep-chat", CHAT,
     encode(_with(chat_body(), ("messages", 2, "tool_calls", 0, "function", "arguments"),
                  encode(nested_objects(600)).decode())), OK_OR_REJECTED),
    # text the echo model streams back holding separators str.splitlines splits at (SSE splits at CR/LF only)
    ("line-separators-chat-stream", CHAT, encode(chat_body(content="a\u2028b\x85c\u2029d\x1ce", stream=True)), {200}),
    ("line-separator-tool-schema-responses-stream", RESPONSES,
     encode(_with(responses_body(stream=True), ("tools", 0, "parameters", "properties", "days", "type"),
                  "inte\u2028ger")), {200}),
    # bytes that are not a JSON object
    ("invalid-utf8", CHAT, b'{"model": "m", "messages": [{"role": "user", "content": "h\xffi"}]}', REJECTED),
    ("truncated", MESSAGES, encode(messages_body())[:57], REJECTED),
    ("empty", RESPONSES, b"", REJECTED),
    ("bom", CHAT, b"\xef\xbb\xbf" + encode(chat_body()), OK_OR_REJECTED),
    ("form-body", MESSAGES, b"model=m&max_tokens=1", REJECTED),
    # endpoints that take no body
    ("junk-body-compact", "/v1/responses/compact", encode(nested_arrays(1000)), REJECTED),
    ("junk-body-cancel", "/v1/responses/resp_missing/cancel", b"\xff\xfe", {400, 404}),
]


@pytest.mark.parametrize("path,content,allowed", [pytest.param(path, content, allowed, id=name)
                                                   for name, path, content, allowed in CORPUS])
def test_regression_corpus(server: LiveServer, path: str, content: bytes, allowed: set[int]) -> None:
    headers = {"content-type": "application/x-www-form-urlencoded"} if content.startswith(b"model=") else JSON
    check(server, path, content, headers, "regression corpus", allowed=allowed)
