"""The request generators of ``ninfer bench serve`` and each endpoint's wire shape of a conversation.

Rules:

- Prompt text is drawn from :data:`WORDS`: every word is one token with and without its leading space in the Qwen
  tokenizer (and in most byte-level BPE vocabularies), so ``n`` words come to about ``n`` tokens of text. The chat
  template adds its own few tokens; the benchmark reports the server's usage, never this estimate.
- Every dataset is a list of :class:`Conversation`: the ``random`` dataset is one-turn conversations without a
  system prompt, each of a fresh random text; ``multiturn`` conversations share one system prompt (the same text in
  every conversation of a run, so a prefix cache can share it) and differ in every user message.
- Turn 1 is a user message. A later turn replays the previous answer as an assistant message and then adds either
  a new user message or, on a tool turn, a tool call on that assistant message followed by the tool's result.
- Lengths are drawn uniformly from ``[len * (1 - ratio), len * (1 + ratio)]`` (at least 1), like vLLM's
  ``--random-range-ratio``.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any, Sequence

import attrs

ENDPOINTS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}
DATASETS = ("random", "multiturn")
TOOL_NAME = "lookup"
TOOL_DESCRIPTION = "Look a query up in the reference notes and return what they say."
TOOL_PARAMETERS = {
    "type": "object",
    "properties": {"query": {"type": "string", "description": "what to look up"}},
    "required": ["query"],
}
EMPTY_REPLY = "(no text)"

#: One token each, with and without a leading space (checked against the Qwen tokenizer).
WORDS = tuple(
    """the of and to in is was for on that with as by at from it his an were are which this be or has had not first
    one their its new after but who they have her she two been other when there all during into school time may years
    more most only over city some world would where later up such used many can state about national out known then
    made between area part team three under him life both people year family each well american while called through
    before however early game series now same work until against around music since second group history film often
    these war form being including what member number public four five six seven eight nine ten home house water
    light river stone cloud green black white red blue small large long high great little good best last next place
    point line name word page book story side head hand eye face door room road field town country king power law
    case end way day night week month""".split()
)


@attrs.frozen
class ToolCall:
    """A scripted call of :data:`TOOL_NAME`; ``arguments`` is its JSON object text."""

    call_id: str
    arguments: str


@attrs.frozen
class Turn:
    """One request of a conversation: the new user message, or (``tool_call`` set) the tool result, to append."""

    text: str
    max_tokens: int
    tool_call: ToolCall | None = None


@attrs.frozen
class Conversation:
    """A conversation's fixed parts; ``tools`` declares :data:`TOOL_NAME` on every request."""

    index: int
    system: str | None
    turns: tuple[Turn, ...]
    tools: bool = False


@attrs.frozen
class Message:
    """A protocol-neutral history entry: ``user``, ``assistant`` (optionally calling a tool) or ``tool`` (the result
    of ``tool_call``)."""

    role: str
    text: str
    tool_call: ToolCall | None = None


@attrs.frozen
class Reply:
    """What the model streamed back for one turn."""

    content: str
    reasoning: str

    def replay_text(self) -> str:
        """The text replayed as the assistant's answer: the content, else the reasoning (a reasoning-only reply cut
        by the output limit), else :data:`EMPTY_REPLY` (no endpoint accepts an empty assistant turn everywhere)."""
        return self.content or self.reasoning or EMPTY_REPLY


# -- generators ----------------------------------------------------------------------------------------------------


def sample_length(rng: random.Random, length: int, ratio: float) -> int:
    """A length drawn uniformly from ``[length * (1 - ratio), length * (1 + ratio)]``, at least 1."""
    if ratio <= 0:
        return length
    low, high = max(1, math.floor(length * (1 - ratio))), max(1, math.ceil(length * (1 + ratio)))
    return rng.randint(low, high)


def words(rng: random.Random, count: int) -> str:
    """``count`` random words of :data:`WORDS` (about ``count`` tokens)."""
    return " ".join(rng.choice(WORDS) for _ in range(count))


def random_dataset(
    rng: random.Random, count: int, input_len: int, output_len: int, ratio: float
) -> list[Conversation]:
    """``count`` one-turn conversations of about ``input_len`` prompt tokens and ``output_len`` output tokens."""
    return [
        Conversation(index, None, (Turn(words(rng, sample_length(rng, input_len, ratio)),
                                        sample_length(rng, output_len, ratio)),))
        for index in range(count)
    ]


def is_tool_turn(turn: int, fraction: float) -> bool:
    """Whether turn ``turn`` (1-based) is a tool turn: never the first; of the later turns an evenly spaced
    ``fraction`` (1: every one, 0.5: turns 2, 4, 6...; any fraction above 0 makes turn 2 one)."""
    if turn < 2 or fraction <= 0:
        return False
    return math.ceil((turn - 1) * fraction - 1e-9) > math.ceil((turn - 2) * fraction - 1e-9)


