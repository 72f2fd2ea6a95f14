"""Anthropic ``system`` + ``messages`` -> ordered :class:`Message` s, and ``cache_control`` -> breakpoint candidates.

Lowering rules: a top-level system (string or text blocks) leads; consecutive user or assistant messages are joined
without separators; mid-conversation system messages keep their position. An assistant turn is representable as
thinking -> text -> tool_use; thinking text is the reasoning (its ``signature`` is transport metadata only). A
visible tool_use turn needs exactly one leading ``tool_result`` per declared id in the next user turn; results are
normalized to call order. A history that begins with results (truncated or imported) is valid. A final text-only
assistant message is a prefill that generation continues.

The first block of an ARRAY system that is a text block starting with ``x-anthropic-billing-header:`` (Claude Code's
per-request attribution) is consumed, with its ``cache_control``, before counting, rendering and cache identity.

Cache markers: at most four distinct block-level breakpoints; a request-level ``cache_control`` targets the last
cacheable block (merges with the same TTL there, conflicts with another TTL, needs a free slot otherwise). Marked
text/image blocks and tool results become ``cache_breakpoint`` parts, a marked tool_use marks its call, and a marked
tool definition sets ``Conversation.tools_cache_breakpoint``; the frontend maps each to the end of its turn.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import attrs

from ninfer.core.conversation import ContentPart, ImagePart, Message, TextPart, ToolCall, ToolResult
from ninfer.core.errors import InvalidRequestError
from ninfer.protocols.fields import malformed, quoted, type_name, type_tag, unsupported, vision_disabled
from ninfer.protocols.reasoning_codec import decode_reasoning

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"
MAX_BLOCK_BREAKPOINTS = 4
CACHE_TTLS = ("5m", "1h")
DEFAULT_TTL = "5m"
CACHEABLE_TYPES = ("text", "image", "tool_use", "tool_result")
IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")
INVALID_TOOL_HISTORY = "invalid_tool_history"
INVALID_ASSISTANT_HISTORY = "invalid_assistant_history"
ROLES = ("user", "assistant", "system")
_UNSUPPORTED_BLOCKS = {
    "document": "documents need a document processor",
    "tool_reference": "loading a deferred tool needs a tool search",
    "search_result": "search results need citation support",
    "container_upload": "container uploads need a code-execution container",
    "server_tool_use": "server tool calls need a server-side tool executor",
    "web_search_tool_result": "server tool results need a server-side tool executor",
    "web_fetch_tool_result": "server tool results need a server-side tool executor",
    "code_execution_tool_result": "server tool results need a server-side tool executor",
    "mcp_tool_use": "MCP tool calls need a remote MCP executor",
    "mcp_tool_result": "MCP tool results need a remote MCP executor",
}

Path = tuple[Any, ...]  # ("tools", i) | ("system", j) | ("messages", i, j) | ("messages", i, j, k)


def dotted(path: Path) -> str:
    """The wire path of a block path; a message's blocks are in its ``content`` (``messages.2.content.0``)."""
    items = [*path[:2], "content", *path[2:]] if path[0] == "messages" and len(path) > 2 else list(path)
    return ".".join(str(item) for item in items)


# -- cache plan ------------------------------------------------------------------------------------


@attrs.frozen
class CachePlan:
    """Block paths chosen as breakpoints, the path of a consumed billing-header block, and the slot count."""

    marked: frozenset[Path]
    billing_block: Path | None
    breakpoints: int


def _ttl(marker: Any, param: str) -> str:
    if not isinstance(marker, dict):
        raise malformed(param, f"expected an object, got {type_name(marker)}")
    if marker.get("type") != "ephemeral":
        raise malformed(f"{param}.type", f"expected 'ephemeral', got {quoted(marker.get('type'))}")
    ttl = marker.get("ttl", DEFAULT_TTL)
    if ttl not in CACHE_TTLS:
        raise malformed(f"{param}.ttl", f"expected '5m' or '1h', got {quoted(ttl)}")
    return ttl


def billing_block(body: Mapping[str, Any]) -> Path | None:
    """The path of the consumable billing-header block: the first block of an array system only."""
    system = body.get("system")
    if isinstance(system, list) and system and isinstance(system[0], dict) and system[0].get("type") == "text":
        text = system[0].get("text")
        if isinstance(text, str) and text.startswith(BILLING_HEADER_PREFIX):
            return ("system", 0)
    return None


