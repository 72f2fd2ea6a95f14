"""Multi-turn conversations reuse their history under default server flags (the context cache's bars).

Each conversation replays the model's answers as a client would, through the real SDKs against the live echo
server; on every turn n >= 2 the prompt-cache hit must cover the previous prompt but for the few tokens of the
generation prologue that the template re-renders (``cached(n) >= prompt(n-1) - 8``), and inside a tool loop the
previous answer too. Greedy answers are compared with a ``--no-prefix-reuse`` server: reuse never changes output.
"""

from __future__ import annotations

import re
from typing import Any

import anthropic
import pytest

from live_server import ECHO_MODEL, LiveServer, start_servers, tiny_artifact

PROLOGUE_SLACK = 8
TURNS = 4


def fence(script: str) -> str:
    return f"Turn request.\n```ninfer-echo\n{script}\n```\n"


def answer(turn: int) -> str:
    return f"Answer {turn}: " + " ".join(["word"] * (6 + turn))


def thinking_script(turn: int) -> str:
    return f"Reason about turn {turn} carefully.\n</think>\n\n{answer(turn)}"


def plain_script(turn: int) -> str:
    return answer(turn)


SHRUNK = ["--max-concurrency", "2", "--device-state-slots", "1", "--host-state-slots", "2"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    echo = tiny_artifact(tmp_path_factory, "echo", "qwen3_6")
    started = start_servers(
        tmp_path_factory.mktemp("reuse"),
        [(echo, [], {}), (echo, ["--no-prefix-reuse"], {}), (echo, ["--max-concurrency", "2"], {}),
         (echo, SHRUNK, {}), (echo, ["--max-private-continuations", "2"], {}),
         (echo, ["--max-private-continuations", "3"], {}), (echo, ["--max-shared-prefixes", "1"], {})],
        [ECHO_MODEL] * 7,
    )
    yield dict(zip(("reuse", "root", "pair", "shrunk", "two", "three", "one_shared"), started))
    for server in started:
        server.stop()


def chat_turns(server: LiveServer, *, thinking: bool, preserve: bool) -> list[tuple[int, int, str]]:
    """(prompt tokens, cached tokens, answer) per turn of one Chat Completions conversation."""
    client = server.client()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful assistant."}]
    turns = []
    for turn in range(1, TURNS + 1):
        script = thinking_script(turn) if thinking else plain_script(turn)
        messages.append({"role": "user", "content": fence(script)})
        extra: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": thinking, "preserve_thinking": preserve}}
        reply = client.chat.completions.create(model=ECHO_MODEL, messages=messages, temperature=0, extra_body=extra)
        message = reply.choices[0].message
        replayed: dict[str, Any] = {"role": "assistant", "content": message.content}
        reasoning = getattr(message, "reasoning_content", None)
        if preserve and reasoning:
            replayed["reasoning_content"] = reasoning
        messages.append(replayed)
        details = reply.usage.prompt_tokens_details
        turns.append((reply.usage.prompt_tokens, details.cached_tokens if details else 0, message.content))
    return turns


def reuse_paths(server: LiveServer, since: int) -> list[str]:
    """The reuse path of each Chat request the server completed after stderr offset ``since`` (its stderr line)."""
    return re.findall(r"openai_chat done: \w+, prompt \d+ \(cache \d+ \(\d+%, ([a-z ]+)\)\)", server.log()[since:])


@pytest.mark.parametrize(("thinking", "preserve", "path"), [
    (True, False, "private response replay"),
    (False, False, "private response replay"),
    (True, True, "private endpoint"),
], ids=["thinking", "no-thinking", "preserve-thinking"])
def test_every_chat_turn_reuses_the_previous_prompt(servers, thinking: bool, preserve: bool, path: str):
    since = len(servers["reuse"].log())
    turns = chat_turns(servers["reuse"], thinking=thinking, preserve=preserve)
    for previous, current in zip(turns, turns[1:]):
        assert current[1] >= previous[0] - PROLOGUE_SLACK, turns
    # the first turn starts at root; each later one resumes from the checkpoint kind that the template allows
    assert reuse_paths(servers["reuse"], since) == ["root", *[path] * (TURNS - 1)]
    assert [answer for *_, answer in turns] == [
        answer for *_, answer in chat_turns(servers["root"], thinking=thinking, preserve=preserve)
    ]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def weather_call(city: str) -> str:
    return f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"


def tool_loop_turns(server: LiveServer, *, thinking: bool) -> list[tuple[int, int, int, str]]:
    """(prompt, cached, completion tokens, finish reason) per request of a three-call tool loop and its answer."""
    client = server.client()
    cities = ["Paris", "Lyon", "Nice"]
    scripts = [("Look the weather up.\n</think>\n\n" if thinking else "") + weather_call(city) for city in cities]
    scripts.append(("Summarize.\n</think>\n\n" if thinking else "") + "All three are sunny.")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "".join(
        f"```ninfer-echo\n{script}\n```\n" for script in scripts)}]
    extra: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": thinking}}
    turns = []
    for _ in scripts:
        reply = client.chat.completions.create(model=ECHO_MODEL, messages=messages, tools=[WEATHER_TOOL],
                                               temperature=0, extra_body=extra)
        choice = reply.choices[0]
        details = reply.usage.prompt_tokens_details
        turns.append((reply.usage.prompt_tokens, details.cached_tokens if details else 0,
                      reply.usage.completion_tokens, choice.finish_reason))
        if choice.finish_reason != "tool_calls":
            break
        replayed: dict[str, Any] = choice.message.model_dump(exclude_none=True)
        messages.append(replayed)
        for call in choice.message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'})
    return turns


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_a_tool_loop_reuses_the_previous_prompt_and_answer(servers, thinking: bool):
    turns = tool_loop_turns(servers["reuse"], thinking=thinking)
    assert [reason for *_, reason in turns] == ["tool_calls"] * 3 + ["stop"]
    for previous, current in zip(turns, turns[1:]):
        assert current[1] >= previous[0] + previous[2] - PROLOGUE_SLACK, turns


