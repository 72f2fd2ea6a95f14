"""The proposal head drafters share with the target: the full lm_head, or its FR-Spec reduced vocabulary.

``--lm-head-draft`` keeps the first ``REDUCED_VOCAB`` rows of the lm_head (byte-level BPE ids are assigned in merge
order, so lower ids are more frequent). Verification always uses the full head, so outputs are unchanged; only
acceptance can drop (a token outside the subset is never proposed).
"""

from __future__ import annotations

import torch

from ninfer.plugins.qwen3_5.model.model import Qwen35Model

#: Rows of the lm_head kept by ``--lm-head-draft`` (FR-Spec's main setting).
REDUCED_VOCAB = 32768


def draft_head(model: Qwen35Model, lm_head_draft: bool) -> torch.Tensor:
    """The ``[V', H]`` head proposals are scored with: the target's lm_head, reduced when ``lm_head_draft``."""
    if not lm_head_draft:
        return model.lm_head
    return model.lm_head[: min(REDUCED_VOCAB, model.lm_head.shape[0])]
