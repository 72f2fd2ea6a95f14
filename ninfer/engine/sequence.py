"""The executor's record of one request: its tokens, memory, sampler, output text and timing marks."""

from __future__ import annotations

from typing import Any, Literal

import attrs
import torch

from ninfer.core.request import GenerationRequest, ReusePath
from ninfer.engine.admission import AdmissionTicket
from ninfer.engine.events import FinishReason, GenerationOutcome, Materialization, ReuseLimit, StopMatch
from ninfer.engine.handle import RequestHandle
from ninfer.engine.host_work import RequestHostWork
from ninfer.engine.sampler import RowSampler
from ninfer.engine.stops import OutputText
from ninfer.engine.timings import RequestTimings, SpeculativeCounters

SequencePhase = Literal["waiting", "prefilling", "decoding", "finished"]


@attrs.define(eq=False)
class Sequence:
    """Mutable per-request state, touched only by the executor thread after submit.

    ``tokens`` is prompt + committed output; the first ``fed`` of them have KV in ``pages`` and their
    recurrent state in ``slot``. ``promised_pages`` are pages of the admission reservation not yet
    allocated. ``last_logits`` are the next-token logits after ``tokens[last_logits_at - 1]``.
    """

    request_id: str
    request: GenerationRequest
    handle: RequestHandle
    ticket: AdmissionTicket
    sampler: RowSampler
    text: OutputText
    stop_token_ids: frozenset[int]
    max_output: int
    tokens: list[int]
    prompt_len: int
    phase: SequencePhase = "waiting"
    slot: int | None = None
    pages: list[int] = attrs.field(factory=list)
    promised_pages: int = 0
    fed: int = 0
    cache_n: int = 0
    reuse_path: ReusePath = "root"
    resumed_from: Any = None  # the checkpoint admission resumed from, until a longer one of this history is kept
    continuation: int | None = None  # the private continuation its checkpoints join (set at admission)
    reuse_limit: ReuseLimit | None = None  # why admission did not reuse more of the prompt
    materialization: Materialization | None = None  # admission's context-cache decision
    sampled: int = 0
    control: int = 0
    budget_open: bool = False
    last_logits: torch.Tensor | None = None
    last_logits_at: int = 0
    emitted: list[str] = attrs.field(factory=list)
    admitted_at: float | None = None
    prompt_done_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    speculative: SpeculativeCounters | None = None
    decode_rounds: int = 0
    prefill_units: int = 0
    control_units: int = 0
    host_work: RequestHostWork = attrs.field(factory=RequestHostWork)

    @property
    def reserved_tokens(self) -> int:
        """The admission entitlement: the whole prompt plus the effective output budget."""
        return self.prompt_len + self.max_output

    @property
    def output_count(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    def timings(self, finished_at: float | None = None) -> RequestTimings:
        drafted = self.speculative.drafted_tokens if self.speculative is not None else 0
        terminal_drafts = finished_at is not None and drafted > 0
        return RequestTimings(
            submitted_at=self.ticket.created_at,
            admitted_at=self.admitted_at,
            prompt_done_at=self.prompt_done_at,
            first_token_at=self.first_token_at,
            last_token_at=self.last_token_at,
            finished_at=finished_at,
            cache_n=self.cache_n,
            prompt_n=self.prompt_len - self.cache_n if self.admitted_at is not None else 0,
            predicted_n=self.output_count,
            draft_n=drafted if terminal_drafts else None,
            draft_n_accepted=self.speculative.accepted_tokens if terminal_drafts and self.speculative else None,
            decode_rounds=self.decode_rounds,
            prefill_units=self.prefill_units,
            control_units=self.control_units,
            host_work=self.host_work.exposure() if finished_at is not None else None,
        )

    def outcome(self, reason: FinishReason, stop: StopMatch | None, finished_at: float) -> GenerationOutcome:
        return GenerationOutcome(
            request_id=self.request_id,
            finish_reason=reason,
            stop=stop,
            prompt_tokens=self.prompt_len,
            output_token_ids=tuple(self.tokens[self.prompt_len :]),
            text="".join(self.emitted),
            cached_tokens=self.cache_n,
            reuse_path=self.reuse_path,
            reuse_limit=self.reuse_limit,
            materialization=self.materialization,
            control_tokens=self.control,
            seed=self.sampler.seed,
            sampling=self.sampler.params,
            timings=self.timings(finished_at),
            speculative=self.speculative,
        )