def responses_chain(server: LiveServer, *, thinking: bool) -> list[tuple[int, int]]:
    """(input tokens, cached tokens) per turn of a ``previous_response_id`` chain."""
    client = server.client()
    previous = None
    turns = []
    for turn in range(1, TURNS + 1):
        script = thinking_script(turn) if thinking else plain_script(turn)
        response = client.responses.create(
            model=ECHO_MODEL, input=[{"role": "user", "content": fence(script)}], previous_response_id=previous,
            reasoning={"effort": "medium" if thinking else "none"}, temperature=0,
        )
        previous = response.id
        details = response.usage.input_tokens_details
        turns.append((response.usage.input_tokens, details.cached_tokens if details else 0))
    return turns


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_a_responses_chain_reuses_the_previous_input(servers, thinking: bool):
    turns = responses_chain(servers["reuse"], thinking=thinking)
    for previous, current in zip(turns, turns[1:]):
        assert current[1] >= previous[0] - PROLOGUE_SLACK, turns


def anthropic_turns(server: LiveServer, *, thinking: bool) -> list[tuple[int, int]]:
    """(input tokens incl. cached, cached tokens) per turn of a Messages conversation replaying its content."""
    client = anthropic.Anthropic(base_url=server.url(""), api_key="unused")
    messages: list[dict[str, Any]] = []
    turns = []
    for turn in range(1, TURNS + 1):
        script = thinking_script(turn) if thinking else plain_script(turn)
        messages.append({"role": "user", "content": fence(script)})
        reply = client.messages.create(
            model=ECHO_MODEL, max_tokens=2048, messages=messages,
            thinking={"type": "enabled", "budget_tokens": 1024} if thinking else {"type": "disabled"},
        )
        content = [block.model_dump(exclude_none=True) for block in reply.content]
        messages.append({"role": "assistant", "content": content})
        usage = reply.usage
        turns.append((usage.input_tokens + usage.cache_read_input_tokens, usage.cache_read_input_tokens))
    return turns


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
def test_every_messages_turn_reuses_the_previous_prompt(servers, thinking: bool):
    turns = anthropic_turns(servers["reuse"], thinking=thinking)
    for previous, current in zip(turns, turns[1:]):
        assert current[1] >= previous[0] - PROLOGUE_SLACK, turns


