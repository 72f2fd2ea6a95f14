"""The Qwen3.5 / 3.6 / 3.8 model family plugin: dense (``qwen3_5``) and MoE (``qwen3_5_moe``).

Both share the hybrid Gated-DeltaNet + gated-attention stack; they differ in the FFN block.
Submodules are imported lazily so that ``ninfer plugins list`` stays fast.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ninfer.core.descriptors import ModelFamily, SamplingPreset
from ninfer.core.hookspecs import hookimpl

DENSE_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")


def _expected_weights(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    from ninfer.plugins.qwen3_5.model.weights import expected_weights

    return expected_weights(config)


def _quantizable_weights(config: Mapping[str, Any]) -> list[str]:
    from ninfer.plugins.qwen3_5.model.weights import quantizable_weights

    return quantizable_weights(config)


def _checkpoint_layout(config: Mapping[str, Any], stored: Mapping[str, Any]) -> Any:
    from ninfer.plugins.qwen3_5.model.checkpoint import checkpoint_layout

    return checkpoint_layout(config, stored)


def _load_runtime(artifact: Any, options: Any) -> Any:
    from ninfer.plugins.qwen3_5.model.runtime import load_runtime

    return load_runtime(artifact, options)


def _build_frontend(artifact: Any, config: Any, tokenizer: Any) -> Any:
    from ninfer.plugins.qwen3_5.frontend.qwen_frontend import QwenFrontend

    return QwenFrontend(artifact, config, tokenizer)


def _make_tiny(options: Any) -> Any:
    from ninfer.plugins.qwen3_5.model.tiny import make_tiny

    return make_tiny(options)


def _synthetic_presets(architectures: tuple[str, ...]) -> Callable[[], tuple[str, ...]]:
    def presets() -> tuple[str, ...]:
        from ninfer.plugins.qwen3_5.model.presets import preset_names

        return preset_names(architectures)

    return presets


def _synthetic_source(architectures: tuple[str, ...]) -> Callable[[str, Any, int], Any]:
    def source(preset: str, options: Any, seed: int) -> Any:
        from ninfer.core.errors import ConfigError
        from ninfer.plugins.qwen3_5.model.presets import preset_names
        from ninfer.plugins.qwen3_5.model.synthetic import synthetic_source

        if preset not in preset_names(architectures):
            raise ConfigError(f"this family has no synthetic preset {preset!r}; its presets: "
                              f"{', '.join(preset_names(architectures))}", param="synthetic")
        return synthetic_source(preset, options, seed)

    return source


def _sampling_presets(manifest: Any) -> Mapping[str, SamplingPreset]:
    from ninfer.plugins.qwen3_5.frontend.sampling import sampling_presets

    return sampling_presets(manifest)


@hookimpl
def ninfer_model_families() -> list[ModelFamily]:
    common = dict(
        expected_weights=_expected_weights,
        load_runtime=_load_runtime,
        build_frontend=_build_frontend,
        make_tiny=_make_tiny,
        sampling_presets=_sampling_presets,
        quantizable_weights=_quantizable_weights,
    )
    return [
        ModelFamily(
            name="qwen3_5",
            architectures=DENSE_ARCHITECTURES,
            model_types=("qwen3_5_text", "qwen3_5"),
            description="Qwen3.5/3.6/3.8 dense hybrid Gated-DeltaNet (e.g. Qwen3.6-27B, Qwen3.8-27B)",
            synthetic_presets=_synthetic_presets(DENSE_ARCHITECTURES),
            synthetic_source=_synthetic_source(DENSE_ARCHITECTURES),
            **common,
        ),
        ModelFamily(
            name="qwen3_5_moe",
            architectures=MOE_ARCHITECTURES,
            model_types=("qwen3_5_moe_text", "qwen3_5_moe"),
            description="Qwen3.5/3.6 MoE hybrid Gated-DeltaNet (e.g. Qwen3.6-35B-A3B)",
            checkpoint_layout=_checkpoint_layout,  # per-expert checkpoints read as the fused expert layout
            synthetic_presets=_synthetic_presets(MOE_ARCHITECTURES),
            synthetic_source=_synthetic_source(MOE_ARCHITECTURES),
            **common,
        ),
    ]
