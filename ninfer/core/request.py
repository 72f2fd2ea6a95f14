"""The request the engine executes: prompt token ids, resolved sampling, output and thinking budgets.

A frontend's ``prepare`` resolves it once through :class:`RequestPolicy` (the serve-wide defaults and ceilings)
and the engine checks its invariants. ``max_tokens`` None means the server default; the effective output budget is
always :meth:`RequestPolicy.output_budget`, and a direct engine user (the offline ``LLM`` API, benchmarks) gets the
same policy applied by the engine.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence, get_args

import attrs

from ninfer.core.errors import CapacityError, InvalidRequestError

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.descriptors import SamplingPreset

#: How a request's prompt was reused (the request log's ``prefix_reuse_path``); ``root``: computed from token 0.
ReusePath = Literal[
    "root", "private_endpoint", "private_turn_closure", "private_response_replay", "private_long_anchor",
    "shared_stable_prefix",
]
REUSE_PATHS: tuple[str, ...] = get_args(ReusePath)
#: The error code of an output budget that cannot close a thinking budget.
THINKING_BUDGET_CODE = "thinking_budget_capacity_insufficient"
SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
#: top_k is always capped at this many candidates; a requested top_k of 0 selects the cap.
TOP_K_CAP = 20
MAX_STOP_STRINGS = 4
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: Longest accepted session key: room for a 32-byte hash in hex.
MAX_SESSION_KEY_CHARS = 64
_SESSION_KEY = re.compile(rf"[A-Za-z0-9_-]{{1,{MAX_SESSION_KEY_CHARS}}}")


def _invalid(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


def _check_range(param: str, value: float, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _invalid(param, f"expected a finite number, got {value!r}")
    if not low <= value <= high:
        raise _invalid(param, f"{value!r} is out of range [{low}, {high}]")


def _int_tuple(values: Sequence[int] | None) -> tuple[int, ...]:
    return tuple(values) if values is not None else ()


def _str_tuple(values: str | Sequence[str] | None) -> tuple[str, ...]:
    if values is None:
        return ()
    if isinstance(values, str):
        return (values,)
    return tuple(values)


@attrs.frozen
class SamplingParams:
    """Sampler settings plus output limits of one request.

    ``temperature`` 0 is greedy argmax. ``top_k`` 0 selects the top-20 cap (top_k is always capped at 20).
    ``seed`` None draws a fresh random seed at submit. ``max_tokens`` None uses the engine's default.
    ``stop`` holds up to four stop strings; ``stop_token_ids`` adds to the model's end-of-sequence ids
    unless ``ignore_eos`` drops those.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    ignore_eos: bool = False

    def __attrs_post_init__(self) -> None:
        _check_range("temperature", self.temperature, 0.0, 2.0)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k <= TOP_K_CAP:
            raise _invalid("top_k", f"expected an integer in 0..{TOP_K_CAP} (0 selects the top-{TOP_K_CAP} cap), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX
        ):
            raise _invalid("seed", f"expected a signed 64-bit integer, got {self.seed!r}")
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 0
        ):
            raise _invalid("max_tokens", f"expected a non-negative integer, got {self.max_tokens!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise _invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(self.stop)}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise _invalid("stop", f"stop strings must be non-empty strings, got {text!r}")
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise _invalid("stop_token_ids", f"expected non-negative token ids, got {token_id!r}")

    @property
    def effective_top_k(self) -> int:
        return TOP_K_CAP if self.top_k == 0 else min(self.top_k, TOP_K_CAP)


@attrs.frozen
class BudgetClose:
    """A budget-close policy: after ``limit`` generated tokens without ``close_token_id``, commit
    ``insert_token_ids`` (fed through the model like generated tokens, never sampled) and continue.

    The thinking budget is this policy with Qwen's early-close guidance ending in ``</think>``.
    """

    limit: int
    close_token_id: int
    insert_token_ids: tuple[int, ...] = attrs.field(converter=tuple)

    def __attrs_post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise _invalid("budget_close.limit", f"expected a positive integer, got {self.limit!r}")
        if not self.insert_token_ids:
            raise _invalid("budget_close.insert_token_ids", "the control insert must contain at least one token")

    def check_capacity(self, output_budget: int) -> None:
        """An output budget that passes the limit must also fit the insert plus one more generated token."""
        needed = self.limit + len(self.insert_token_ids) + 1
        if self.limit < output_budget < needed:
            raise InvalidRequestError(
                f"the output budget of {output_budget} tokens extends past the thinking budget of {self.limit} "
                f"tokens but cannot fit the {len(self.insert_token_ids)}-token close sequence plus one more token "
                f"(needs at least {needed}); raise the output limit or lower the thinking budget",
                param="max_tokens",
                code=THINKING_BUDGET_CODE,
            )


@attrs.frozen
class SessionKey:
    """An engine-local reuse session (e.g. a stored Responses chain) the request belongs to.

    A finished request whose session ``may_replace_endpoint`` leaves its checkpoint as the session's *endpoint*,
    which prefix-cache pressure evicts only after every anonymous checkpoint; a request that may not replace it
    (a store:false child) reads checkpoints normally and leaves an anonymous one. ``key`` is a bounded token
    (at most 64 ASCII letters, digits, ``-`` or ``_``), never a prefix identity: lookup stays by exact tokens.
    """

    key: str
    may_replace_endpoint: bool = True

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.key, str) or not _SESSION_KEY.fullmatch(self.key):
            raise _invalid(
                "session.key",
                f"expected 1..{MAX_SESSION_KEY_CHARS} ASCII letters, digits, '-' or '_', got {self.key!r:.80}",
            )
        if not isinstance(self.may_replace_endpoint, bool):
            raise _invalid("session.may_replace_endpoint", f"expected a boolean, got {self.may_replace_endpoint!r}")