def _content_blocks(content: Any) -> Iterator[tuple[int, Any]]:
    if isinstance(content, str):
        yield 0, {"type": "text", "text": content}
    elif isinstance(content, list):
        yield from enumerate(content)


def _blocks_in_order(body: Mapping[str, Any], skip: Path | None) -> Iterator[tuple[Path, Any]]:
    """Every block that may carry ``cache_control``, in prompt order (tools, system, messages, result parts)."""
    tools = body.get("tools")
    for index, tool in enumerate(tools if isinstance(tools, list) else ()):
        yield ("tools", index), tool
    system = body.get("system")
    for index, block in _content_blocks(system):
        if ("system", index) != skip:
            yield ("system", index), block
    messages = body.get("messages")
    for m, message in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(message, dict):
            continue
        for b, block in _content_blocks(message.get("content")):
            yield ("messages", m, b), block
            if isinstance(block, dict) and block.get("type") == "tool_result":
                for k, part in _content_blocks(block.get("content")):
                    if isinstance(part, dict) and "cache_control" in part:
                        yield ("messages", m, b, "content", k), part


def _cacheable(path: Path, block: Any) -> bool:
    return path[0] == "tools" or (isinstance(block, dict) and block.get("type") in CACHEABLE_TYPES)


def plan_cache(body: Mapping[str, Any]) -> CachePlan:
    """Validate every ``cache_control`` and choose the breakpoint targets (see the module docstring)."""
    skip = billing_block(body)
    explicit: dict[Path, str] = {}
    last_cacheable: Path | None = None
    for path, block in _blocks_in_order(body, skip):
        cacheable = _cacheable(path, block)
        if cacheable and len(path) <= 3:  # a tool_result's own parts are not candidates for the request-level target
            last_cacheable = path
        marker = block.get("cache_control") if isinstance(block, dict) else None
        if marker is None:
            continue
        where = f"{dotted(path)}.cache_control"
        ttl = _ttl(marker, where)
        if not cacheable:
            raise malformed(where, f"{quoted(block.get('type'))} blocks cannot carry a cache breakpoint")
        explicit[path] = ttl
    if len(explicit) > MAX_BLOCK_BREAKPOINTS:
        raise malformed("cache_control", f"at most {MAX_BLOCK_BREAKPOINTS} blocks may carry cache_control, got "
                        f"{len(explicit)}")
    marked = dict(explicit)
    request_marker = body.get("cache_control")
    if request_marker is not None:
        ttl = _ttl(request_marker, "cache_control")
        if last_cacheable is not None:
            existing = explicit.get(last_cacheable)
            if existing is not None and existing != ttl:
                raise malformed("cache_control", f"the request-level ttl {quoted(ttl)} conflicts with the ttl "
                                f"{quoted(existing)} of the breakpoint already on its target "
                                f"{dotted(last_cacheable)}")
            if existing is None and len(explicit) == MAX_BLOCK_BREAKPOINTS:
                raise malformed("cache_control", f"the request-level breakpoint needs a fifth slot: "
                                f"{MAX_BLOCK_BREAKPOINTS} block-level breakpoints are already in use")
            marked[last_cacheable] = ttl
    return CachePlan(frozenset(marked), skip, len(marked))


# -- blocks ----------------------------------------------------------------------------------------


def _reject_block(kind: str | None, where: str) -> InvalidRequestError:
    if kind == "redacted_thinking":
        return unsupported(f"{where}.type", "redacted thinking is encrypted Anthropic reasoning that ninfer cannot "
                           "decrypt or restore; drop the block or replay visible thinking")
    reason = _UNSUPPORTED_BLOCKS.get(kind)
    if reason is not None:
        return unsupported(f"{where}.type", f"{kind} blocks cannot be processed: {reason}, which ninfer does not have")
    return malformed(f"{where}.type", f"unknown content block type {quoted(kind)}")


