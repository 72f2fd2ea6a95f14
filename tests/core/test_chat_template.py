"""ninfer's chat-template renderer and its own Qwen templates, checked against the official templates.

Oracles: the official Qwen3.6/3.8 templates in ``shared/fixtures/chat_templates`` (rendered through the same sandbox,
and the sandbox itself cross-checked against transformers), and the renderings the fixtures README verified.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from paths import OFFICIAL_TEMPLATES, official_template
from ninfer.core.chat_template import ChatTemplate, TemplateCapabilities, TemplateRaisedError
from ninfer.core.errors import ArtifactError, ConfigError, InvalidRequestError
from ninfer.plugins.qwen3_5.frontend.templates import template_source

FIXTURES = OFFICIAL_TEMPLATES
GENERATIONS = ("qwen3_6", "qwen3_8")
Pair = tuple[str, ChatTemplate, ChatTemplate]  # (generation, official template, ninfer template)


def _official(generation: str) -> ChatTemplate:
    return ChatTemplate(official_template(generation).read_text(encoding="utf-8"), name=f"official/{generation}.jinja")


@pytest.fixture(scope="module")
def own_templates() -> dict[str, ChatTemplate]:
    return {g: ChatTemplate(template_source(g), name=f"ninfer/{g}.jinja") for g in GENERATIONS}


@pytest.fixture(scope="module", params=GENERATIONS)
def pair(request: pytest.FixtureRequest, own_templates: dict[str, ChatTemplate]) -> Pair:
    return request.param, _official(request.param), own_templates[request.param]


def _outcome(template: ChatTemplate, messages: Any, **options: Any) -> tuple[str, str]:
    """("ok", text), ("raised", template message) or ("failed", error kind) for a render."""
    try:
        return "ok", template.render(messages, **options)
    except InvalidRequestError as exc:
        assert exc.code == "invalid_prompt"
        if isinstance(exc.__cause__, TemplateRaisedError):
            return "raised", exc.message
        return "failed", type(exc.__cause__).__name__


def assert_same(pair: Pair, messages: Any, **options: Any) -> tuple[str, str]:
    _generation, official, own = pair
    expected = _outcome(official, messages, **options)
    assert _outcome(own, messages, **options) == expected
    return expected


def assert_renders_same(pair: Pair, messages: Any, **options: Any) -> str:
    status, text = assert_same(pair, messages, **options)
    assert status == "ok", text
    return text


def assert_raises_same(pair: Pair, messages: Any, message: str, **options: Any) -> None:
    assert assert_same(pair, messages, **options) == ("raised", message)


# ---- shared conversations -----------------------------------------------------------------------------------

SYS_HI = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
HIST = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"},
]
RICH_TOOLS = [
    {"type": "function", "function": {
        "name": "search_docs", "description": "Suche in Dokumenten — 検索 «quoted» <b>&amp;</b> 🚀",
        "parameters": {"type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "description": "Freitext"},
            "filters": {"type": "object", "properties": {
                "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
                "range": {"type": "object", "properties": {"from": {"type": "integer"}, "to": {"type": "number"}}},
            }},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
        }},
    }},
    {"type": "function", "function": {"name": "run_code", "description": "Runs code.", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}, "timeout": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]
MIXED_ARGS = {"text": "multi\nline “text”", "count": 3, "ratio": 0.25, "flag": True, "off": False, "nothing": None,
              "nested": {"z": 1, "a": [1, "two", {"b": None}]}, "list": ["x", 2, 3.5], "empty": ""}
AGENT_CONV = [
    {"role": "system", "content": "  Be brief.  \n"},
    {"role": "user", "content": "Find the docs and run it."},
    {"role": "assistant", "content": "Let me look.", "reasoning_content": "\nNeed search first.\n",
     "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "search_docs", "arguments": {"query": "run", "limit": 5}}},
         {"id": "c2", "type": "function", "function": {"name": "run_code", "arguments": MIXED_ARGS}},
     ]},
    {"role": "tool", "tool_call_id": "c1", "content": "doc text"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "exit 0"}]},
    {"role": "assistant", "content": "", "reasoning_content": "Both done.",
     "tool_calls": [{"function": {"name": "noop", "arguments": {}}}]},
    {"role": "tool", "content": "ok"},
    {"role": "user", "content": "Thanks. Summarize."},
]
AFTER_QUERY_CONV = [
    {"role": "user", "content": "Old question"},
    {"role": "assistant", "content": "Old answer", "reasoning_content": "old thoughts"},
    {"role": "user", "content": "New question"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "new thoughts",
     "tool_calls": [{"function": {"name": "run_code", "arguments": {"code": "print(1)"}}}]},
    {"role": "tool", "content": "1"},
    {"role": "assistant", "content": "It prints 1.", "reasoning_content": "final thoughts"},
]
MEDIA_CONV = [
    {"role": "system", "content": [{"type": "text", "text": "Describe media."}]},
    {"role": "user", "content": [
        {"type": "image", "image": "a.png"}, {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": "data:x"}}, {"type": "video", "video": "v.mp4"},
        {"type": "text", "text": " what are these?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Two images, one video."}]},
    {"role": "user", "content": [{"image": "c.png"}, {"video": ["f1.png", "f2.png"]}, {"type": "text", "text": "More?"}]},
]


# ---- renderer conventions -----------------------------------------------------------------------------------

def test_syntax_error_names_template_and_line() -> None:
    with pytest.raises(ArtifactError, match=r"broken\.jinja: syntax error at line 3"):
        ChatTemplate("line one\n{{ messages }}\n{% if %}", name="broken.jinja")


def test_non_text_source_is_an_artifact_error() -> None:
    with pytest.raises(ArtifactError, match="expected template text"):
        ChatTemplate(b"{{ messages }}")  # type: ignore[arg-type]


def test_raise_exception_becomes_invalid_prompt() -> None:
    template = ChatTemplate("{% if messages|length > 1 %}{{ raise_exception('Too many: ' ~ messages|length) }}{% endif %}ok")
    assert template.render([{"role": "user"}]) == "ok"
    with pytest.raises(InvalidRequestError) as caught:
        template.render([{}, {}])
    assert caught.value.code == "invalid_prompt" and caught.value.message == "Too many: 2" and caught.value.status == 400


def test_tojson_keeps_order_and_unicode_without_html_escaping() -> None:
    value = {"z": "<b>&'\"</b>", "a": ["é", 1.5, None, True], "m": {"y": 1, "b": 2}}
    template = ChatTemplate("{{ value | tojson }}|{{ value | tojson(indent=2) }}|{{ value.m | tojson(sort_keys=true) }}"
                            "|{{ value.m | tojson(separators=(',', ':')) }}")
    assert template.render([], value=value) == "|".join([
        json.dumps(value, ensure_ascii=False), json.dumps(value, ensure_ascii=False, indent=2),
        '{"b": 2, "y": 1}', '{"y":1,"b":2}'])


def test_trim_blocks_lstrip_blocks_and_loop_controls() -> None:
    template = ChatTemplate("{% for m in messages %}\n    {% if m == 2 %}{% continue %}{% endif %}\n"
                            "{% if m == 4 %}{% break %}{% endif %}\n[{{ m }}]{% endfor %}")
    assert template.render([1, 2, 3, 4, 5]) == "[1][3]"


def test_strftime_now_and_options_reach_the_template() -> None:
    template = ChatTemplate("{{ strftime_now('%Y') | length }} {{ add_generation_prompt }} {{ tools }} {{ custom }}")
    assert template.render([], custom="x") == "4 True None x"


def test_sandbox_blocks_python_internals() -> None:
    with pytest.raises(InvalidRequestError, match="cannot render this request: SecurityError"):
        ChatTemplate("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}").render([])
    with pytest.raises(InvalidRequestError, match="SecurityError"):
        ChatTemplate("{% set ns = namespace() %}{% set ns._x = 1 %}").render([])
    with pytest.raises(InvalidRequestError, match="SecurityError"):
        ChatTemplate("{{ messages.append(1) }}").render([])


def test_options_cannot_shadow_template_globals() -> None:
    with pytest.raises(InvalidRequestError, match="'raise_exception' is reserved"):
        ChatTemplate("x").render([], raise_exception="y")


def test_template_source_rejects_unknown_names() -> None:
    with pytest.raises(ConfigError, match="unknown Qwen chat template 'qwen3_7'"):
        template_source("qwen3_7")  # type: ignore[arg-type]


@pytest.mark.parametrize("generation", GENERATIONS)
def test_renderer_matches_transformers(generation: str) -> None:
    """The sandbox renders the official template exactly as transformers' own renderer does."""
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    official = _official(generation)
    cases = [(SYS_HI, {}), (HIST, {"preserve_thinking": True}), (AGENT_CONV, {"tools": RICH_TOOLS}),
             (MEDIA_CONV, {"add_vision_id": True, "enable_thinking": False})]
    for messages, options in cases:
        options = dict(options)
        tools = options.pop("tools", None)
        rendered, _generation_indices = chat_template_utils.render_jinja_template(
            conversations=[messages], tools=tools, chat_template=official.source, add_generation_prompt=True, **options)
        assert official.render(messages, tools=tools, **options) == rendered[0]


