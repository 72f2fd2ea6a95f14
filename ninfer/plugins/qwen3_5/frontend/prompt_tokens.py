"""Prompt tokenization that reuses the tokens of a recent prompt the new one extends.

Agent clients resend the whole conversation every turn, so each prompt mostly repeats the previous one. The encoder
keeps the last few prompts' normalized text, token ids and token starts; a new prompt that begins with one of them up
to a turn opening (``<|im_start|>``) takes that prefix's tokens as they are and tokenizes only the rest. This is
exact: a turn opening is a special token, where the tokenizer always splits, so the tokens before it never depend
on the text after it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import attrs

from ninfer.core.tokenizer import Tokenizer
from ninfer.plugins.qwen3_5.frontend.frontiers import turn_openings

#: prompts remembered (most recently used kept): enough for the conversations of a full batch and a few more
CAPACITY = 16


@attrs.frozen
class EncodedPrompt:
    """A prompt's normalized text, its token ids, where each token starts in the text, and the (character, token)
    offsets of its turn openings after the first character."""

    text: str
    ids: tuple[int, ...]
    starts: tuple[int, ...]
    turns: tuple[tuple[int, int], ...]


class PromptEncoder:
    """``encode(text) -> EncodedPrompt``, thread-safe, reusing the longest turn-aligned prefix of a recent prompt."""

    def __init__(self, tokenizer: Tokenizer, capacity: int = CAPACITY) -> None:
        self._tokenizer = tokenizer
        self._capacity = capacity
        self._recent: OrderedDict[str, EncodedPrompt] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, text: str) -> EncodedPrompt:
        normalized = self._tokenizer.normalize(text)
        with self._lock:
            hit = self._recent.get(normalized)
            if hit is not None:
                self._recent.move_to_end(normalized)
                return hit
            reused = self._longest_reusable(normalized)
        if reused is None:
            ids, starts, _ = self._tokenizer.encode_with_starts(normalized)
        else:
            prefix, (cut, count) = reused
            tail_ids, tail_starts, _ = self._tokenizer.encode_with_starts(normalized[cut:])
            ids = [*prefix.ids[:count], *tail_ids]
            starts = [*prefix.starts[:count], *(cut + start for start in tail_starts)]
        encoded = EncodedPrompt(normalized, tuple(ids), tuple(starts), turn_openings(normalized, starts))
        with self._lock:
            self._recent[normalized] = encoded
            while len(self._recent) > self._capacity:
                self._recent.popitem(last=False)
        return encoded

    def _longest_reusable(self, text: str) -> tuple[EncodedPrompt, tuple[int, int]] | None:
        """The remembered prompt and its latest turn opening (character, token) up to which ``text`` repeats it."""
        best: tuple[EncodedPrompt, tuple[int, int]] | None = None
        for prompt in self._recent.values():
            turns = prompt.turns
            # the turns text repeats form a leading run: find its end by bisection (startswith runs in C)
            low, high = 0, len(turns)
            while low < high:
                middle = (low + high) // 2
                if text.startswith(prompt.text[: turns[middle][0]]):
                    low = middle + 1
                else:
                    high = middle
            if low and (best is None or turns[low - 1][0] > best[1][0]):
                best = prompt, turns[low - 1]
        if best is not None:
            self._recent.move_to_end(best[0].text)
        return best