def _text(block: Mapping[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise malformed(f"{where}.text", f"expected a string, got {type_name(text)}")
    return text


def _image(block: Mapping[str, Any], where: str, vision: bool, marked: bool) -> ImagePart:
    source = block.get("source")
    if not isinstance(source, dict):
        raise malformed(f"{where}.source", f"expected an image source object, got {type_name(source)}")
    kind = type_tag(source, f"{where}.source")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in IMAGE_MEDIA_TYPES:
            raise malformed(f"{where}.source.media_type", f"expected one of {', '.join(IMAGE_MEDIA_TYPES)}, got "
                            f"{quoted(media_type)}")
        if not isinstance(data, str) or not data:
            raise malformed(f"{where}.source.data", "expected non-empty base64 data")
        url = f"data:{media_type};base64,{data}"
    elif kind == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url.lower().startswith(("http://", "https://")):
            raise InvalidRequestError(f"{where}.source.url: expected an http(s) URL", param=f"{where}.source.url",
                                      code="invalid_media")
    elif kind == "file":
        raise unsupported(f"{where}.source.type", "file sources need the Files API, which ninfer does not have; send "
                          "base64 data or a URL")
    else:
        raise malformed(f"{where}.source.type", f"expected 'base64' or 'url', got {quoted(kind)}")
    if not vision:
        raise vision_disabled(where, "image")
    return ImagePart(url, marked)


def _result_parts(block: Mapping[str, Any], path: Path, where: str, plan: CachePlan, vision: bool
                  ) -> tuple[ContentPart, ...]:
    content = block.get("content")
    if content is None:
        parts: list[ContentPart] = []
    elif isinstance(content, str):
        parts = [TextPart(content)] if content else []
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            at, spot = f"{where}.content.{k}", (*path, "content", k)
            if not isinstance(part, dict):
                raise malformed(at, f"expected a content block, got {type_name(part)}")
            kind = type_tag(part, at)
            if kind == "text":
                parts.append(TextPart(_text(part, at), spot in plan.marked))
            elif kind == "image":
                parts.append(_image(part, at, vision, spot in plan.marked))
            else:
                raise _reject_block(kind, at)
    else:
        raise malformed(f"{where}.content", f"expected a string or an array of blocks, got {type_name(content)}")
    if path in plan.marked and parts:
        parts[-1] = attrs.evolve(parts[-1], cache_breakpoint=True)
    return tuple(parts)


# -- messages --------------------------------------------------------------------------------------


@attrs.frozen
class Turn:
    """Consecutive same-role wire messages joined: their blocks with their paths."""

    role: str
    blocks: tuple[tuple[Path, Mapping[str, Any]], ...]
    first_index: int


@attrs.frozen
class LoweredHistory:
    messages: tuple[Message, ...]
    prefill: bool


def _system_message(system: Any, plan: CachePlan) -> Message | None:
    if system is None:
        return None
    if isinstance(system, str):
        return Message("system", (TextPart(system, ("system", 0) in plan.marked),)) if system else None
    if not isinstance(system, list):
        raise malformed("system", f"expected a string or an array of text blocks, got {type_name(system)}")
    parts: list[ContentPart] = []
    for index, block in enumerate(system):
        where = f"system.{index}"
        if not isinstance(block, dict):
            raise malformed(where, f"expected a text block, got {type_name(block)}")
        if type_tag(block, where) != "text":
            raise malformed(f"{where}.type", f"system blocks must be text blocks, got {quoted(block.get('type'))}")
        text = _text(block, where)
        if ("system", index) != plan.billing_block:
            parts.append(TextPart(text, ("system", index) in plan.marked))
    return Message("system", tuple(parts)) if parts else None


def _turns(raw: Any) -> list[Turn]:
    if not isinstance(raw, list):
        raise malformed("messages", f"expected an array of messages, got {type_name(raw)}")
    if not raw:
        raise malformed("messages", "at least one message is required")
    turns: list[Turn] = []
    for index, message in enumerate(raw):
        where = f"messages.{index}"
        if not isinstance(message, dict):
            raise malformed(where, f"expected a message object, got {type_name(message)}")
        role = type_tag(message, where, "role")
        if role not in ROLES:
            raise malformed(f"{where}.role", f"expected 'user', 'assistant' or 'system', got {quoted(role)}")
        content = message.get("content")
        if not isinstance(content, (str, list)):
            raise malformed(f"{where}.content", f"expected a string or an array of blocks, got {type_name(content)}")
        blocks = []
        for b, block in _content_blocks(content):
            if not isinstance(block, dict):
                raise malformed(f"{where}.content.{b}", f"expected a content block, got {type_name(block)}")
            blocks.append((("messages", index, b), block))
        if turns and role != "system" and turns[-1].role == role:
            turns[-1] = attrs.evolve(turns[-1], blocks=turns[-1].blocks + tuple(blocks))
        else:
            turns.append(Turn(role, tuple(blocks), index))
    return turns


class HistoryLowering:
    """Walks the joined turns, pairing each tool_use turn with the results of the next user turn."""

    def __init__(self, plan: CachePlan, vision: bool) -> None:
        self.plan = plan
        self.vision = vision
        self.messages: list[Message] = []
        self.pending: dict[str, str] = {}  # open call id -> tool name, in call order
        self.seen_assistant = False

    def user(self, turn: Turn) -> None:
        results: list[tuple[Path, Mapping[str, Any]]] = []
        parts: list[ContentPart] = []
        for path, block in turn.blocks:
            where = dotted(path)
            kind = type_tag(block, where)
            if kind == "tool_result":
                if parts:
                    raise InvalidRequestError(f"{where}: tool_result blocks must come before any other content of "
                                              "their user turn", param=where, code=INVALID_TOOL_HISTORY)
                results.append((path, block))
            elif kind == "text":
                parts.append(TextPart(_text(block, where), path in self.plan.marked))
            elif kind == "image":
                parts.append(_image(block, where, self.vision, path in self.plan.marked))
            elif kind in ("thinking", "tool_use"):
                raise malformed(f"{where}.type", f"{kind} blocks are only valid in assistant messages")
            else:
                raise _reject_block(kind, where)
        self._results(turn, results)
        if parts or not results:
            self.messages.append(Message("user", tuple(parts)))

    def _results(self, turn: Turn, results: list[tuple[Path, Mapping[str, Any]]]) -> None:
        lowered: dict[str, Message] = {}
        for path, block in results:
            where = dotted(path)
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise malformed(f"{where}.tool_use_id", "expected the id of the tool_use this result answers")
            if call_id in lowered:
                raise InvalidRequestError(f"{where}: duplicate tool_result for tool_use id {quoted(call_id)}",
                                          param=where, code=INVALID_TOOL_HISTORY)
            if self.pending and call_id not in self.pending or not self.pending and self.seen_assistant:
                raise InvalidRequestError(f"{where}: tool_result {quoted(call_id)} answers no tool_use of the "
                                          "preceding assistant turn", param=where, code=INVALID_TOOL_HISTORY)
            is_error = block.get("is_error", False)
            if not isinstance(is_error, bool):
                raise malformed(f"{where}.is_error", f"expected a boolean, got {type_name(is_error)}")
            parts = _result_parts(block, path, where, self.plan, self.vision)
            result = ToolResult(call_id, parts, is_error=is_error, name=self.pending.get(call_id))
            lowered[call_id] = Message("tool", tool_result=result)
        missing = [call_id for call_id in self.pending if call_id not in lowered]
        if missing:
            where = f"messages.{turn.first_index}"
            raise InvalidRequestError(
                f"{where}: the preceding assistant turn called tool_use ids {', '.join(missing)} without a "
                "tool_result; the next user turn must start with exactly one result per call",
                param=where, code=INVALID_TOOL_HISTORY)
        order = list(self.pending) if self.pending else list(lowered)
        self.messages.extend(lowered[call_id] for call_id in order)
        self.pending = {}

    def assistant(self, turn: Turn) -> Message:
        self.require_results(turn.first_index)
        reasoning: list[str] = []
        parts: list[TextPart] = []
        calls: list[ToolCall] = []
        phase = 0  # 0 thinking, 1 text, 2 tool_use: the order a Qwen assistant turn can represent
        for path, block in turn.blocks:
            where = dotted(path)
            kind = type_tag(block, where)
            if kind == "thinking":
                thinking, signature = block.get("thinking"), block.get("signature")
                if not isinstance(thinking, str):
                    raise malformed(f"{where}.thinking", f"expected a string, got {type_name(thinking)}")
                if signature is not None and not isinstance(signature, str):
                    raise malformed(f"{where}.signature", f"expected a string, got {type_name(signature)}")
                if not thinking and signature:  # display "omitted": the signature carries the reasoning
                    thinking = decode_reasoning(signature, f"{where}.signature")
                self._order(phase, 0, where)
                reasoning.append(thinking)
            elif kind == "text":
                text = _text(block, where)
                if text:
                    self._order(phase, 1, where)
                    phase = 1
                parts.append(TextPart(text, path in self.plan.marked))
            elif kind == "tool_use":
                phase = 2
                call = attrs.evolve(self._call(block, where), cache_breakpoint=path in self.plan.marked)
                if any(existing.call_id == call.call_id for existing in calls):
                    raise malformed(f"{where}.id", f"duplicate tool_use id {quoted(call.call_id)} in one assistant "
                                                   "turn")
                calls.append(call)
            elif kind == "image":
                raise malformed(f"{where}.type", "image blocks are not valid in assistant messages")
            else:
                raise _reject_block(kind, where)
        self.seen_assistant = True
        self.pending = {call.call_id: call.name for call in calls}
        return Message("assistant", tuple(parts), reasoning="".join(reasoning) if reasoning else None,
                       tool_calls=tuple(calls))

    def require_results(self, index: int) -> None:
        """Fail when an earlier tool_use turn is still waiting for its results."""
        if self.pending:
            where = f"messages.{index}"
            raise InvalidRequestError(
                f"{where}: tool_use ids {', '.join(self.pending)} of an earlier assistant turn have no tool_result; "
                "the next user turn must start with exactly one result per call",
                param=where, code=INVALID_TOOL_HISTORY)

    @staticmethod
    def _order(phase: int, kind_phase: int, where: str) -> None:
        if phase > kind_phase:
            what = "thinking" if kind_phase == 0 else "text"
            raise InvalidRequestError(
                f"{where}: {what} after {'text' if phase == 1 else 'tool_use'} in one assistant turn cannot be "
                "represented; an assistant turn renders as thinking, then text, then tool calls",
                param=where, code=INVALID_ASSISTANT_HISTORY)

    @staticmethod
    def _call(block: Mapping[str, Any], where: str) -> ToolCall:
        call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
        if not isinstance(call_id, str) or not call_id:
            raise malformed(f"{where}.id", "expected a non-empty tool_use id")
        if not isinstance(name, str) or not name:
            raise malformed(f"{where}.name", "expected a non-empty tool name")
        if not isinstance(arguments, dict):
            raise malformed(f"{where}.input", f"expected an object, got {type_name(arguments)}")
        return ToolCall(call_id, name, arguments)


def lower_history(body: Mapping[str, Any], plan: CachePlan, *, vision: bool) -> LoweredHistory:
    """The ordered messages of ``body`` (system first) and whether the final assistant message is a prefill."""
    lowering = HistoryLowering(plan, vision)
    system = _system_message(body.get("system"), plan)
    if system is not None:
        lowering.messages.append(system)
    turns = _turns(body.get("messages"))
    for position, turn in enumerate(turns):
        if turn.role == "system":
            parts = []
            for path, block in turn.blocks:
                if type_tag(block, dotted(path)) != "text":
                    raise malformed(f"{dotted(path)}.type", "system messages may only contain text blocks")
                parts.append(TextPart(_text(block, dotted(path)), path in plan.marked))
            lowering.messages.append(Message("system", tuple(parts)))
        elif turn.role == "user":
            lowering.user(turn)
        else:
            final = position == len(turns) - 1
            message = lowering.assistant(turn)
            if final:
                _check_prefill(turn, message)
            lowering.messages.append(message)
    if turns[-1].role != "assistant":
        lowering.require_results(turns[-1].first_index)
    return LoweredHistory(tuple(lowering.messages), prefill=turns[-1].role == "assistant")


def _check_prefill(turn: Turn, message: Message) -> None:
    """A final assistant message is continued: it must be text only."""
    problem = None
    if message.tool_calls:
        problem = "it contains tool_use blocks"
    elif message.reasoning is not None:
        problem = "it contains thinking blocks"
    if problem is not None:
        where = f"messages.{turn.first_index}"
        raise InvalidRequestError(f"{where}: a final assistant message is a prefill that generation continues, and "
                                  f"a prefill must be text only: {problem}", param=where, code="invalid_prompt")