# ---- ninfer templates versus the official templates ---------------------------------------------------------

CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "system_user": (SYS_HI, {}),
    "no_system": (SYS_HI[1:], {}),
    "empty_system": ([{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}], {}),
    "whitespace_system_with_tools": ([{"role": "system", "content": " \n "}, {"role": "user", "content": "Hi"}],
                                     {"tools": TOOLS}),
    "history": (HIST, {}),
    "history_preserve_true": (HIST, {"preserve_thinking": True}),
    "history_preserve_false": (HIST, {"preserve_thinking": False}),
    "history_preserve_none": (HIST, {"preserve_thinking": None}),
    "thinking_off": (SYS_HI, {"enable_thinking": False}),
    "thinking_on": (SYS_HI, {"enable_thinking": True}),
    "thinking_none": (SYS_HI, {"enable_thinking": None}),
    "thinking_none_unchecked_effort": (SYS_HI, {"enable_thinking": None, "reasoning_effort": "high"}),
    "no_generation_prompt": (HIST + [{"role": "assistant", "content": "A2", "reasoning_content": "R2"}],
                             {"add_generation_prompt": False}),
    "tools_readme": (TOOL_CONV, {"tools": TOOLS}),
    "tools_rich_with_system": (AGENT_CONV, {"tools": RICH_TOOLS}),
    "tools_rich_preserve": (AGENT_CONV, {"tools": RICH_TOOLS, "preserve_thinking": True}),
    "tools_rich_preserve_false": (AGENT_CONV, {"tools": RICH_TOOLS, "preserve_thinking": False}),
    "reasoning_after_last_query": (AFTER_QUERY_CONV, {"tools": RICH_TOOLS[1:2]}),
    "reasoning_after_last_query_no_prompt": (AFTER_QUERY_CONV, {"add_generation_prompt": False}),
    "tool_then_user": (TOOL_CONV + [{"role": "user", "content": "And Rome?"}], {"tools": TOOLS}),
    "tool_first_message": ([{"role": "tool", "content": "early"}, {"role": "user", "content": "Q"}], {}),
    "tool_response_wrapped_user": (TOOL_CONV + [{"role": "user", "content": "<tool_response>\nmore\n</tool_response>"}],
                                   {"tools": TOOLS}),
    "tools_mapping_ignored": (SYS_HI, {"tools": {"type": "function"}}),
    "tools_empty_list": (SYS_HI, {"tools": []}),
    "call_without_function_wrapper": ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "ok",
                                       "tool_calls": [{"name": "f", "arguments": {"a": 1}}, {"name": "g"}]},
                                      {"role": "tool", "content": "r"}], {}),
    "empty_tool_calls": ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "tool_calls": []},
                          {"role": "user", "content": "Q2"}], {}),
    "think_in_content": ([{"role": "user", "content": "Q1"},
                          {"role": "assistant", "content": "<think>\nhidden R\n</think>\n\n  visible A"},
                          {"role": "user", "content": "Q2"},
                          {"role": "assistant", "content": "pre<think>a<think>\nb\n</think>c<think>d</think>\nlast"}],
                         {"add_generation_prompt": False}),
    "think_in_content_preserve": ([{"role": "user", "content": "Q1"},
                                   {"role": "assistant", "content": "<think>R</think>A"},
                                   {"role": "user", "content": "Q2"}], {"preserve_thinking": True}),
    "think_in_content_with_reasoning_field": ([{"role": "user", "content": "Q1"},
                                               {"role": "assistant", "content": "<think>X</think>A", "reasoning_content": "R"},
                                               {"role": "user", "content": "Q2"}], {"preserve_thinking": True}),
    "non_string_reasoning": ([{"role": "user", "content": "Q1"},
                              {"role": "assistant", "content": "A", "reasoning_content": None},
                              {"role": "user", "content": "Q2"}], {"preserve_thinking": True}),
    "media": (MEDIA_CONV, {}),
    "media_vision_ids": (MEDIA_CONV, {"add_vision_id": True}),
    "media_in_tool_and_assistant": ([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q"}]},
                                     {"role": "assistant", "content": [{"type": "image_url", "image_url": {}}],
                                      "tool_calls": [{"function": {"name": "look", "arguments": {"x": [1]}}}]},
                                     {"role": "tool", "content": [{"type": "video"}, {"type": "text", "text": "seen"}]},
                                     {"role": "user", "content": [{"type": "image"}]}], {"add_vision_id": True}),
    "none_and_missing_content": ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": None,
                                  "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
                                  {"role": "tool"}, {"role": "user", "content": "Q2"}], {}),
    "unicode_and_whitespace": ([{"role": "user", "content": "\n\t  Grüße, 世界 🌍  \n"},
                                {"role": "assistant", "content": "  Hallo \n", "reasoning_content": "  denke  "},
                                {"role": "user", "content": " ok "}], {"preserve_thinking": True}),
}


