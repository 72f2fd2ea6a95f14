"""ninfer plugin: the ``echo`` model family, a scripted model that runs through the real engine without a GPU.

Its runtime puts all probability on a script taken from the last user message (see :mod:`ninfer_echo.script`);
its frontend and sampling presets are the built-in Qwen family's, obtained through the plugin registry.
Submodules load lazily so that ``ninfer plugins list`` stays fast.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from ninfer.core.descriptors import ModelFamily, SamplingPreset
from ninfer.core.hookspecs import hookimpl

FAMILY_NAME = "echo"
ARCHITECTURE = "NinferEchoForCausalLM"
MODEL_TYPE = "ninfer_echo"
#: The built-in family whose frontend (prompt rendering, output decoding) and presets the echo family reuses.
FRONTEND_FAMILY = "qwen3_5"


@functools.cache
def _frontend_family() -> ModelFamily:
    from ninfer.core.plugins import load_plugin_manager

    return load_plugin_manager(entry_points=False).registries.model_families[FRONTEND_FAMILY]


def _expected_weights(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    from ninfer_echo.model import expected_weights

    return expected_weights(config)


def _load_runtime(artifact: Any, options: Any) -> Any:
    from ninfer_echo.runtime import load_runtime

    return load_runtime(artifact, options)


def _build_frontend(artifact: Any, config: Any, tokenizer: Any) -> Any:
    return _frontend_family().require("build_frontend")(artifact, config, tokenizer)


def _make_tiny(options: Any) -> Any:
    from ninfer_echo.model import make_tiny

    return make_tiny(options)


def _sampling_presets(manifest: Any) -> Mapping[str, SamplingPreset]:
    return _frontend_family().require("sampling_presets")(manifest)


@hookimpl
def ninfer_model_families() -> list[ModelFamily]:
    return [
        ModelFamily(
            name=FAMILY_NAME,
            architectures=(ARCHITECTURE,),
            model_types=(MODEL_TYPE,),
            description="scripted echo model for client development and GPU-free end-to-end tests",
            expected_weights=_expected_weights,
            load_runtime=_load_runtime,
            build_frontend=_build_frontend,
            make_tiny=_make_tiny,
            sampling_presets=_sampling_presets,
        )
    ]
