"""The echo model's next token, computed from a row's token history alone.

A history is ``prompt + generated``. The prompt ends right after its last assistant header
``<|im_start|>assistant\n``, extended by the thinking prefix the Qwen templates open a turn with (``<think>\n`` when
thinking, ``<think>\n\n</think>\n\n`` when not). A script never contains ``<|im_start|>`` (that marker ends the user
turn the script is read from), so no header can appear in generated text and the last header is the prompt's.
The next token is the next script token, and ``<|im_end|>`` once the script is done. When the generated part departed
from the script because the engine inserted control tokens that close the thinking block (a thinking budget), the
echo resumes with the script's part after its own ``</think>``. A history that does not agree with its script (a raw
prompt without a header, an assistant prefill that is not the start of the script) gets ``<|im_end|>``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Sequence

import attrs
import torch
from ninfer_echo.script import script_text

from ninfer.core.errors import ArtifactError
from ninfer.core.tokenizer import Tokenizer

_SCRIPT_CACHE_ENTRIES = 1024


def _single_token(tokenizer: Tokenizer, text: str) -> int:
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise ArtifactError(f"the echo model needs {text!r} to be one token of the artifact tokenizer, got {ids}")
    return ids[0]


@attrs.frozen
class ChatMarkers:
    """Token ids of the ChatML markup the echo model recognizes."""

    assistant_header: tuple[int, ...]
    thinking_open: tuple[int, ...]
    thinking_skipped: tuple[int, ...]
    im_end: int
    think_close: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> "ChatMarkers":
        return cls(
            assistant_header=tuple(tokenizer.encode("<|im_start|>assistant\n")),
            thinking_open=tuple(tokenizer.encode("<think>\n")),
            thinking_skipped=tuple(tokenizer.encode("<think>\n\n</think>\n\n")),
            im_end=_single_token(tokenizer, "<|im_end|>"),
            think_close=_single_token(tokenizer, "</think>"),
        )


def _starts_with(ids: torch.Tensor, start: int, pattern: tuple[int, ...]) -> bool:
    end = start + len(pattern)
    return end <= ids.numel() and tuple(ids[start:end].tolist()) == pattern


def prompt_end(history: torch.Tensor, markers: ChatMarkers) -> int | None:
    """The prompt length within ``history`` (an int64 tensor of token ids), or None without an assistant header."""
    header = markers.assistant_header
    if history.numel() < len(header):
        return None
    hits = torch.ones(history.numel() - len(header) + 1, dtype=torch.bool)
    for offset, token in enumerate(header):
        hits &= history[offset : offset + hits.numel()] == token
    starts = hits.nonzero().flatten()
    if starts.numel() == 0:
        return None
    end = int(starts[-1]) + len(header)
    for prefix in (markers.thinking_skipped, markers.thinking_open):
        if _starts_with(history, end, prefix):
            return end + len(prefix)
    return end


class ScriptBook:
    """Script token ids per distinct prompt, computed once: decode, pick the script text, tokenize."""

    def __init__(self, tokenizer: Tokenizer, capacity: int = _SCRIPT_CACHE_ENTRIES) -> None:
        self._tokenizer = tokenizer
        self._capacity = capacity
        self._scripts: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()

    def script(self, prompt: torch.Tensor) -> tuple[int, ...]:
        """The script of ``prompt`` (an int64 tensor of token ids ending in an assistant-turn opening)."""
        key = hashlib.blake2b(prompt.numpy().tobytes(), digest_size=16).digest()
        tokens = self._scripts.get(key)
        if tokens is not None:
            self._scripts.move_to_end(key)
            return tokens
        known = [token for token in prompt.tolist() if token < self._tokenizer.vocab_size]  # padding ids: no text
        text = script_text(self._tokenizer.decode(known))
        tokens = tuple(self._tokenizer.encode(text))
        self._scripts[key] = tokens
        if len(self._scripts) > self._capacity:
            self._scripts.popitem(last=False)
        return tokens


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items ``a`` and ``b`` share."""
    shortest = min(len(a), len(b))
    if a[:shortest] == b[:shortest]:
        return shortest
    return next(index for index, (x, y) in enumerate(zip(a, b)) if x != y)


class Continuation:
    """Decides the echo model's next token for a token history."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.markers = ChatMarkers.from_tokenizer(tokenizer)
        self.scripts = ScriptBook(tokenizer)

    def next_token(self, history: torch.Tensor) -> int:
        """The token after ``history`` (an int64 CPU tensor of token ids)."""
        end = prompt_end(history, self.markers)
        if end is None:
            return self.markers.im_end
        token = self._follow(self.scripts.script(history[:end]), tuple(history[end:].tolist()))
        return self.markers.im_end if token is None else token

    def _follow(self, script: tuple[int, ...], generated: tuple[int, ...]) -> int | None:
        """The next token if ``generated`` agrees with ``script`` (directly or resumed after ``</think>``)."""
        done = len(generated)
        agreed = _common_prefix(generated, script)
        if agreed == done:
            return script[done] if done < len(script) else self.markers.im_end
        return self._resume_after_thinking(script, generated, agreed)

    def _resume_after_thinking(self, script: tuple[int, ...], generated: tuple[int, ...], agreed: int) -> int | None:
        """Continue with the script's answer once control tokens departing from the script closed the thinking."""
        markers = self.markers
        if markers.think_close not in script or markers.think_close not in generated[agreed:]:
            return None
        answer = script[script.index(markers.think_close) + 1 :]
        tail = generated[generated.index(markers.think_close, agreed) + 1 :]
        if markers.im_end in tail:
            return markers.im_end
        # The shortest alignment of the tail onto the answer: control text the insert ended with (e.g. "\n\n")
        # stands in for the answer's own opening tokens.
        skip = next(
            (skip for skip in range(len(tail)) if tail[skip:] == answer[: len(tail) - skip]), len(tail)
        )
        emitted = len(tail) - skip
        return answer[emitted] if emitted < len(answer) else markers.im_end
