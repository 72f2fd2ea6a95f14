"""The DFlash2 drafter: DFlash's context bookkeeping and block forward, drafts chosen by the candidate-selector walk.

Observing, readiness, forgetting and the paged context KV are DFlash's (:class:`DFlashDrafter`). Drafting runs the
DFlash2 block forward once for every row, then walks each row's top-K candidates from its anchor (the one unfed
committed token). A greedy row gets the argmax path (one-hot proposals). A row sampling at temperature T draws each
position from ``softmax(score / T)`` over its candidates and returns that distribution (K ids and their probabilities)
as the position's ``Proposal``, so ``accept_proposal`` keeps the output distribution exactly the target's. The draws come from a
drafter-owned generator per sequence, seeded from the request's seed with a fixed salt (a seeded request drafts
reproducibly, and its proposal noise is independent of the acceptance draws on the request's own generator).
"""

from __future__ import annotations

from typing import Any
from typing import Sequence as Seq

import torch

from ninfer.core.drafting import Draft, DraftRow, Proposal, SpeculativeConfig
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.speculative.dflash2 import DFlash2Model
from ninfer.plugins.qwen3_5.speculative.dflash_drafter import DFlashDrafter, load_drafter_model

_UINT64_MASK = 2**64 - 1
#: Mixed into a request's seed for its proposal generator, so it never replays the request's sampler stream.
_PROPOSAL_SEED_SALT = 0x9E3779B97F4A7C15


class DFlash2Drafter(DFlashDrafter):
    """Drafts with a DFlash2 companion model through its candidate selector."""

    backend = "dflash2"
    model: DFlash2Model

    def __init__(self, runtime: Qwen35Runtime, model: DFlash2Model, draft_tokens: int, lm_head_draft: bool = False):
        super().__init__(runtime, model, draft_tokens, lm_head_draft)
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, seq: DraftRow) -> None:
        super().forget(seq)
        self._generators.pop(id(seq), None)

    def draft(self, rows: Seq[DraftRow], counts: Seq[int]) -> list[Draft]:
        hidden = self.mask_hidden(rows, counts)
        temperatures = [0.0 if seq.sampler.greedy else float(seq.sampler.params.temperature) for seq in rows]
        selector = self.model.selector
        selection = selector.walk(
            hidden, self._head, [seq.tokens[-1] for seq in rows], counts, temperatures,
            self._gumbel_noise(rows, counts, selector.width(self._head)).to(hidden.device),
        )
        tokens = selection.tokens.tolist()
        candidates, probabilities = selection.candidates.cpu(), selection.probabilities.cpu()
        drafts, offset = [], 0
        for count, temperature in zip(counts, temperatures):
            chosen = tuple(int(token) for token in tokens[offset : offset + count])
            proposals = None
            if temperature > 0:
                proposals = tuple(
                    Proposal(candidates[slot], probabilities[slot].to(torch.float64))
                    for slot in range(offset, offset + count)
                )
            drafts.append(Draft(chosen, proposals))
            offset += count
        return drafts

    def _gumbel_noise(self, rows: Seq[DraftRow], counts: Seq[int], width: int) -> torch.Tensor:
        """``[sum(counts), width]`` float64: standard Gumbel draws for sampling rows, zeros for greedy rows."""
        parts = []
        for seq, count in zip(rows, counts):
            if seq.sampler.greedy:
                parts.append(torch.zeros(count, width, dtype=torch.float64))
                continue
            parts.append(gumbel_noise(self._generator(seq), count, width))
        return torch.cat(parts)

    def _generator(self, seq: DraftRow) -> torch.Generator:
        generator = self._generators.get(id(seq))
        if generator is None:
            seed = (int(seq.sampler.seed) ^ _PROPOSAL_SEED_SALT) & _UINT64_MASK
            generator = self._generators[id(seq)] = torch.Generator().manual_seed(seed)
        return generator


def gumbel_noise(generator: torch.Generator, count: int, width: int) -> torch.Tensor:
    """``[count, width]`` float64 standard Gumbel draws: ``argmax(x + noise)`` samples ``softmax(x)``."""
    uniform = torch.rand(count, width, generator=generator, dtype=torch.float64)
    return -torch.log(-torch.log(uniform))


def build_dflash2_drafter(runtime: Any, artifact: Any, config: SpeculativeConfig) -> DFlash2Drafter:
    """``SpeculativeBackend.build_drafter`` for ``--spec dflash2``: loads the artifact's ``dflash2.*`` companion."""
    model = load_drafter_model(runtime, artifact, DFlash2Model)
    return DFlash2Drafter(runtime, model, config.draft_tokens, config.lm_head_draft)