def _check_session(_instance: Any, _attribute: Any, value: Any) -> None:
    if value is not None and not isinstance(value, SessionKey):
        raise _invalid("session", f"expected a SessionKey or None, got {type(value).__name__}")


def _frontiers(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(set(values)))


@attrs.frozen
class GenerationRequest:
    """One generation: prompt token ids, sampling, an optional budget-close policy.

    ``report_progress`` publishes :class:`ProgressEvent` after admission and after every prefill chunk.
    ``checkpoint_offsets`` are prompt frontiers (token counts) where prefill stops a chunk and captures a reusable
    checkpoint (explicit cache breakpoints); ``continuation_offsets`` are the same for the frontiers where the
    conversation's next request stops sharing this prompt (before the response's prologue, before the open turn);
    ``anchor_offsets`` are long-context recovery points further back. ``endpoint_reuse_tokens`` says when the
    finished request's endpoint is worth keeping: None, always (its output re-renders token-exactly in the next
    prompt); a tuple, only when the output contains one of these tokens (e.g. a tool call, after which the client
    continues the same turn): otherwise the endpoint is kept as the first checkpoint to evict.
    Frontiers outside the computed part of the prompt, or at its end, are ignored. ``session`` marks the request
    as part of an engine-local reuse session (see :class:`SessionKey`).
    """

    prompt_token_ids: tuple[int, ...] = attrs.field(converter=tuple)
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    budget_close: BudgetClose | None = None
    report_progress: bool = False
    request_id: str | None = None
    checkpoint_offsets: tuple[int, ...] = attrs.field(default=(), converter=_frontiers)
    session: SessionKey | None = attrs.field(default=None, validator=_check_session)
    continuation_offsets: tuple[int, ...] = attrs.field(default=(), converter=_frontiers)
    anchor_offsets: tuple[int, ...] = attrs.field(default=(), converter=_frontiers)
    endpoint_reuse_tokens: tuple[int, ...] | None = None

    @property
    def frontiers(self) -> tuple[int, ...]:
        """Every requested checkpoint frontier, in order."""
        return _frontiers((*self.checkpoint_offsets, *self.continuation_offsets, *self.anchor_offsets))

    def frontier_path(self, offset: int) -> ReusePath:
        """The reuse path a checkpoint at frontier ``offset`` serves: an explicit breakpoint is a shared prefix, an
        anchor a long anchor; of the continuation frontiers the last is the response's prologue, any earlier one
        the open turn."""
        if offset in self.checkpoint_offsets:
            return "shared_stable_prefix"
        if offset in self.anchor_offsets:
            return "private_long_anchor"
        if self.continuation_offsets and offset == self.continuation_offsets[-1]:
            return "private_response_replay"
        return "private_turn_closure"


def resolve_sampling(
    preset: "SamplingPreset | None",
    process_overrides: Mapping[str, Any],
    request_fields: Mapping[str, Any],
    greedy: bool = False,
) -> SamplingParams:
    """Family preset for the thinking mode, then process flags, then request fields; ``greedy`` forces T=0.

    ``None`` values mean "unset" at every level. ``process_overrides`` may carry ``seed`` (the process
    seed used when a request omits one); ``request_fields`` may carry any :class:`SamplingParams` field.
    """
    values: dict[str, Any] = {}
    if preset is not None:
        values.update({name: getattr(preset, name) for name in SAMPLER_FIELDS})
    for layer in (process_overrides, request_fields):
        values.update({name: value for name, value in layer.items() if value is not None})
    if greedy:
        values["temperature"] = 0.0
    return SamplingParams(**values)


@attrs.frozen
class RequestPolicy:
    """The serve-wide rules that complete a client's request into the one the engine executes.

    ``default_max_tokens`` is the output limit of a request that names none; ``max_context`` caps prompt plus
    output; ``sampling_overrides`` are the process's sampler flags (and ``seed``); ``greedy`` forces
    temperature 0. Each rule is decided here only: the frontend applies them when it prepares a request, the
    engine when a direct caller submits one without them.
    """

    max_context: int
    default_max_tokens: int
    sampling_overrides: Mapping[str, Any] = attrs.field(factory=dict)
    greedy: bool = False

    def sampling(self, preset: "SamplingPreset | None", request_fields: Mapping[str, Any]) -> SamplingParams:
        """Family preset -> process overrides -> request fields -> ``greedy``."""
        return resolve_sampling(preset, self.sampling_overrides, request_fields, self.greedy)

    def complete(self, params: SamplingParams) -> SamplingParams:
        """``params`` under ``greedy`` (idempotent: a request the policy resolved passes unchanged)."""
        return attrs.evolve(params, temperature=0.0) if self.greedy and params.temperature != 0.0 else params

    def max_tokens(self, requested: int | None) -> int:
        """The output limit a request asked for, or the default when it named none."""
        return requested if requested is not None else self.default_max_tokens

    def output_budget(self, max_tokens: int | None, prompt_tokens: int) -> int:
        """The effective output limit: the request's (or the default) ``max_tokens``, capped by the context."""
        return max(min(self.max_tokens(max_tokens), self.max_context - prompt_tokens), 0)

    def check_prompt(self, prompt_tokens: int) -> None:
        """A prompt longer than the context ceiling can never run."""
        if prompt_tokens > self.max_context:
            raise CapacityError(
                f"the prompt has {prompt_tokens} tokens, more than the context ceiling of {self.max_context} tokens "
                "(--max-context)",
                param="messages",
            )