@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_ninfer_template_renders_like_official(pair: Pair, case: str) -> None:
    messages, options = CONVERSATIONS[case]
    assert_renders_same(pair, messages, **options)


@pytest.mark.parametrize("effort", ["low", "medium", "xhigh", None])
@pytest.mark.parametrize("case", ["system_user", "no_system", "tools_rich_with_system", "empty_system"])
def test_reasoning_effort_renders_like_official(pair: Pair, case: str,
                                               effort: str | None) -> None:
    messages, options = CONVERSATIONS[case]
    options = dict(options) if effort is None else {**options, "reasoning_effort": effort}
    text = assert_renders_same(pair, messages, **options)
    generation = pair[0]
    has_note = "Reasoning effort is set to" in text
    assert has_note == (generation == "qwen3_8" and effort != "medium")


def test_reasoning_effort_is_ignored_while_thinking_is_off(pair: Pair) -> None:
    text = assert_renders_same(pair, SYS_HI, reasoning_effort="high", enable_thinking=False)
    assert "Reasoning effort" not in text


@pytest.mark.parametrize("effort", ["high", "HIGH", None, "minimal", 3])
def test_invalid_reasoning_effort_raises_like_official(own_templates: dict[str, ChatTemplate], effort: Any) -> None:
    pair = ("qwen3_8", _official("qwen3_8"), own_templates["qwen3_8"])
    assert_raises_same(pair, SYS_HI, f"Unexpected reasoning effort {effort}. Supported types are xhigh (default), "
                                     "medium, and low.", reasoning_effort=effort)


