"""The drafting contract: what a speculative backend's drafter receives from the engine and returns to it.

The engine owns the round (draft, verify in one target forward, accept losslessly, roll back); a drafter only
proposes tokens for the rows it is shown and keeps its own state in step with what the target committed. It reads a
row through :class:`DraftRow`, never the engine's internal sequence type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol
from typing import Sequence as Seq

import attrs
import torch

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.request import SamplingParams
    from ninfer.core.runtime import KVCache


class DraftSampling(Protocol):
    """A row's sampling as a drafter may read it: greedy or not, its resolved parameters (``params.temperature``,
    :class:`ninfer.core.request.SamplingParams`) and the request's seed."""

    @property
    def greedy(self) -> bool: ...

    @property
    def params(self) -> "SamplingParams": ...

    @property
    def seed(self) -> int: ...


class DraftRow(Protocol):
    """One running request as a drafter sees it.

    ``tokens``: prompt and output tokens so far (the last one may not be fed yet); ``fed``: how many of them the
    target has consumed (its KV and state reach there); ``pages``: the row's page ids in the engine's pool, which a
    drafter's own paged caches share; ``sampler``: the row's sampling. A drafter keys its per-row state by the
    row object's identity.
    """

    @property
    def tokens(self) -> Seq[int]: ...

    @property
    def fed(self) -> int: ...

    @property
    def pages(self) -> Seq[int]: ...

    @property
    def sampler(self) -> DraftSampling: ...


@attrs.frozen
class Proposal:
    """The distribution a drafter drew one token from: ``probs`` (float64, sums to 1) over distinct ``ids``; every
    other id has probability 0 (a top-K candidate walk proposes from K ids, not the whole vocabulary)."""

    ids: torch.Tensor
    probs: torch.Tensor

    def at(self, ids: torch.Tensor) -> torch.Tensor:
        """q at each of ``ids`` (float64; 0 where the proposal has no mass)."""
        match = ids.to(torch.int64)[:, None] == self.ids.to(torch.int64)[None, :]
        return match.to(torch.float64) @ self.probs.to(torch.float64)


@attrs.frozen
class SpeculativeConfig:
    """The startup-frozen speculative selection: backend name, draft window, reduced proposal head."""

    backend: str
    draft_tokens: int
    lm_head_draft: bool = False


@attrs.frozen
class Draft:
    """A row's proposed tokens; ``proposals[i]`` is the distribution token i was drawn from, or None for a
    deterministic (one-hot) proposal."""

    tokens: tuple[int, ...]
    proposals: tuple[Proposal, ...] | None = None


class Drafter(Protocol):
    """What a speculative backend's ``build_drafter`` returns; driven only by the executor thread.

    ``capture_layers`` (optional, default none): target decoder layers whose outputs the drafter conditions on;
    when set, :meth:`observe` receives those (``ForwardOutput.layer_hidden``) instead of the final hidden states.
    """

    backend: str
    draft_tokens: int

    @property
    def kv_bytes_per_token(self) -> float:
        """Bytes of the drafter's own paged state per pool token (sizes ``--kv-capacity auto``)."""
        ...

    def bind(self, num_pages: int, page_size: int) -> list[KVCache]:
        """Allocate the drafter's paged state for the engine's pool; returns caches that share its page ids."""
        ...

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's fp32 next-token logits for final-normed hidden states ``[N, H]``."""
        ...

    def observe(self, seq: DraftRow, start: int, hidden: torch.Tensor) -> None:
        """The target committed positions ``[start, start + len(hidden))`` of ``seq`` with these hidden states."""
        ...

    def ready(self, seq: DraftRow) -> bool:
        """Whether ``seq`` can be drafted for now (its state reaches ``seq.fed``)."""
        ...

    def draft(self, rows: Seq[DraftRow], counts: Seq[int]) -> list[Draft]:
        """``counts[i]`` draft tokens following ``rows[i].tokens`` (which end with one unfed token)."""
        ...

    def forget(self, seq: DraftRow) -> None:
        """``seq`` left the engine: drop its state."""
        ...


class ResumableDrafter(Drafter, Protocol):
    """A drafter whose state travels with prefix checkpoints, so it is :meth:`ready` right after a hit.

    Its paged state for a checkpoint's tokens lives in the checkpoint's pages (they share the engine's page
    ids); the snapshot holds the rest. ``resume_rewrites``: how many of a checkpoint's last positions a
    resumed sequence rewrites in that paged state (their pages are copied for it rather than shared).
    """

    resume_rewrites: int

    def snapshot(self, seq: DraftRow) -> object | None:
        """What resuming at ``seq.fed`` needs (taken when a checkpoint of ``seq``'s fed tokens is kept), or None
        when ``seq``'s state cannot vouch for its paged state up to there."""
        ...

    def restore(self, seq: DraftRow, snapshot: object) -> None:
        """``seq`` restored a checkpoint with ``snapshot`` (``seq.fed`` is the checkpoint's end): be ready there."""
        ...
