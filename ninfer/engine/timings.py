"""Per-request timings and counters, and the llama.cpp-compatible ``timings`` object.

All instants are ``time.monotonic()`` seconds. Prompt time runs from the admission commit to the first
committed output token (or to the end of prompt processing when no token is produced); generation time
runs from the first to the last committed output token and has ``max(predicted_n - 1, 0)`` intervals.
Every rate whose count or duration is zero is reported as 0.0, never NaN or infinity.
"""

from __future__ import annotations

from typing import Any

import attrs


def _rate_pair(count: int, ms: float) -> tuple[float, float]:
    """``(ms per unit, units per second)``, both 0.0 unless count and duration are positive."""
    if count <= 0 or ms <= 0.0:
        return 0.0, 0.0
    return ms / count, count * 1000.0 / ms


@attrs.frozen
class HostExposure:
    """One request's engine exposure in seconds: every executor segment it took part in, charged in full.

    ``phases`` are the five host phases in ``engine_boundary, program_submit, program_post, engine_commit_output,
    engine_maintenance`` order; ``device_wait`` is the blocking device wait (not host time); ``decode_host`` and
    ``decode_device_wait`` are their decode-class subsets. Concurrent requests share segments, so exposures of
    different requests must not be added up.
    """

    phases: tuple[float, ...] = (0.0,) * 5
    device_wait: float = 0.0
    decode_host: float = 0.0
    decode_device_wait: float = 0.0

    @property
    def host_total(self) -> float:
        """Exactly the sum of ``phases``, added in order."""
        return sum(self.phases)


@attrs.frozen
class RequestTimings:
    """A snapshot of one request's timing marks and token counters."""

    submitted_at: float
    admitted_at: float | None = None
    prompt_done_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    cache_n: int = 0
    prompt_n: int = 0
    predicted_n: int = 0
    draft_n: int | None = None  # speculative: drafted tokens (terminal snapshot only, when drafting occurred)
    draft_n_accepted: int | None = None
    decode_rounds: int = 0  # decode (or speculative) rounds this request took part in
    prefill_units: int = 0  # prefill chunks computed for it
    control_units: int = 0  # control insertions committed without sampling (budget close)
    host_work: HostExposure | None = None  # engine exposure (terminal snapshot only)

    @property
    def queue_wait_s(self) -> float:
        """From reservation (before preparation) to the admission commit."""
        end = self.admitted_at if self.admitted_at is not None else self.finished_at
        return max(end - self.submitted_at, 0.0) if end is not None else 0.0

    @property
    def prompt_s(self) -> float:
        """From the admission commit to the first output token (or end of prompt processing)."""
        end = self.first_token_at if self.first_token_at is not None else self.prompt_done_at
        if self.admitted_at is None or end is None:
            return 0.0
        return max(end - self.admitted_at, 0.0)

    @property
    def decode_s(self) -> float:
        """From the first to the last committed output token."""
        if self.first_token_at is None or self.last_token_at is None:
            return 0.0
        return max(self.last_token_at - self.first_token_at, 0.0)

    @property
    def total_s(self) -> float:
        end = self.finished_at if self.finished_at is not None else self.last_token_at
        return max(end - self.submitted_at, 0.0) if end is not None else 0.0

    def timings_dict(self) -> dict[str, Any]:
        """The llama.cpp-compatible ``timings`` object."""
        prompt_ms = self.prompt_s * 1000.0
        predicted_ms = self.decode_s * 1000.0
        prompt_per_token_ms, prompt_per_second = _rate_pair(self.prompt_n, prompt_ms)
        intervals = max(self.predicted_n - 1, 0)
        predicted_per_token_ms, predicted_per_second = _rate_pair(intervals, predicted_ms)
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_per_token_ms,
            "prompt_per_second": prompt_per_second,
            "predicted_n": self.predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_per_token_ms,
            "predicted_per_second": predicted_per_second,
            **({} if self.draft_n is None else {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted}),
        }


@attrs.define
class SpeculativeCounters:
    """One request's speculative-decoding counters (the request log's ``speculative`` object).

    A round drafts tokens for the row and verifies them; a fallback step is a decode step of a speculating
    engine in which the row drafted nothing (drafter not ready, control tokens pending, output limit near).
    ``accepted_per_position[i]`` counts rounds whose draft ``i`` (0-based) was accepted.
    """

    backend: str
    draft_window: int
    rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    fallback_steps: int = 0
    accepted_per_position: list[int] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.draft_window

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "draft_window": self.draft_window,
            "rounds": self.rounds,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "fallback_steps": self.fallback_steps,
            "accepted_per_position": list(self.accepted_per_position),
        }
