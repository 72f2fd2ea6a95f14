"""What the echo model says: the script text of a rendered ChatML prompt.

The script comes from the last real user turn (a user turn that is not only wrapped ``<tool_response>`` output,
the same rule the Qwen chat templates use for "the last user query"):

* a block fenced by a line of three or more backticks followed by ``ninfer-echo`` and closed by a line of at least
  as many backticks is the script, byte for byte, without the fence lines;
* several such blocks script successive assistant turns: the k-th assistant turn after that user turn (tool-call
  turns included) says block k, and the last block is repeated once they run out;
* without a block, the user turn's text itself is the script (echo).
"""

from __future__ import annotations

import re

import attrs

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
FENCE_INFO = "ninfer-echo"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

_OPENING_FENCE = re.compile(r"(`{3,})" + re.escape(FENCE_INFO) + r"[ \t]*")
_CLOSING_FENCE = re.compile(r"(`{3,})[ \t]*")


@attrs.frozen
class Turn:
    """One ChatML turn: ``<|im_start|>{role}\\n{content}<|im_end|>`` (the open final turn has no end marker)."""

    role: str
    content: str

    @property
    def is_real_user_query(self) -> bool:
        """A user turn that is not only wrapped tool output (tool results are rendered as user turns)."""
        if self.role != "user":
            return False
        text = self.content.strip()
        return not (text.startswith(TOOL_RESPONSE_OPEN) and text.endswith(TOOL_RESPONSE_CLOSE))


def chat_turns(prompt_text: str) -> list[Turn]:
    """The ChatML turns of ``prompt_text`` in order; text before the first ``<|im_start|>`` is ignored."""
    turns = []
    for chunk in prompt_text.split(IM_START)[1:]:
        body = chunk.split(IM_END, 1)[0]
        role, _, content = body.partition("\n")
        turns.append(Turn(role, content))
    return turns


def fenced_blocks(text: str) -> list[str]:
    """The bodies of every closed ``ninfer-echo`` fenced block in ``text``, in order.

    A body is the exact text between the opening line's terminator and the terminator (``\\n`` or ``\\r\\n``)
    that precedes the closing line; an opening fence that is never closed is not a block.
    """
    lines = text.split("\n")
    blocks: list[str] = []
    index = 0
    while index < len(lines):
        opening = _OPENING_FENCE.fullmatch(lines[index].removesuffix("\r"))
        if opening is None:
            index += 1
            continue
        width = len(opening.group(1))
        for end in range(index + 1, len(lines)):
            closing = _CLOSING_FENCE.fullmatch(lines[end].removesuffix("\r"))
            if closing is not None and len(closing.group(1)) >= width:
                body = "\n".join(lines[index + 1 : end])
                if end > index + 1 and body.endswith("\r"):
                    body = body[:-1]  # the \r of the \r\n before the closing fence
                blocks.append(body)
                index = end + 1
                break
        else:
            break
    return blocks


def script_text(prompt_text: str) -> str:
    """The script of the assistant turn that ``prompt_text`` (ending in an open assistant turn) asks for.

    Empty when the prompt has no real user turn.
    """
    turns = chat_turns(prompt_text)
    query = next((i for i in range(len(turns) - 1, -1, -1) if turns[i].is_real_user_query), None)
    if query is None:
        return ""
    answered = sum(1 for turn in turns[query + 1 : -1] if turn.role == "assistant")
    blocks = fenced_blocks(turns[query].content)
    if not blocks:
        return turns[query].content
    return blocks[min(answered, len(blocks) - 1)]
