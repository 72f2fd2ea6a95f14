"""Committing output tokens to a sequence: limits, stop tokens, stop strings, budget-close insertion, events.

Checks run in this order for every sampled token: stop token id, stop string, output/context limit, then
the budget-close policy (so a natural stop or limit always wins over the control insert).
"""

from __future__ import annotations

from typing import Sequence as Seq

import attrs

from ninfer.engine.events import FinishReason, StopMatch, TokensEvent
from ninfer.engine.host_work import HostPhase, HostWorkClock, WorkClass
from ninfer.engine.sequence import Sequence


@attrs.frozen
class Finish:
    """Why a sequence ends."""

    reason: FinishReason
    stop: StopMatch | None = None


def commit_sampled(seq: Sequence, token: int, now: float) -> Finish | None:
    """Append a sampled token, publish its event, and return how the sequence finishes (None: it continues)."""
    _append(seq, token, now)
    seq.sampled += 1
    if token in seq.stop_token_ids:
        _publish(seq, (token,), seq.text.flush(), control=False, now=now)
        return Finish("stop", StopMatch(token_id=token))
    text = seq.text.push(token)
    if seq.text.matched_stop is not None:
        _publish(seq, (token,), text, control=False, now=now)
        return Finish("stop", StopMatch(string=seq.text.matched_stop))
    if seq.output_count >= seq.max_output:
        _publish(seq, (token,), text + seq.text.flush(), control=False, now=now)
        return Finish("length")
    _publish(seq, (token,), text, control=False, now=now)
    policy = seq.request.budget_close
    if policy is None or not seq.budget_open:
        return None
    if token == policy.close_token_id:
        seq.budget_open = False
        return None
    if seq.sampled >= policy.limit:
        seq.budget_open = False
        return commit_control(seq, policy.insert_token_ids, now)
    return None


def commit_timed(clock: HostWorkClock, seq: Sequence, token: int, now: float, work_class: int) -> Finish | None:
    """:func:`commit_sampled` timed in ``engine_commit_output`` of ``work_class``, or of the control class when the
    commit triggered a control insert."""
    clock.switch(HostPhase.ENGINE_COMMIT_OUTPUT, work_class)
    control_units = seq.control_units
    finish = commit_sampled(seq, token, now)
    if seq.control_units != control_units:
        clock.reclassify(WorkClass.CONTROL)
    return finish


def commit_control(seq: Sequence, tokens: Seq[int], now: float) -> Finish | None:
    """Append engine-inserted control tokens (never sampled) and publish them flagged as control."""
    seq.control_units += 1
    text = []
    for token in tokens:
        _append(seq, token, now)
        seq.control += 1
        text.append(seq.text.push(token))
    joined = "".join(text)
    if seq.text.matched_stop is not None:
        _publish(seq, tuple(tokens), joined, control=True, now=now)
        return Finish("stop", StopMatch(string=seq.text.matched_stop))
    if seq.output_count >= seq.max_output:
        _publish(seq, tuple(tokens), joined + seq.text.flush(), control=True, now=now)
        return Finish("length")
    _publish(seq, tuple(tokens), joined, control=True, now=now)
    return None


def _append(seq: Sequence, token: int, now: float) -> None:
    seq.tokens.append(token)
    seq.sampler.observe(token)
    if seq.first_token_at is None:
        seq.first_token_at = now
    seq.last_token_at = now


def _publish(seq: Sequence, tokens: tuple[int, ...], text: str, *, control: bool, now: float) -> None:
    if text:
        seq.emitted.append(text)
    seq.handle.publish(TokensEvent(tokens, text, control, seq.output_count, now, seq.timings()))