INVALID: dict[str, tuple[Any, str]] = {
    "empty_messages": ([], "No messages provided."),
    "none_messages": (None, "No messages provided."),
    "system_not_first": ([{"role": "user", "content": "Q"}, {"role": "system", "content": "late"}],
                         "System message must be at the beginning."),
    "unknown_role": ([{"role": "user", "content": "Q"}, {"role": "developer", "content": "D"}],
                     "Unexpected message role."),
    "missing_role": ([{"role": "user", "content": "Q"}, {"content": "D"}], "Unexpected message role."),
    "no_user_query": ([{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"}],
                      "No user query found in messages."),
    "only_tool_response_users": ([{"role": "user", "content": " <tool_response>x</tool_response>\n"}],
                                 "No user query found in messages."),
    "image_in_system": ([{"role": "system", "content": [{"type": "image"}]}, {"role": "user", "content": "Q"}],
                        "System message cannot contain images."),
    "video_in_system": ([{"role": "system", "content": [{"type": "text", "text": "s"}, {"video": "v"}]},
                         {"role": "user", "content": "Q"}], "System message cannot contain videos."),
    "unknown_part": ([{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}],
                     "Unexpected item type in content."),
    "content_mapping": ([{"role": "user", "content": {"text": "Q"}}], "Unexpected content type."),
    "content_number": ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": 7}],
                       "Unexpected content type."),
    # precedence: the late system message's bad part is reported before its position
    "bad_part_in_late_system": ([{"role": "user", "content": "Q"}, {"role": "system", "content": [{"x": 1}]}],
                                "Unexpected item type in content."),
    # precedence: the user-query scan stops at the last query, so the late system message is reported first
    "late_system_before_bad_early_user": ([{"role": "user", "content": "Q0"}, {"role": "system", "content": "S"},
                                           {"role": "user", "content": [{"bad": 1}]}, {"role": "user", "content": "Q"}],
                                          "System message must be at the beginning."),
    "bad_part_in_last_user": ([{"role": "user", "content": "Q0"}, {"role": "system", "content": "S"},
                               {"role": "user", "content": [{"bad": 1}]}], "Unexpected item type in content."),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_input_raises_like_official(pair: Pair, case: str) -> None:
    messages, message = INVALID[case]
    assert_raises_same(pair, messages, message, tools=TOOLS)
    assert_raises_same(pair, messages, message)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}],
    [{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [{"function": {"name": 5}}]}],
    [{"role": "user", "content": "Q"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
    [{"role": "user", "content": [None]}],
])
def test_unrenderable_input_fails_in_both(pair: Pair, messages: Any) -> None:
    status, detail = assert_same(pair, messages)
    assert status == "failed", detail


