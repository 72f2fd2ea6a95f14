"""Built-in speculative-decoding backends: MTP, DFlash and DFlash2."""

from __future__ import annotations

from typing import Any

from ninfer.core.descriptors import SpeculativeBackend
from ninfer.core.hookspecs import hookimpl


def _build_mtp_drafter(runtime: Any, artifact: Any, config: Any) -> Any:
    from ninfer.plugins.qwen3_5.speculative.mtp_drafter import build_mtp_drafter

    return build_mtp_drafter(runtime, artifact, config)


def _build_dflash_drafter(runtime: Any, artifact: Any, config: Any) -> Any:
    from ninfer.plugins.qwen3_5.speculative.dflash_drafter import build_dflash_drafter

    return build_dflash_drafter(runtime, artifact, config)


def _build_dflash2_drafter(runtime: Any, artifact: Any, config: Any) -> Any:
    from ninfer.plugins.qwen3_5.speculative.dflash2_drafter import build_dflash2_drafter

    return build_dflash2_drafter(runtime, artifact, config)


def _open_companion(name: str):
    def open_companion(path: Any) -> Any:
        from ninfer.plugins.qwen3_5.speculative.companion import DrafterDirectory

        return DrafterDirectory(path, name)

    return open_companion


@hookimpl
def ninfer_speculative_backends() -> list[SpeculativeBackend]:
    return [
        SpeculativeBackend(
            name="mtp",
            min_draft_tokens=1,
            max_draft_tokens=5,
            companion_prefix="mtp.",
            description="the checkpoint's own multi-token-prediction layer, chained k times",
            build_drafter=_build_mtp_drafter,
        ),
        SpeculativeBackend(
            name="dflash",
            min_draft_tokens=1,
            max_draft_tokens=15,
            companion_prefix="dflash.",
            description="block-diffusion drafter conditioned on target hidden states (companion weights)",
            build_drafter=_build_dflash_drafter,
            open_companion=_open_companion("dflash"),
        ),
        SpeculativeBackend(
            name="dflash2",
            min_draft_tokens=1,
            max_draft_tokens=15,
            companion_prefix="dflash2.",
            description="DFlash with two-tap dynamic convolutions and a top-16 candidate walk (companion weights)",
            supports_lm_head_draft=False,  # the candidate selector walks the full target vocabulary
            build_drafter=_build_dflash2_drafter,
            open_companion=_open_companion("dflash2"),
        ),
    ]
