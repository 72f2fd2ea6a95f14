"""Built-in speculative-decoding backends: MTP, DFlash and DFlash2 (drafters land with the speculation issue)."""

from __future__ import annotations

from ninfer.core.descriptors import SpeculativeBackend
from ninfer.core.hookspecs import hookimpl


@hookimpl
def ninfer_speculative_backends() -> list[SpeculativeBackend]:
    return [
        SpeculativeBackend(
            name="mtp",
            min_draft_tokens=1,
            max_draft_tokens=5,
            companion_prefix="mtp.",
            description="the checkpoint's own multi-token-prediction layer, chained k times",
        ),
        SpeculativeBackend(
            name="dflash",
            min_draft_tokens=1,
            max_draft_tokens=15,
            companion_prefix="dflash.",
            description="block-diffusion drafter conditioned on target hidden states (companion weights)",
        ),
        SpeculativeBackend(
            name="dflash2",
            min_draft_tokens=1,
            max_draft_tokens=15,
            companion_prefix="dflash2.",
            description="DFlash with two-tap dynamic convolutions and a top-16 candidate walk (companion weights)",
            supports_lm_head_draft=False,
        ),
    ]
