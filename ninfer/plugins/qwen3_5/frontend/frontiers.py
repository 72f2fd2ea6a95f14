"""Where the next request of a conversation stops sharing this prompt: the frontiers worth a checkpoint.

The Qwen templates re-render a closed assistant turn differently from the tokens the model generated: without
``preserve_thinking`` the reasoning of every turn before the last user query is dropped, and the thinking-off
prologue (an empty think block) is never replayed. So the next request shares this prompt up to where the current
response's generation prologue starts (the next request closes that turn with the answer, or continues a tool
loop after it), and, once a new user query closes the open turn, up to the first assistant opener after the last
user query (every assistant turn from there loses its reasoning). A checkpoint at each lets every turn reuse its
history; the engine verifies a hit by exact tokens, so a frontier that does not recur costs only its capture.
A long leading system turn also gets a frontier of its own, shared by every conversation that starts with it, and
a long conversation gets a few anchors further back.
"""

from __future__ import annotations

import bisect
from typing import Sequence

TURN_OPEN = "<|im_start|>"
SYSTEM_OPEN = "<|im_start|>system\n"
ASSISTANT_OPEN = "<|im_start|>assistant\n"
USER_OPEN = "<|im_start|>user\n"
TOOL_RESPONSE_OPEN = "<tool_response>"
#: A leading system turn (instructions and tools) this long is worth a checkpoint that other conversations share.
MIN_SHARED_PREFIX_TOKENS = 256
#: Long anchors stand at the last turn opening before each multiple of this many tokens.
ANCHOR_STEP = 4096


def response_prologue_cut(text: str) -> int | None:
    """Where the current response's turn opens: the last assistant opener."""
    cut = text.rfind(ASSISTANT_OPEN)
    return cut if cut > 0 else None


def open_turn_cut(text: str) -> int | None:
    """Where the open turn's first assistant message starts: the first assistant opener after the last user turn
    that is a real query (tool results and placeholder turns are user turns wrapped in ``<tool_response>``)."""
    search_end = len(text)
    while True:
        user = text.rfind(USER_OPEN, 0, search_end)
        if user < 0:
            return None
        if not text.startswith(TOOL_RESPONSE_OPEN, user + len(USER_OPEN)):
            break
        search_end = user
    cut = text.find(ASSISTANT_OPEN, user)
    return cut if cut > 0 else None


def system_run_cut(text: str) -> int | None:
    """Where the leading system turn (the instructions and the tool definitions) ends."""
    if not text.startswith(SYSTEM_OPEN):
        return None
    cut = text.find(TURN_OPEN, len(SYSTEM_OPEN))
    return cut if cut > 0 else None


def shared_prefix_frontier(text: str, starts: Sequence[int]) -> int | None:
    """The end of a leading system turn of at least :data:`MIN_SHARED_PREFIX_TOKENS` tokens: the prefix that
    conversations with the same instructions and tools share (an engine candidate, beside explicit breakpoints)."""
    cut = system_run_cut(text)
    frontier = None if cut is None else token_frontier(starts, cut)
    return frontier if frontier is not None and MIN_SHARED_PREFIX_TOKENS <= frontier < len(starts) else None


def turn_openings(text: str, starts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``(character, token)`` offsets of every turn opening after the first character where a token starts."""
    openings = []
    cut = text.find(TURN_OPEN, 1)
    while cut > 0:
        frontier = token_frontier(starts, cut)
        if frontier is not None:
            openings.append((cut, frontier))
        cut = text.find(TURN_OPEN, cut + 1)
    return tuple(openings)


def long_anchors(openings: Sequence[tuple[int, int]], tokens: int) -> tuple[int, ...]:
    """Recovery points of a long conversation: for every multiple of ANCHOR_STEP tokens, the last turn opening at
    or before it. The grid is absolute, so the anchors a growing conversation passes stay the same turn after
    turn: prefill captures each once, when it first computes through it, and a history edited or truncated far
    from its end falls back to the nearest retained anchor before the edit rather than to root (the engine keeps
    the most recent few per conversation). ``openings`` are the prompt's :func:`turn_openings`, ``tokens`` its
    length."""
    turn_starts = [frontier for _cut, frontier in openings]
    anchors = set()
    for boundary in range(ANCHOR_STEP, tokens, ANCHOR_STEP):
        index = bisect.bisect_right(turn_starts, boundary) - 1
        if index >= 0:
            anchors.add(turn_starts[index])
    return tuple(sorted(anchors))


def token_frontier(starts: Sequence[int], cut: int) -> int | None:
    """The number of tokens before character ``cut``, when a token starts exactly there."""
    index = bisect.bisect_left(starts, cut)
    return index if index < len(starts) and starts[index] == cut else None


def continuation_frontiers(text: str, starts: Sequence[int]) -> tuple[int, ...]:
    """Token frontiers of the response prologue and of the open turn (each strictly inside the prompt)."""
    frontiers = set()
    for cut in (response_prologue_cut(text), open_turn_cut(text)):
        frontier = None if cut is None else token_frontier(starts, cut)
        if frontier is not None and 0 < frontier < len(starts):
            frontiers.add(frontier)
    return tuple(sorted(frontiers))