def test_empty_string_arguments(pair: Pair) -> None:
    messages = [{"role": "user", "content": "Q"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]}]
    status, text = assert_same(pair, messages)
    if pair[0] == "qwen3_8":  # 3.8 tolerates empty-string arguments; 3.6 cannot iterate a string
        assert status == "ok" and "<tool_call>\n<function=f>\n</function>\n</tool_call><|im_end|>" in text
    else:
        assert status == "failed"


# ---- behaviour of ninfer's templates, asserted directly -------------------------------------------------------

def test_think_split_only_in_qwen3_6(own_templates: dict[str, ChatTemplate]) -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nR\n</think>\n\nA"}]
    options = {"add_generation_prompt": False}
    assert own_templates["qwen3_6"].render(messages, **options).endswith(
        "<|im_start|>assistant\n<think>\nR\n</think>\n\nA<|im_end|>\n")
    assert own_templates["qwen3_8"].render(messages, **options).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<think>\nR\n</think>\n\nA<|im_end|>\n")


def test_tool_arguments_keep_member_order_and_types(own_templates: dict[str, ChatTemplate]) -> None:
    messages = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "Calling.", "tool_calls": [
        {"function": {"name": "run_code", "arguments": MIXED_ARGS}}, {"function": {"name": "noop", "arguments": {}}}]}]
    text = own_templates["qwen3_6"].render(messages, add_generation_prompt=False)
    parameters = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                         for k, v in MIXED_ARGS.items())
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nCalling.\n\n<tool_call>\n<function=run_code>\n"
                         + parameters + "</function>\n</tool_call>\n<tool_call>\n<function=noop>\n</function>\n"
                         "</tool_call><|im_end|>\n")


