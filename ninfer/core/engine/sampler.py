"""Batched token sampling and the sampling-precedence rule.

Per row: presence/frequency penalties over the request's output tokens (OpenAI semantics:
``logit -= presence * (count > 0) + frequency * count``), then temperature 0 takes the argmax; otherwise
logits are divided by the temperature, cut to the top-k (always at most 20) candidates, softmaxed,
cut by top-p (smallest prefix whose mass reaches p) and min-p (``p < min_p * p_max``), renormalized and
sampled with the request's own generator. One uniform draw per sampled token from a per-request
generator makes a seeded request reproduce regardless of what it is batched with.
"""

from __future__ import annotations

import secrets
from typing import Any, Mapping, Sequence

import torch

from ninfer.core.descriptors import SamplingPreset
from ninfer.core.engine.request import INT64_MIN, TOP_K_CAP, SamplingParams

SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")
_UINT64_MASK = 2**64 - 1


def resolve_sampling(
    preset: SamplingPreset | None,
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


def fresh_seed() -> int:
    """A random signed 64-bit seed."""
    return secrets.randbits(64) + INT64_MIN


class RowSampler:
    """One request's sampler state: resolved parameters, its generator and output-token penalties."""

    def __init__(self, params: SamplingParams, seed: int, vocab_size: int, device: torch.device) -> None:
        self.params = params
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed & _UINT64_MASK)
        self.counts: dict[int, int] = {}
        self._penalty: torch.Tensor | None = None
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self._penalty = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0

    @property
    def penalty(self) -> torch.Tensor | None:
        """``presence * (count > 0) + frequency * count`` per vocabulary id, or None without penalties."""
        return self._penalty

    def observe(self, token_id: int) -> None:
        """Record an output token (sampled or inserted) for the penalties."""
        count = self.counts.get(token_id, 0) + 1
        self.counts[token_id] = count
        if self._penalty is not None and token_id < self._penalty.shape[0]:
            self._penalty[token_id] = self.params.presence_penalty + self.params.frequency_penalty * count


def penalized_logits(logits: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
    """``logits`` (``[R, V]``) minus each row's penalty; returns the input itself when no row penalizes."""
    penalized = [index for index, row in enumerate(rows) if row.penalty is not None]
    if not penalized:
        return logits
    out = logits.clone()
    width = out.shape[1]
    for index in penalized:
        penalty = rows[index].penalty
        assert penalty is not None
        out[index] -= penalty[:width]
    return out


def candidate_distribution(logits: torch.Tensor, rows: Sequence[RowSampler]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling distribution of each row over its top candidates: ``(probs [R, K], ids [R, K])``.

    ``logits`` are already penalized. Candidates are sorted by descending logit; pruned ones have
    probability 0 and the rest sum to 1. Greedy rows are treated as temperature 1 here.
    """
    device = logits.device
    params = [row.params for row in rows]
    temperatures = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
    cap = min(TOP_K_CAP, logits.shape[1])
    values, ids = (logits.float() / temperatures[:, None]).topk(cap, dim=-1)
    positions = torch.arange(cap, device=device)
    top_k = torch.tensor([min(p.effective_top_k, cap) for p in params], device=device)
    values = values.masked_fill(positions[None, :] >= top_k[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)

    top_p = torch.tensor([p.top_p for p in params], device=device)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)

    min_p = torch.tensor([p.min_p for p in params], device=device)
    probs = probs.masked_fill(probs < probs[:, :1] * min_p[:, None], 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), ids


def sample_tokens(logits: torch.Tensor, rows: Sequence[RowSampler], vocab_limit: int | None = None) -> list[int]:
    """Pick one token per row of ``logits`` (``[R, V]`` fp32); ids at or above ``vocab_limit`` are never chosen."""
    if vocab_limit is not None and vocab_limit < logits.shape[1]:
        logits = logits[:, :vocab_limit]
    logits = penalized_logits(logits, rows)
    chosen = [0] * len(rows)
    greedy_rows = [index for index, row in enumerate(rows) if row.greedy]
    sampled_rows = [index for index, row in enumerate(rows) if not row.greedy]
    if greedy_rows:
        picks = logits[greedy_rows].argmax(dim=-1).tolist()
        for index, token in zip(greedy_rows, picks):
            chosen[index] = int(token)
    if sampled_rows:
        probs, ids = candidate_distribution(logits[sampled_rows], [rows[i] for i in sampled_rows])
        probs = probs.to("cpu", torch.float64)
        ids = ids.to("cpu")
        for position, index in enumerate(sampled_rows):
            cdf = probs[position].cumsum(dim=0)
            draw = torch.rand((), generator=rows[index].generator, dtype=torch.float64)
            pick = int(torch.searchsorted(cdf, draw * cdf[-1], right=True))
            chosen[index] = int(ids[position, min(pick, cdf.shape[0] - 1)])
    return chosen

