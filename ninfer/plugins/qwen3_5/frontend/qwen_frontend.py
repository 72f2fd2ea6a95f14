"""The Qwen frontend: a normalized Conversation -> prompt token ids, thinking/effort resolution, and the decoder.

Thinking and effort follow the Chat Completions rules (Responses and Anthropic reuse them): ``reasoning_effort``
"none" turns thinking off, another effort selects thinking at the nearest tier the loaded template exposes (a
template without tiers ignores it; ``--strict-effort`` rejects an unexposed value with
``reasoning_effort_not_supported``); ``enable_thinking`` must agree with the effort; omitted, thinking follows
``--no-thinking`` and the effort the template's declared default. Capabilities come from the artifact's own
``frontend/chat_template.jinja``, never from a model name. Conversation lowering lives in
:mod:`ninfer.plugins.qwen3_5.frontend.prompt`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import attrs

from ninfer.core.artifact.container import CHAT_TEMPLATE_RESOURCE
from ninfer.core.chat_template import EFFORT_VOCABULARY, ChatTemplate
from ninfer.core.conversation import Conversation, GenerationOptions, Message, TextPart
from ninfer.core.errors import ArtifactError, InvalidRequestError, NinferError, NotYetAvailableError
from ninfer.core.frontend import PreparedRequest, PromptCapabilities
from ninfer.core.request import BudgetClose, GenerationRequest
from ninfer.plugins.qwen3_5.frontend.frontiers import (
    continuation_frontiers,
    long_anchors,
    shared_prefix_frontier,
    token_frontier,
)
from ninfer.plugins.qwen3_5.frontend.output_parser import (
    THINK_CLOSE,
    TOOL_CALL_OPEN,
    OutputDecoderError,
    QwenOutputDecoder,
    thinking_budget_control_text,
)
from ninfer.plugins.qwen3_5.frontend.prompt import INVALID_PROMPT, lower, tool_specs
from ninfer.plugins.qwen3_5.frontend.prompt_tokens import EncodedPrompt, PromptEncoder
from ninfer.plugins.qwen3_5.frontend.sampling import sampling_presets

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.artifact.container import ModelSource
    from ninfer.core.config import ServeConfig
    from ninfer.core.tokenizer import Tokenizer

EFFORT_NONE = "none"
TURN_CLOSE = "<|im_end|>\n"


@attrs.frozen
class ThinkingMode:
    """A request's resolved thinking mode.

    ``requested_effort`` is the client's value (None when omitted); ``resolved_effort`` is "none" when thinking is
    off, the effective tier when the template is tiered, and None when thinking is on without tiers.
    """

    thinking: bool
    requested_effort: str | None
    resolved_effort: str | None


MAX_CACHE_BREAKPOINTS = 4
FRONTIER_PROBE = "\u2063ninfer-frontier-probe\u2063"  # never in a real prompt; cut away before tokenizing
USER_TURN_OPEN = "<|im_start|>user\n"


def _has_breakpoint(message: Message) -> bool:
    parts = (*message.parts, *(message.tool_result.parts if message.tool_result is not None else ()))
    return any(item.cache_breakpoint for item in (*parts, *message.tool_calls))


def _breakpoint_turns(conversation: Conversation) -> list[int]:
    """Indices of the turns whose end is a breakpoint frontier; -1 is the tools block's own system turn.

    Tool definitions render inside the leading system turn, so a marker on them maps to that turn's end: the
    tools-only turn (-1) when no system message leads, else the leading system message's turn (0).
    """
    messages = conversation.messages
    marked = [index for index, message in enumerate(messages) if _has_breakpoint(message)]
    if conversation.tools_cache_breakpoint and conversation.tools:
        marked.append(0 if messages and messages[0].role in ("system", "developer") else -1)
    return sorted(set(marked))


@attrs.frozen
class RenderedPrompt:
    """A conversation rendered to prompt text, with the modes it was rendered under."""

    text: str
    mode: ThinkingMode
    preserve_thinking: bool
    prefill: bool
    media_items: int


def effort_tier(effort: str, levels: tuple[str, ...]) -> str:
    """The template tier a client effort runs as: the weakest exposed tier at least as strong as the request, else
    the strongest (so an exposed tier is itself, ``minimal`` the weakest tier, ``high``/``max`` the strongest)."""
    rank = EFFORT_VOCABULARY.index(effort)
    stronger = [level for level in levels if EFFORT_VOCABULARY.index(level) >= rank]
    return stronger[0] if stronger else levels[-1]


def resolve_thinking(conversation: Conversation, capabilities: PromptCapabilities, *, default_thinking: bool,
                     strict_effort: bool = False) -> ThinkingMode:
    """Apply the reasoning_effort / enable_thinking rules (see the module docstring).

    An effort the template does not expose maps onto its tiers (:func:`effort_tier`); a template without tiers
    ignores it, so thinking follows the other fields. ``strict_effort`` (``--strict-effort``) rejects such an
    effort with ``reasoning_effort_not_supported`` instead. An effort that does not select thinking
    (``Conversation.effort_selects_thinking`` false) only picks the tier of thinking the other fields enable.
    """
    effort = conversation.reasoning_effort
    effort_thinking: bool | None = None
    tier: str | None = None
    levels = capabilities.effort_levels
    if effort is not None:
        if effort == EFFORT_NONE:
            effort_thinking = False
        elif effort in EFFORT_VOCABULARY:
            if effort not in levels and strict_effort:
                exposed = ", ".join((EFFORT_NONE, *levels))
                raise InvalidRequestError(
                    f"reasoning_effort {effort!r} is not supported by the loaded chat template (supported: {exposed})",
                    param="reasoning_effort", code="reasoning_effort_not_supported")
            if levels:
                tier = effort_tier(effort, levels)
                effort_thinking = True
        else:
            choices = ", ".join((EFFORT_NONE, *EFFORT_VOCABULARY))
            raise InvalidRequestError(f"reasoning_effort: {effort!r} is not one of {choices}",
                                      param="reasoning_effort")
        if not conversation.effort_selects_thinking:
            effort_thinking = None
    requested = conversation.enable_thinking
    if requested is not None and effort_thinking is not None and requested != effort_thinking:
        raise InvalidRequestError(
            f"enable_thinking={str(requested).lower()} contradicts reasoning_effort {effort!r}",
            param="enable_thinking", code="conflicting_template_option")
    if requested is not None:
        thinking = requested
    elif effort_thinking is not None:
        thinking = effort_thinking
    else:
        thinking = default_thinking
    if not thinking:
        resolved: str | None = EFFORT_NONE
    elif levels:
        resolved = tier if tier is not None else capabilities.default_effort
    else:
        resolved = None
    return ThinkingMode(thinking=thinking, requested_effort=effort, resolved_effort=resolved)


class QwenFrontend:
    """:class:`ninfer.core.frontend.Frontend` for Qwen3.5/3.6/3.8 chat templates.

    The template is compiled and its capabilities resolved at construction (a broken template fails at startup).
    Its sampling presets are the Qwen model cards' (:func:`sampling_presets`).
    """

    def __init__(self, artifact: ModelSource, config: ServeConfig, tokenizer: Tokenizer) -> None:
        self._config = config
        self._policy = config.request_policy
        self._tokenizer = tokenizer
        self._encoder = PromptEncoder(tokenizer)
        # a closed turn re-renders without its reasoning (and without the thinking-off prologue) unless history
        # keeps it: only a response that calls a tool, which the client answers within the same turn, is resent
        # as generated
        tool_call = tokenizer.token_to_id(TOOL_CALL_OPEN)
        self._tool_call_tokens = () if tool_call is None else (tool_call,)
        manifest = artifact.manifest
        self.template = ChatTemplate(artifact.resource_text(CHAT_TEMPLATE_RESOURCE),
                                     name=f"{artifact.path}:{CHAT_TEMPLATE_RESOURCE}")
        self.capabilities = PromptCapabilities(**attrs.asdict(self.template.capabilities))
        if not self.capabilities.supports_enable_thinking:
            raise ArtifactError(f"chat template {self.template.name} has no enable_thinking switch, which the "
                                "Qwen frontend needs to open or close the thinking block")
        self.stop_token_ids = manifest.eos_token_ids
        if not self.stop_token_ids:
            raise ArtifactError(f"{artifact.path}: the artifact declares no end-of-sequence token id")
        close_ids = tokenizer.encode(THINK_CLOSE)
        if len(close_ids) != 1:
            raise ArtifactError(f"{artifact.path}: the tokenizer has no single token for {THINK_CLOSE!r}")
        self.think_close_id = close_ids[0]
        self.budget_insert_ids = tuple(tokenizer.encode(thinking_budget_control_text()))
        presets = sampling_presets(manifest)
        self._presets = {True: presets["thinking"], False: presets["non_thinking"]}

    # -- the Frontend contract ----------------------------------------------------------------------------------

    def prepare(self, conversation: Conversation, options: GenerationOptions) -> PreparedRequest:
        """Render and tokenize ``conversation`` and resolve the request the engine executes."""
        rendered = self.render(conversation)
        encoded = self._encode(rendered)
        token_ids, starts, text = encoded.ids, encoded.starts, encoded.text
        self._policy.check_prompt(len(token_ids))
        output_budget = self._policy.output_budget(options.max_tokens, len(token_ids))
        preset = self._presets[rendered.mode.thinking]
        sampling = self._policy.sampling(preset, {
            **options.sampling_fields(),
            "stop_token_ids": self.stop_token_ids,
        })
        request = GenerationRequest(
            prompt_token_ids=token_ids,
            sampling=sampling,
            budget_close=self._budget_close(conversation, rendered.mode, output_budget),
            checkpoint_offsets=(
                *self._checkpoint_offsets(conversation, rendered, text, starts),
                *filter(None, (shared_prefix_frontier(text, starts),)),
            ),
            continuation_offsets=continuation_frontiers(text, starts),
            anchor_offsets=long_anchors(encoded.turns, len(token_ids)),
            endpoint_reuse_tokens=None if rendered.preserve_thinking else self._tool_call_tokens,
        )
        return PreparedRequest(
            request=request,
            output_budget=output_budget,
            thinking=rendered.mode.thinking,
            preserve_thinking=rendered.preserve_thinking,
            requested_effort=rendered.mode.requested_effort,
            resolved_effort=rendered.mode.resolved_effort,
            sampling_preset=preset,
            conversation=conversation,
        )

    def decoder(self, prepared: PreparedRequest) -> QwenOutputDecoder:
        """The output decoder of a prepared request: its callable tools, start channel and tolerance."""
        conversation = prepared.conversation
        if conversation is None:
            raise OutputDecoderError("a decoder needs the prepared prompt's conversation")
        prefill = conversation.continue_final_message
        return QwenOutputDecoder(tool_specs(conversation.callable_tools),
                                 starts_in_reasoning=prepared.thinking and not prefill,
                                 tolerant=self._config.tolerant_tool_calls, continues_content=prefill)

    def count_tokens(self, conversation: Conversation) -> int:
        """Prompt tokens of ``conversation`` (the prepare path without the generation limits)."""
        return len(self._tokenize(self.render(conversation)))

    # -- rendering ----------------------------------------------------------------------------------------------

    def render(self, conversation: Conversation) -> RenderedPrompt:
        """The prompt text of ``conversation`` and the modes it was rendered under."""
        mode = resolve_thinking(conversation, self.capabilities, default_thinking=not self._config.no_thinking,
                                strict_effort=self._config.strict_effort)
        preserve = (conversation.preserve_thinking if conversation.preserve_thinking is not None
                    else self._config.preserve_thinking)
        prefill = conversation.continue_final_message
        if prefill:
            self._check_prefill(conversation, mode)
        text, media_items = self._template_text(conversation, mode, preserve, generation_prompt=not prefill)
        if media_items and not self._config.vision:
            raise InvalidRequestError("image and video input needs a server started with --vision",
                                      param="messages", code="vision_disabled")
        if prefill:
            text = self._open_final_turn(text, conversation)
        return RenderedPrompt(text=text, mode=mode, preserve_thinking=preserve, prefill=prefill,
                              media_items=media_items)

    def _template_text(self, conversation: Conversation, mode: ThinkingMode, preserve: bool, *,
                       generation_prompt: bool) -> tuple[str, int]:
        """The template's text for ``conversation`` under ``mode`` and the number of media items it holds."""
        lowered = lower(conversation)
        options: dict[str, Any] = {"enable_thinking": mode.thinking, "preserve_thinking": preserve}
        if mode.thinking and self.capabilities.effort_levels and mode.resolved_effort is not None:
            options["reasoning_effort"] = mode.resolved_effort
        text = self.template.render(list(lowered.messages), tools=list(lowered.tools) or None,
                                    add_generation_prompt=generation_prompt, **options)
        return lowered.substitute_system_blocks(text), lowered.media_items

    # -- cache breakpoints --------------------------------------------------------------------------------------

    def _checkpoint_offsets(self, conversation: Conversation, rendered: RenderedPrompt, text: str,
                            starts: Sequence[int]) -> tuple[int, ...]:
        """Exact token frontiers after the turns that carry an explicit cache breakpoint (the latest four).

        A turn's frontier is where the next turn would open. The prefix is rendered with a probe user turn after
        it (so templates that need a user query still render) and cut at the probe. The probe is a real query only
        when a real user query follows in the conversation, and otherwise looks like a tool result, so the
        template's "last user query" (which decides where history keeps its reasoning) stays where it is. A
        frontier that is not an exact prefix of the prompt's (normalized) ``text`` or where no prompt token starts
        (``starts``) is ignored, as the spec allows; a turn opens with a special token, so the prompt's tokens up to
        a frontier are the prefix's own tokens and nothing is tokenized again.
        """
        messages = conversation.messages
        offsets: set[int] = set()
        for index in _breakpoint_turns(conversation)[-MAX_CACHE_BREAKPOINTS:]:
            query_follows = any(message.role == "user" for message in messages[index + 1 :])
            probe_text = FRONTIER_PROBE if query_follows else f"<tool_response>{FRONTIER_PROBE}</tool_response>"
            head = attrs.evolve(conversation, continue_final_message=False,
                                messages=(*messages[: index + 1], Message("user", (TextPart(probe_text),))))
            try:
                head_text, _ = self._template_text(head, rendered.mode, rendered.preserve_thinking,
                                                   generation_prompt=False)
            except NinferError:
                continue
            cut = head_text.rfind(USER_TURN_OPEN + probe_text)
            prefix = self._tokenizer.normalize(head_text[:cut]) if cut > 0 else ""
            frontier = token_frontier(starts, len(prefix)) if prefix and text.startswith(prefix) else None
            if frontier is not None and 0 < frontier < len(starts):
                offsets.add(frontier)
        return tuple(sorted(offsets))

    @staticmethod
    def _check_prefill(conversation: Conversation, mode: ThinkingMode) -> None:
        final = conversation.messages[-1] if conversation.messages else None
        if final is None or final.role != "assistant":
            problem = "the final message is not an assistant message"
        elif final.tool_calls or final.has_media:
            problem = "the final assistant message carries tool calls or media"
        elif mode.thinking:
            problem = "thinking is enabled"
        else:
            return
        raise InvalidRequestError(f"cannot continue the final assistant message: {problem}", param="messages",
                                  code=INVALID_PROMPT)

    @staticmethod
    def _open_final_turn(text: str, conversation: Conversation) -> str:
        """Drop the closing of the rendered final assistant turn so generation continues its text."""
        tail = conversation.messages[-1].text.strip() + TURN_CLOSE
        if not text.endswith(tail):
            raise InvalidRequestError("the chat template does not end the final assistant turn with its text, so it "
                                      "cannot be continued", param="messages", code=INVALID_PROMPT)
        return text[:-len(TURN_CLOSE)]

    def _tokenize(self, rendered: RenderedPrompt) -> tuple[int, ...]:
        self._refuse_media(rendered)
        return self._encoder.encode(rendered.text).ids

    def _encode(self, rendered: RenderedPrompt) -> EncodedPrompt:
        """The prompt's token ids, where each starts in the normalized text, that text and its turn openings (for
        its frontiers)."""
        self._refuse_media(rendered)
        return self._encoder.encode(rendered.text)

    @staticmethod
    def _refuse_media(rendered: RenderedPrompt) -> None:
        if rendered.media_items:
            raise NotYetAvailableError("image and video prompts are not yet available: media preprocessing and "
                                       "vision-token expansion have not been implemented")

    # -- thinking budget ----------------------------------------------------------------------------------------

    def _budget_close(self, conversation: Conversation, mode: ThinkingMode, output_budget: int) -> BudgetClose | None:
        """The thinking-budget policy of a thinking request (None without a budget or with thinking off)."""
        if not mode.thinking:
            return None
        budget = conversation.thinking_budget
        if budget is None:
            budget = self._config.default_thinking_budget
        if budget is None:
            return None
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise InvalidRequestError(f"thinking budget must be a positive integer, got {budget!r}",
                                      param="thinking_budget")
        policy = BudgetClose(limit=budget, close_token_id=self.think_close_id, insert_token_ids=self.budget_insert_ids)
        policy.check_capacity(output_budget)
        return policy