def test_consecutive_tool_results_share_one_user_turn(own_templates: dict[str, ChatTemplate]) -> None:
    text = own_templates["qwen3_8"].render(AGENT_CONV, reasoning_effort="medium", add_generation_prompt=False)
    assert ("<|im_start|>user\n<tool_response>\ndoc text\n</tool_response>\n<tool_response>\nexit 0\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text


# ---- the fixtures README's verified renderings, against ninfer's templates -----------------------------------

TOOL_GUIDE = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural "
    "language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question "
    "like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>"
)
XHIGH = ("Reasoning effort is set to xhigh. Please think carefully through the task, validate key assumptions, consider "
         "plausible alternatives, and prioritize correctness, consistency, and clarity in the final answer.")
LOW = ("Reasoning effort is set to low. Keep your thinking brief and focused, moving directly to the conclusion without "
       "unnecessary elaboration.")
TOOL_TURNS = ('<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n'
              '<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
              '<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n')
TOOLS_BLOCK = ('# Tools\n\nYou have access to the following functions:\n\n<tools>\n{"type": "function", "function": '
               '{"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}'
               '\n</tools>' + TOOL_GUIDE)
SYS_HI_TURNS = "You are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
README_RENDERINGS: list[tuple[str, list[dict[str, Any]], dict[str, Any], str]] = [
    ("qwen3_6", SYS_HI, {}, "<|im_start|>system\n" + SYS_HI_TURNS + "<think>\n"),
    ("qwen3_8", SYS_HI, {}, "<|im_start|>system\n" + XHIGH + "\n\n" + SYS_HI_TURNS + "<think>\n"),
    ("qwen3_6", SYS_HI, {"enable_thinking": False}, "<|im_start|>system\n" + SYS_HI_TURNS + "<think>\n\n</think>\n\n"),
    ("qwen3_8", SYS_HI, {"enable_thinking": False}, "<|im_start|>system\n" + SYS_HI_TURNS + "<think>\n\n</think>\n\n"),
    ("qwen3_6", TOOL_CONV, {"tools": TOOLS}, "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_end|>\n" + TOOL_TURNS),
    ("qwen3_8", TOOL_CONV, {"tools": TOOLS},
     "<|im_start|>system\n" + XHIGH + "\n\n" + TOOLS_BLOCK + "<|im_end|>\n" + TOOL_TURNS),
    ("qwen3_8", SYS_HI, {"reasoning_effort": "low"}, "<|im_start|>system\n" + LOW + "\n\n" + SYS_HI_TURNS + "<think>\n"),
    ("qwen3_8", SYS_HI, {"reasoning_effort": "medium"}, "<|im_start|>system\n" + SYS_HI_TURNS + "<think>\n"),
    ("qwen3_8", SYS_HI, {"reasoning_effort": "high", "enable_thinking": False},
     "<|im_start|>system\n" + SYS_HI_TURNS + "<think>\n\n</think>\n\n"),
    ("qwen3_6", HIST, {}, "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2"
                          "<|im_end|>\n<|im_start|>assistant\n<think>\n"),
    ("qwen3_6", HIST, {"preserve_thinking": True},
     "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nR1\n</think>\n\nA1<|im_end|>\n<|im_start|>user\n"
     "Q2<|im_end|>\n<|im_start|>assistant\n<think>\n"),
    ("qwen3_8", HIST, {"reasoning_effort": "medium"},
     "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nR1\n</think>\n\nA1<|im_end|>\n<|im_start|>user\n"
     "Q2<|im_end|>\n<|im_start|>assistant\n<think>\n"),
    ("qwen3_8", HIST, {"reasoning_effort": "medium", "preserve_thinking": False},
     "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
     "<|im_start|>assistant\n<think>\n"),
]


