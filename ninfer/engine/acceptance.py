"""Lossless acceptance of one drafted token against the target distribution (pure functions).

The target distribution at a verify position is the one the plain sampler would draw from there: either a
greedy argmax, or the processed candidate distribution ``(probs, ids)`` (penalties, temperature, top-k/p,
min-p applied). Rules:

* greedy: the draft is accepted iff it equals the target argmax; otherwise the argmax is committed.
* one-hot proposal at T>0 (the drafter proposed one token deterministically): draw ``y ~ p`` with one
  uniform, exactly as the plain sampler does, and accept iff ``y`` equals the draft; otherwise ``y`` is the
  replacement. This is rejection sampling with ``q = onehot(draft)``: ``P(accept) = p(draft)`` and the
  rejected draw is distributed as ``norm(max(0, p - q))``. It also consumes one draw per committed token,
  like the plain sampler, so a seeded request reproduces the non-speculative output.
* proposal distribution ``q`` at T>0: accept with probability ``min(1, p(x)/q(x))``; on rejection draw the
  replacement from ``norm(max(0, p - q))`` (Leviathan et al. 2023; Chen et al. 2023).
"""

from __future__ import annotations

import attrs
import torch

from ninfer.core.drafting import Proposal


@attrs.frozen
class TargetDistribution:
    """``argmax`` for a greedy row; otherwise ``probs`` (float64, sums to 1) over candidate ``ids``."""

    argmax: int | None = None
    probs: torch.Tensor | None = None
    ids: torch.Tensor | None = None

    @property
    def greedy(self) -> bool:
        return self.argmax is not None


@attrs.frozen
class Verdict:
    """The token to commit at a verify position and whether it is the accepted draft."""

    token: int
    accepted: bool


def inverse_cdf(probs: torch.Tensor, ids: torch.Tensor, uniform: torch.Tensor | float) -> int:
    """The id whose CDF interval holds ``uniform`` (the plain sampler's rule, bit for bit)."""
    cdf = probs.cumsum(dim=0)
    pick = int(torch.searchsorted(cdf, uniform * cdf[-1], right=True))
    return int(ids[min(pick, cdf.shape[0] - 1)])


def draw_uniform(generator: torch.Generator) -> torch.Tensor:
    """One uniform in [0, 1), float64, from the request's own generator (as the plain sampler draws)."""
    return torch.rand((), generator=generator, dtype=torch.float64)


def sample_target(target: TargetDistribution, generator: torch.Generator) -> int:
    """The token the plain sampler picks from ``target`` (the bonus token after a fully accepted run)."""
    if target.greedy:
        assert target.argmax is not None
        return target.argmax
    assert target.probs is not None and target.ids is not None
    return inverse_cdf(target.probs, target.ids, draw_uniform(generator))


def accept_greedy(target: TargetDistribution, draft: int) -> Verdict:
    assert target.argmax is not None
    return Verdict(target.argmax, draft == target.argmax)


def accept_one_hot(target: TargetDistribution, draft: int, generator: torch.Generator) -> Verdict:
    """Rejection sampling for a deterministic proposal: one target draw, accepted iff it equals the draft."""
    token = sample_target(target, generator)
    return Verdict(token, token == draft)


def accept_proposal(
    target: TargetDistribution, draft: int, proposal: Proposal, generator: torch.Generator
) -> Verdict:
    """Rejection sampling for a draft drawn from ``proposal``; all sums run over the target's candidates, which hold
    every id where ``p > 0`` (and so every id of the residual ``max(0, p - q)``)."""
    assert target.probs is not None and target.ids is not None
    ids, p = target.ids.to(torch.int64), target.probs.to(torch.float64)
    q_x = float(proposal.at(torch.tensor([draft]))[0])
    if q_x <= 0.0:
        raise ValueError(f"draft token {draft} has zero probability under its own proposal distribution")
    p_x = float(p[ids == draft].sum())
    if float(draw_uniform(generator)) * q_x < p_x:
        return Verdict(draft, True)
    residual = (p - proposal.at(ids)).clamp_min(0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p == q up to rounding: the rejection had probability ~0; fall back to p itself
        residual, total = p, float(p.sum())
    keep = residual > 0
    return Verdict(inverse_cdf(residual[keep] / total, ids[keep], draw_uniform(generator)), False)


def decide(
    target: TargetDistribution, draft: int, generator: torch.Generator, proposal: Proposal | None = None
) -> Verdict:
    """Accept or replace ``draft`` at one verify position (see the module rules)."""
    if target.greedy:
        return accept_greedy(target, draft)
    if proposal is None:
        return accept_one_hot(target, draft, generator)
    return accept_proposal(target, draft, proposal, generator)