def multiturn_dataset(
    rng: random.Random, count: int, *, turns: int, input_len: int, output_len: int, ratio: float,
    system_prompt_len: int, tool_turns: float,
) -> list[Conversation]:
    """``count`` conversations of ``turns`` turns under one shared system prompt of ``system_prompt_len`` words;
    each new user message (or tool result) is about ``input_len`` tokens, each answer at most about ``output_len``."""
    system = words(rng, system_prompt_len) if system_prompt_len > 0 else None
    conversations = []
    for index in range(count):
        scripted = []
        for turn in range(1, turns + 1):
            text = words(rng, sample_length(rng, input_len, ratio))
            call = None
            if is_tool_turn(turn, tool_turns):
                call = ToolCall(f"call_{index}_{turn}", json.dumps({"query": words(rng, 4)}))
            scripted.append(Turn(text, sample_length(rng, output_len, ratio), call))
        conversations.append(Conversation(index, system, tuple(scripted), tools=tool_turns > 0))
    return conversations


def extend_history(history: Sequence[Message], reply: Reply | None, turn: Turn) -> list[Message]:
    """The history of ``turn``'s request: ``history``, the previous ``reply`` (carrying the turn's tool call, if
    any), then the turn's user message or tool result."""
    extended = list(history)
    if reply is not None:
        extended.append(Message("assistant", reply.replay_text(), turn.tool_call))
    elif turn.tool_call is not None:
        raise ValueError("a tool turn needs the previous answer to carry its call")
    extended.append(Message("tool", turn.text, turn.tool_call) if turn.tool_call else Message("user", turn.text))
    return extended


# -- wire shapes ---------------------------------------------------------------------------------------------------


def request_body(endpoint: str, model: str, conversation: Conversation, history: Sequence[Message],
                 max_tokens: int) -> dict[str, Any]:
    """The streaming request body of one turn on ``endpoint`` (a key of :data:`ENDPOINTS`)."""
    build = {"chat": chat_body, "responses": responses_body, "messages": messages_body}[endpoint]
    return build(model, conversation, history, max_tokens)


def chat_body(model: str, conversation: Conversation, history: Sequence[Message], max_tokens: int) -> dict[str, Any]:
    """OpenAI Chat Completions: ``tool_calls`` on the assistant message, then a ``tool`` message."""
    messages: list[dict[str, Any]] = []
    if conversation.system is not None:
        messages.append({"role": "system", "content": conversation.system})
    for message in history:
        call = message.tool_call
        if message.role == "tool":
            assert call is not None
            messages.append({"role": "tool", "tool_call_id": call.call_id, "content": message.text})
            continue
        entry: dict[str, Any] = {"role": message.role, "content": message.text}
        if call is not None:
            entry["tool_calls"] = [{"id": call.call_id, "type": "function",
                                    "function": {"name": TOOL_NAME, "arguments": call.arguments}}]
        messages.append(entry)
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if conversation.tools:
        body["tools"] = [{"type": "function", "function": {"name": TOOL_NAME, "description": TOOL_DESCRIPTION,
                                                           "parameters": TOOL_PARAMETERS}}]
    return body


def responses_body(model: str, conversation: Conversation, history: Sequence[Message],
                   max_tokens: int) -> dict[str, Any]:
    """OpenAI Responses: the system prompt as ``instructions``; a ``function_call`` Item after the assistant
    message, then a ``function_call_output`` Item. ``store: false``: the benchmark replays the history itself."""
    items: list[dict[str, Any]] = []
    for message in history:
        call = message.tool_call
        if message.role == "tool":
            assert call is not None
            items.append({"type": "function_call_output", "call_id": call.call_id, "output": message.text})
            continue
        part = "output_text" if message.role == "assistant" else "input_text"
        items.append({"type": "message", "role": message.role, "content": [{"type": part, "text": message.text}]})
        if call is not None:
            items.append({"type": "function_call", "call_id": call.call_id, "name": TOOL_NAME,
                          "arguments": call.arguments})
    body: dict[str, Any] = {"model": model, "input": items, "max_output_tokens": max_tokens, "stream": True,
                            "store": False}
    if conversation.system is not None:
        body["instructions"] = conversation.system
    if conversation.tools:
        body["tools"] = [{"type": "function", "name": TOOL_NAME, "description": TOOL_DESCRIPTION,
                          "parameters": TOOL_PARAMETERS}]
    return body


def messages_body(model: str, conversation: Conversation, history: Sequence[Message],
                  max_tokens: int) -> dict[str, Any]:
    """Anthropic Messages: a ``tool_use`` block after the assistant's text, then a user message holding the
    ``tool_result`` block."""
    messages: list[dict[str, Any]] = []
    for message in history:
        call = message.tool_call
        if message.role == "tool":
            assert call is not None
            block = {"type": "tool_result", "tool_use_id": call.call_id, "content": message.text}
            messages.append({"role": "user", "content": [block]})
        elif message.role == "assistant":
            blocks: list[dict[str, Any]] = [{"type": "text", "text": message.text}]
            if call is not None:
                blocks.append({"type": "tool_use", "id": call.call_id, "name": TOOL_NAME,
                               "input": json.loads(call.arguments)})
            messages.append({"role": "assistant", "content": blocks})
        else:
            messages.append({"role": "user", "content": message.text})
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}
    if conversation.system is not None:
        body["system"] = conversation.system
    if conversation.tools:
        body["tools"] = [{"name": TOOL_NAME, "description": TOOL_DESCRIPTION, "input_schema": TOOL_PARAMETERS}]
    return body