@pytest.mark.parametrize("index", range(len(README_RENDERINGS)))
def test_readme_verified_rendering(own_templates: dict[str, ChatTemplate], index: int) -> None:
    generation, messages, options, expected = README_RENDERINGS[index]
    assert own_templates[generation].render(messages, add_generation_prompt=True, **options) == expected


def test_readme_invalid_effort_message(own_templates: dict[str, ChatTemplate]) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        own_templates["qwen3_8"].render(SYS_HI, reasoning_effort="high")
    assert caught.value.message == ("Unexpected reasoning effort high. Supported types are xhigh (default), medium, "
                                    "and low.")
    assert caught.value.code == "invalid_prompt"


# ---- capability detection ----------------------------------------------------------------------------------------

EXPECTED_CAPABILITIES = {
    "qwen3_6": TemplateCapabilities(effort_levels=(), default_effort=None, supports_preserve_thinking=True,
                                    preserve_thinking_default=False, supports_enable_thinking=True),
    "qwen3_8": TemplateCapabilities(effort_levels=("low", "medium", "xhigh"), default_effort="xhigh",
                                    supports_preserve_thinking=True, preserve_thinking_default=True,
                                    supports_enable_thinking=True),
}


@pytest.mark.parametrize("generation", GENERATIONS)
def test_capabilities_of_official_templates(generation: str) -> None:
    assert _official(generation).capabilities == EXPECTED_CAPABILITIES[generation]


@pytest.mark.parametrize("generation", GENERATIONS)
def test_capabilities_of_ninfer_templates(own_templates: dict[str, ChatTemplate], generation: str) -> None:
    assert own_templates[generation].capabilities == EXPECTED_CAPABILITIES[generation]


def test_capabilities_of_a_plain_template() -> None:
    plain = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                         "{% if reasoning_effort is defined %}{% endif %}{% if preserve_thinking %}{% endif %}")
    assert plain.capabilities == TemplateCapabilities()


def test_capabilities_of_a_custom_effort_template() -> None:
    custom = ChatTemplate("{% set e = reasoning_effort | default('high') %}{% if e not in ['minimal', 'high', 'max'] %}"
                          "{{ raise_exception('bad') }}{% endif %}[{{ e }}]{{ messages | length }}")
    assert custom.capabilities == TemplateCapabilities(effort_levels=("minimal", "high", "max"), default_effort="high")


def test_template_that_cannot_render_a_conversation_is_an_artifact_error() -> None:
    with pytest.raises(ArtifactError, match="cannot render a basic"):
        _ = ChatTemplate("{{ raise_exception('never') }}", name="refuses.jinja").capabilities


# ---- generated conversations ---------------------------------------------------------------------------------------

def _text(rng: random.Random, label: str) -> str:
    pad = rng.choice(["", "", " ", "\n", "  \n\t"])
    body = rng.choice([f"{label}", f"{label} with ümlaut ✓", f"{label}\nsecond line", f"<b>{label}</b> & \"q\""])
    return pad + body + rng.choice(["", "", " ", "\n"])


