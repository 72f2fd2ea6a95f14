"""The Qwen families' recommended sampling, per thinking mode (the model cards' values)."""

from __future__ import annotations

from typing import Any, Mapping

from ninfer.core.descriptors import SamplingPreset

#: The MoE checkpoints recommend a presence penalty while thinking; the dense ones do not.
_MOE_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")


def sampling_presets(manifest: Any) -> Mapping[str, SamplingPreset]:
    """``{"thinking": ..., "non_thinking": ...}`` for ``manifest``'s checkpoint (dense values for any other
    architecture that reuses this frontend)."""
    thinking_presence = 1.5 if manifest.architecture in _MOE_ARCHITECTURES else 0.0
    return {
        "thinking": SamplingPreset(1.0, 0.95, 20, 0.0, thinking_presence),
        "non_thinking": SamplingPreset(0.7, 0.80, 20, 0.0, 1.5),
    }