def interleaved_turns(server: LiveServer, conversations: int) -> list[list[tuple[int, int, str]]]:
    """``conversations`` Chat conversations (thinking on) advanced round-robin, one turn each in turn."""
    client = server.client()
    histories: list[list[dict[str, Any]]] = [
        [{"role": "system", "content": f"You are assistant number {index}."}] for index in range(conversations)
    ]
    turns: list[list[tuple[int, int, str]]] = [[] for _ in range(conversations)]
    for turn in range(1, TURNS + 1):
        for index, messages in enumerate(histories):
            messages.append({"role": "user", "content": fence(thinking_script(10 * index + turn))})
            reply = client.chat.completions.create(model=ECHO_MODEL, messages=messages, temperature=0)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            details = reply.usage.prompt_tokens_details
            turns[index].append((reply.usage.prompt_tokens, details.cached_tokens if details else 0,
                                 reply.choices[0].message.content))
    return turns


def test_four_interleaved_conversations_keep_their_reuse_at_default_capacities(servers):
    for turns in interleaved_turns(servers["pair"], 4):
        for previous, current in zip(turns, turns[1:]):
            assert current[1] >= previous[0] - PROLOGUE_SLACK, turns


def test_shrunk_capacities_spill_and_evict_without_changing_outputs(servers):
    shrunk = interleaved_turns(servers["shrunk"], 4)
    assert [[answer for *_, answer in turns] for turns in shrunk] == [
        [answer for *_, answer in turns] for turns in interleaved_turns(servers["root"], 4)
    ]
    # one device slot and two host slots cannot hold four conversations: some turns fall back to root
    assert any(cached == 0 for turns in shrunk for _, cached, _ in turns[1:])


def long_system(name: str) -> str:
    return f"You are {name}, a meticulous assistant. " + " ".join(f"Rule {index}: be exact." for index in range(330))


def ask(server: LiveServer, system: str, question: str) -> Any:
    """One request under a long system prompt (with tools); its usage."""
    return server.client().chat.completions.create(
        model=ECHO_MODEL, tools=[WEATHER_TOOL], temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": fence(plain_script(1))},
                  {"role": "assistant", "content": answer(1)}, {"role": "user", "content": question}],
    ).usage


SYSTEM_SLACK = 60  # the short turns after the system prompt


def test_a_long_system_prompt_is_shared_by_other_conversations(servers):
    """An unmarked 2,000-token system prompt (instructions and tools) is reused by a different conversation."""
    first = ask(servers["pair"], long_system("Ada"), "First question?")
    second = ask(servers["pair"], long_system("Ada"), "A different question entirely?")
    assert first.prompt_tokens > 2000
    assert second.prompt_tokens_details.cached_tokens >= first.prompt_tokens - SYSTEM_SLACK


def test_the_shared_prefix_limit_bounds_how_many_system_prompts_are_kept(servers):
    """With room for one shared prefix, a second system prompt displaces the first (the default keeps both)."""
    for server, kept in ((servers["pair"], True), (servers["one_shared"], False)):
        first = ask(server, long_system("Bea"), "One?")
        ask(server, long_system("Cy"), "Two?")
        again = ask(server, long_system("Bea"), "Three?")
        assert (again.prompt_tokens_details.cached_tokens >= first.prompt_tokens - SYSTEM_SLACK) is kept


def test_the_private_continuation_limit_bounds_how_many_conversations_are_kept(servers):
    """Three conversations taking turns: with room for three histories every turn reuses the previous one; with
    room for two, each conversation is the least recently used when its turn comes, so each turn starts at root."""
    for turns in interleaved_turns(servers["three"], 3):
        assert all(current[1] >= previous[0] - PROLOGUE_SLACK for previous, current in zip(turns, turns[1:])), turns
    for turns in interleaved_turns(servers["two"], 3):
        assert [cached for _, cached, _ in turns[1:]] == [0] * (TURNS - 1), turns