def _content(rng: random.Random, label: str, media: bool) -> Any:
    if not media or rng.random() < 0.5:
        return _text(rng, label)
    parts: list[dict[str, Any]] = []
    for index in range(rng.randint(1, 4)):
        kind = rng.choice(["text", "text", "image", "image_url", "image_key", "video", "video_key"])
        parts.append({
            "text": {"type": "text", "text": _text(rng, f"{label}.{index}")},
            "image": {"type": "image", "image": "img.png"},
            "image_url": {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
            "image_key": {"image": "x.jpg"},
            "video": {"type": "video", "video": "clip.mp4"},
            "video_key": {"video": ["f0.jpg", "f1.jpg"]},
        }[kind])
    return parts


def _argument_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "float", "bool", "null"] + (["dict", "list"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "dict":
        return {rng.choice(["k", "zeta", "alpha", "ключ"]) + str(i): _argument_value(rng, depth + 1)
                for i in range(rng.randint(0, 3))}
    if kind == "list":
        return [_argument_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {"str": lambda: rng.choice(["", "plain", "multi\nline", "  spaced  ", "{\"json\": 1}", "ünï"]),
            "int": lambda: rng.randint(-5, 10**6), "float": lambda: rng.choice([0.5, -2.25, 1e-7, 3.0]),
            "bool": lambda: rng.random() < 0.5, "null": lambda: None}[kind]()


def _tool_call(rng: random.Random) -> dict[str, Any]:
    name = rng.choice(["search_docs", "run_code", "noop", "get_weather"])
    arguments = {rng.choice(["query", "code", "city", "limit", "opts"]) + str(i): _argument_value(rng)
                 for i in range(rng.randint(0, 4))}
    function = {"name": name, "arguments": arguments}
    return {"id": f"call_{rng.randint(0, 999)}", "type": "function", "function": function} if rng.random() < 0.8 else function


def _assistant(rng: random.Random, label: str, media: bool) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": rng.choice([_content(rng, label, media), "", None])}
    reasoning = rng.random()
    if reasoning < 0.5:
        message["reasoning_content"] = _text(rng, f"thoughts on {label}")
    elif reasoning < 0.6:
        message["reasoning_content"] = None
    elif reasoning < 0.7 and isinstance(message["content"], str):
        message["content"] = f"<think>\n{_text(rng, 'inline thoughts')}\n</think>\n\n{message['content']}"
    if rng.random() < 0.4:
        message["tool_calls"] = [_tool_call(rng) for _ in range(rng.randint(1, 3))]
    return message


def _conversation(rng: random.Random) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    media = rng.random() < 0.4
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": rng.choice([_text(rng, "system"), "",
                                                                  [{"type": "text", "text": "system part"}]])})
    for turn in range(rng.randint(1, 4)):
        messages.append({"role": "user", "content": _content(rng, f"user {turn}", media)})
        for step in range(rng.randint(0, 3)):
            assistant = _assistant(rng, f"answer {turn}.{step}", media)
            messages.append(assistant)
            for call_index, _ in enumerate(assistant.get("tool_calls", [])):
                messages.append({"role": "tool", "content": _content(rng, f"result {call_index}", media)})
            if "tool_calls" not in assistant:
                break
    if rng.random() < 0.25:
        messages.append({"role": "user", "content": "<tool_response>\nextra output\n</tool_response>"})
    options: dict[str, Any] = {"add_generation_prompt": rng.random() < 0.8}
    if rng.random() < 0.5:
        options["tools"] = rng.sample(RICH_TOOLS + TOOLS, rng.randint(1, 4))
    for key, values in (("enable_thinking", [True, False]), ("preserve_thinking", [True, False]),
                        ("add_vision_id", [True, False]), ("reasoning_effort", ["low", "medium", "xhigh"])):
        if rng.random() < 0.5:
            options[key] = rng.choice(values)
    return messages, options


def test_generated_conversations_render_like_official(pair: Pair) -> None:
    rng = random.Random(20240611)
    for _ in range(200):
        messages, options = _conversation(rng)
        if pair[0] == "qwen3_6":
            options.pop("reasoning_effort", None)
        assert_renders_same(pair, messages, **options)
