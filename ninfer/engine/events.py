"""What comes back from the engine for one request: its events and its outcome."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ninfer.core.request import ReusePath, SamplingParams
from ninfer.engine.timings import RequestTimings, SpeculativeCounters

FinishReason = Literal["stop", "length", "cancelled"]


@attrs.frozen
class ReuseLimit:
    """Why a request did not reuse more of its prompt.

    ``reason``: ``disabled`` (prefix reuse off), ``no_checkpoint`` (nothing retained shares a token with the
    prompt), ``longest_available`` (no retained checkpoint shares more than what was reused), ``diverged`` (a
    retained checkpoint shares ``diverged_at`` tokens, more than were reused, then differs: the client re-rendered
    history differently, or the prompt ends inside it), ``capacity`` (the matching checkpoint could not be shared
    within the request's reservation, so it started at root).
    """

    reason: Literal["disabled", "no_checkpoint", "longest_available", "diverged", "capacity"]
    diverged_at: int | None = None


DegradationUnit = Literal["drop_replica", "demote_to_host", "drop_checkpoint"]
MaterializationStop = Literal["no_pressure", "queue_exhausted"]


@attrs.frozen
class Materialization:
    """The context-cache decision committed at a request's admission.

    ``predicted_immediate_ns``: the chosen source's host-to-device restore plus its suffix prefill, by the resolved
    context-cost coefficients; ``predicted_future_loss_ns``: the prefill the checkpoints dropped to make room would
    have saved (a demoted one costs its restore); ``evaluated_targets``: the candidates ranked (root included);
    ``projection_work``: checkpoints whose tokens were compared with the prompt; ``planning_ns``: wall time of the
    decision. Every candidate is ranked, so the search stops with ``queue_exhausted`` under pressure and
    ``no_pressure`` otherwise; it is never cut short (``budget_exhausted`` is False). ``degradation_units``: what
    making room did, mildest first. ``maximal_root_fallback``: a matching checkpoint could not be used within the
    request's reservation, so it started at root.
    """

    predicted_immediate_ns: int
    predicted_future_loss_ns: int
    evaluated_targets: int
    projection_work: int
    planning_ns: int
    stop_reason: MaterializationStop
    degradation_units: tuple[DegradationUnit, ...] = ()
    maximal_root_fallback: bool = False
    budget_exhausted: bool = False

    @property
    def predicted_total_ns(self) -> int:
        return self.predicted_immediate_ns + self.predicted_future_loss_ns


@attrs.frozen
class StopMatch:
    """Which stop ended a request: a stop token id or a stop string."""

    token_id: int | None = None
    string: str | None = None


@attrs.frozen
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@attrs.frozen
class GenerationOutcome:
    """The terminal result of a request.

    ``output_token_ids`` are every committed output token (sampled and control, including a stop token);
    ``text`` is everything emitted as text (stop strings and stop-token text withheld).
    """

    request_id: str
    finish_reason: FinishReason
    stop: StopMatch | None
    prompt_tokens: int
    output_token_ids: tuple[int, ...]
    text: str
    cached_tokens: int
    control_tokens: int
    seed: int | None
    sampling: SamplingParams
    timings: RequestTimings
    speculative: SpeculativeCounters | None = None  # with --spec: the request's drafting counters
    reuse_path: ReusePath = "root"  # which kind of checkpoint the prompt resumed from
    reuse_limit: ReuseLimit | None = None  # why it did not reuse more (None: never admitted)
    materialization: Materialization | None = None  # the admission's context-cache decision (None: never admitted)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def usage(self) -> Usage:
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


@attrs.frozen
class TokensEvent:
    """Newly committed output tokens and the text they released.

    ``control`` marks tokens the engine inserted without sampling (budget close). ``text`` may be empty
    while bytes or a possible stop string are held back, and may carry text held back from earlier tokens.
    ``time`` is the monotonic commit time; ``timings`` the cumulative snapshot at this commit.
    """

    token_ids: tuple[int, ...]
    text: str
    control: bool
    completion_tokens: int
    time: float
    timings: RequestTimings


@attrs.frozen
class AdmittedEvent:
    """The admission commit: the request holds a lane and its exact reused prefix is decided.

    Always the first event of an admitted request; ``cached_tokens`` of ``prompt_tokens`` come from a
    prefix checkpoint (the Anthropic ``message_start`` usage split is exact from here on).
    """

    prompt_tokens: int
    cached_tokens: int
    time: float


@attrs.frozen
class ProgressEvent:
    """Prompt-processing progress (llama.cpp ``prompt_progress``): cumulative, never moving backwards."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "cache": self.cache, "processed": self.processed, "time_ms": round(self.time_ms)}


@attrs.frozen
class FinishEvent:
    """The last event of a successful request."""

    outcome: GenerationOutcome


EngineEvent = AdmittedEvent | TokensEvent | ProgressEvent | FinishEvent
