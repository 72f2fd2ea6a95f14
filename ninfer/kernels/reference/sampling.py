"""Token sampling over a batch of logit rows: the one sampling rule, and the oracle of the Triton sampler.

Per row, with the row's own parameters: subtract the row's penalty (``logit - penalty``); temperature 0 takes the
argmax (the first index among equal maxima); otherwise keep the ``top_k`` (at most ``TOP_K_CAP``) largest penalized
logits sorted descending (``torch.topk``), divide them by the temperature, softmax, drop the candidates whose
preceding mass already reaches ``top_p`` (the first is always kept) and those below ``min_p`` times the top
probability, renormalize, and pick by inverse CDF: the first candidate whose float64 cumulative probability exceeds
``uniform * total``. One uniform in [0, 1) per row is given by the caller, so the draws stay on the host.

Every per-row parameter is a ``[R]`` tensor; any numeric dtype is accepted and converted here (temperature, top-p
and min-p to fp32, top-k to an integer, the uniform to float64).
"""

from __future__ import annotations

import torch

TOP_K_CAP = 20


def penalize(logits: torch.Tensor, penalty: torch.Tensor | None, penalty_rows: torch.Tensor | None) -> torch.Tensor:
    """``logits [R, V]`` as fp32 minus each row's penalty row.

    ``penalty`` is ``[P, W]`` (columns past ``W`` are not penalized); ``penalty_rows [R]`` gives each row's index
    into it, negative for no penalty. Without ``penalty_rows`` row ``i`` uses ``penalty[i]`` (then ``P == R``).
    """
    logits = logits.float()
    if penalty is None:
        return logits
    rows, width = logits.shape
    if penalty_rows is None:
        if penalty.shape[0] != rows:
            raise ValueError(f"penalty has {penalty.shape[0]} rows for {rows} logit rows and no penalty_rows")
        penalty_rows = torch.arange(rows, device=logits.device)
    index = penalty_rows.to(device=logits.device, dtype=torch.int64)
    columns = min(width, penalty.shape[1])
    gathered = penalty[index.clamp_min(0), :columns].float()
    gathered = gathered.masked_fill((index < 0)[:, None], 0.0)
    out = logits.clone()
    out[:, :columns] -= gathered
    return out


def candidate_distribution(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sampling distribution over its top candidates: ``(probs [R, K] fp32, ids [R, K] int64)``.

    ``logits [R, V]`` are already penalized; ``K = min(TOP_K_CAP, V)``. Candidates are sorted by descending logit;
    pruned ones have probability 0 and the rest sum to 1. A temperature of 0 is treated as 1 here; a ``top_k`` of
    0 (or above ``K``) means ``K``.
    """
    device = logits.device
    cap = min(TOP_K_CAP, logits.shape[1])
    values, ids = logits.float().topk(cap, dim=-1)
    temperature = temperature.to(device=device, dtype=torch.float32)
    values = values / torch.where(temperature > 0, temperature, 1.0)[:, None]
    keep = top_k.to(device=device, dtype=torch.int64)
    keep = torch.where((keep <= 0) | (keep > cap), cap, keep)
    positions = torch.arange(cap, device=device)
    values = values.masked_fill(positions[None, :] >= keep[:, None], float("-inf"))
    probs = torch.softmax(values, dim=-1)

    top_p = top_p.to(device=device, dtype=torch.float32)[:, None]
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p) & (top_p < 1.0)
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)

    min_p = min_p.to(device=device, dtype=torch.float32)[:, None]
    probs = probs.masked_fill(probs < probs[:, :1] * min_p, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True), ids


def inverse_cdf_positions(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row, the candidate position whose float64 CDF interval holds ``uniform * total`` (``[R]`` int64)."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = uniform.to(device=probs.device, dtype=torch.float64) * cdf[:, -1]
    picks = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    return picks.clamp_max(cdf.shape[1] - 1)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
    *,
    penalty: torch.Tensor | None = None,
    penalty_rows: torch.Tensor | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits [R, V]`` (``[R]`` int64 on the logits' device); ids at or above
    ``vocab_limit`` are never chosen. Rows with temperature 0 take the argmax and ignore their uniform."""
    _check_rows(logits, temperature, top_k, top_p, min_p, uniform)
    if vocab_limit is not None and vocab_limit < logits.shape[1]:
        logits = logits[:, :vocab_limit]
    logits = penalize(logits, penalty, penalty_rows)
    greedy_ids = logits.argmax(dim=-1)
    sampled = temperature.to(logits.device) > 0
    if not bool(sampled.any()):
        return greedy_ids
    probs, ids = candidate_distribution(logits, temperature, top_k, top_p, min_p)
    picks = inverse_cdf_positions(probs, uniform)
    sampled_ids = ids.gather(1, picks[:, None])[:, 0]
    return torch.where(sampled, sampled_ids, greedy_ids)


def greedy_rows(logits: torch.Tensor, vocab_limit: int | None = None) -> torch.Tensor:
    """The argmax id of each row of ``logits [R, V]`` below ``vocab_limit`` (the first among equal maxima): what
    :func:`sample_rows` picks when every row has temperature 0 and none is penalized."""
    _check_rows(logits)
    if vocab_limit is not None and vocab_limit < logits.shape[1]:
        logits = logits[:, : max(1, vocab_limit)]
    return logits.argmax(dim=-1)


def _check_rows(logits: torch.Tensor, *per_row: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [rows, vocab] with a non-empty vocabulary; got shape {tuple(logits.shape)}")
    for tensor in per_row:
        if tuple(tensor.shape) != (logits.shape[0],):
            raise ValueError(
                f"per-row sampling parameters must have shape ({logits.shape[0]},); got {tuple(tensor.shape)}"
            )
