"""Batched token sampling.

Per row: presence/frequency penalties over the request's output tokens (OpenAI semantics:
``logit -= presence * (count > 0) + frequency * count``), then temperature 0 takes the argmax; otherwise
logits are cut to the top-k (always at most 20) candidates, divided by the temperature, softmaxed,
cut by top-p (smallest prefix whose mass reaches p) and min-p (``p < min_p * p_max``), renormalized and
sampled with the request's own generator. One uniform draw per sampled token from a per-request
generator makes a seeded request reproduce regardless of what it is batched with.

The rule itself lives in ``ninfer.kernels.reference.sampling`` (vectorised over rows); this module turns the rows'
``RowSampler`` state into its per-row tensors and routes CUDA logits to the Triton twin of that rule (a batch of
greedy rows without penalties to a plain argmax, which needs no per-row tensors).
"""

from __future__ import annotations

import array
import functools
import secrets
from typing import Callable, Sequence

import torch

from ninfer.core.request import INT64_MIN, SamplingParams
from ninfer.kernels.reference import sampling
from ninfer.kernels.transfer import to_device
from ninfer.kernels.triton import triton_available

_UINT64_MASK = 2**64 - 1
_TEMPERATURE, _TOP_K, _TOP_P, _MIN_P, _UNIFORM, _PENALTY_ROW = range(6)


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
    penalty = stacked_penalties(rows)
    if penalty is None:
        return logits
    table = parameter_table(rows, draw=False).to(logits.device)
    return sampling.penalize(logits, penalty, table[_PENALTY_ROW])


def candidate_distribution(logits: torch.Tensor, rows: Sequence[RowSampler]) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampling distribution of each row over its top candidates: ``(probs [R, K], ids [R, K])``.

    ``logits`` are already penalized. Candidates are sorted by descending logit; pruned ones have
    probability 0 and the rest sum to 1. Greedy rows are treated as temperature 1 here.
    """
    table = parameter_table(rows, draw=False).to(logits.device)
    return sampling.candidate_distribution(logits, table[_TEMPERATURE], table[_TOP_K], table[_TOP_P], table[_MIN_P])


def sample_tokens(logits: torch.Tensor, rows: Sequence[RowSampler], vocab_limit: int | None = None) -> list[int]:
    """Pick one token per row of ``logits`` (``[R, V]`` fp32); ids at or above ``vocab_limit`` are never chosen.

    Each sampled (non-greedy) row draws one uniform from its own generator, greedy rows draw none. The rows'
    parameters and uniforms reach the logits' device in one small copy; CUDA logits are sampled by the Triton
    kernel when triton is available (the chosen ids are the only transfer back), anything else by the torch rule.
    """
    return sample_token_ids(logits, rows, vocab_limit).tolist()


def sample_token_ids(
    logits: torch.Tensor,
    rows: Sequence[RowSampler],
    vocab_limit: int | None = None,
    greedy_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`sample_tokens` as int64 ids ``[R]`` on the logits' device (no transfer back, no host sync);
    ``greedy_ids``: the argmax of ``logits`` below ``vocab_limit`` that the forward took with them
    (``ForwardOutput.greedy_ids``), what rows that are all :func:`plain_greedy` sample."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits must be [rows, vocab] with one row per sampler; got {tuple(logits.shape)} for {len(rows)} rows"
        )
    if plain_greedy(rows):  # no parameters to copy, a plain argmax
        return greedy_ids if greedy_ids is not None else greedy_token_ids(logits, vocab_limit)
    penalty = stacked_penalties(rows)
    table = to_device(parameter_table(rows, draw=True), logits.device)
    return _row_sampler(logits.device.type)(
        logits,
        table[_TEMPERATURE],
        table[_TOP_K],
        table[_TOP_P],
        table[_MIN_P],
        table[_UNIFORM],
        penalty=penalty,
        penalty_rows=None if penalty is None else table[_PENALTY_ROW],
        vocab_limit=vocab_limit,
    )


def plain_greedy(rows: Sequence[RowSampler]) -> bool:
    """Whether every row samples greedily without penalties: a plain argmax (``ForwardBatch.greedy_below``)."""
    return all(row.greedy and row.penalty is None for row in rows)


def greedy_token_ids(logits: torch.Tensor, vocab_limit: int | None = None) -> torch.Tensor:
    """The argmax id of each row of ``logits`` below ``vocab_limit`` as int64 ``[R]`` on the logits' device (the
    Triton kernel for CUDA logits when triton is available): what greedy rows without penalties sample."""
    return _greedy_sampler(logits.device.type)(logits, vocab_limit)


def parameter_table(rows: Sequence[RowSampler], draw: bool) -> torch.Tensor:
    """The rows' per-row sampling inputs as one float64 ``[6, R]`` host tensor.

    Rows: temperature, effective top-k, top-p, min-p, the uniform (one draw from each non-greedy row's
    generator when ``draw``, else 0) and the row's index into :func:`stacked_penalties` (-1: no penalty).
    """
    temperature, top_k, top_p, min_p, uniform, penalty_row = [], [], [], [], [], []
    penalized = 0
    for row in rows:
        params = row.params
        temperature.append(params.temperature)
        top_k.append(params.effective_top_k)
        top_p.append(params.top_p)
        min_p.append(params.min_p)
        draws = draw and not row.greedy
        uniform.append(float(torch.rand((), generator=row.generator, dtype=torch.float64)) if draws else 0.0)
        penalty_row.append(penalized if row.penalty is not None else -1)
        penalized += row.penalty is not None
    if not rows:
        return torch.zeros((6, 0), dtype=torch.float64)
    values = array.array("d", [*temperature, *top_k, *top_p, *min_p, *uniform, *penalty_row])
    return torch.frombuffer(values, dtype=torch.float64).view(6, len(rows))


def stacked_penalties(rows: Sequence[RowSampler]) -> torch.Tensor | None:
    """The penalizing rows' penalties stacked ``[P, V]`` in row order, or None when no row penalizes."""
    penalties = [row.penalty for row in rows if row.penalty is not None]
    return torch.stack(penalties) if penalties else None


@functools.cache
def _greedy_sampler(device_type: str) -> Callable[..., torch.Tensor]:
    """The Triton argmax for CUDA logits when triton is available, otherwise the torch one (resolved once)."""
    if device_type == "cuda" and triton_available(device_type):
        from ninfer.kernels.triton.sampling import greedy_rows

        return greedy_rows
    return sampling.greedy_rows


@functools.cache
def _row_sampler(device_type: str) -> Callable[..., torch.Tensor]:
    """The Triton sampler for CUDA logits when triton is available, otherwise the torch rule (resolved once)."""
    if device_type == "cuda" and triton_available(device_type):
        from ninfer.kernels.triton.sampling import sample_rows

        return sample_rows
    return sampling.sample_rows
