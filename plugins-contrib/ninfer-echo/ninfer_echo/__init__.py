"""ninfer plugin: the ``echo`` model family, a scripted model that runs through the real engine without a GPU.

Its runtime puts all probability on a script taken from the last user message (see :mod:`ninfer_echo.script`);
its frontend and sampling presets are the built-in Qwen family's, looked up in the registry it joins.
Submodules load lazily so that ``ninfer plugins list`` stays fast.
"""

from __future__ import annotations

from typing import Any, Mapping

from ninfer.core.descriptors import ModelFamily, SamplingPreset
from ninfer.core.hookspecs import hookimpl
from ninfer.core.plugins import Registries

FAMILY_NAME = "echo"
ARCHITECTURE = "NinferEchoForCausalLM"
MODEL_TYPE = "ninfer_echo"
#: The built-in family whose frontend (prompt rendering, output decoding) and presets the echo family reuses.
FRONTEND_FAMILY = "qwen3_5"


def _expected_weights(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    from ninfer_echo.model import expected_weights

    return expected_weights(config)


def _load_runtime(artifact: Any, options: Any) -> Any:
    from ninfer_echo.runtime import load_runtime

    return load_runtime(artifact, options)


def _make_tiny(options: Any) -> Any:
    from ninfer_echo.model import make_tiny

    return make_tiny(options)


@hookimpl
def ninfer_model_families(registries: Registries) -> list[ModelFamily]:
    def frontend_family() -> ModelFamily:
        return registries.model_families[FRONTEND_FAMILY]

    def build_frontend(artifact: Any, config: Any, tokenizer: Any) -> Any:
        return frontend_family().require("build_frontend")(artifact, config, tokenizer)

    def sampling_presets(manifest: Any) -> Mapping[str, SamplingPreset]:
        return frontend_family().require("sampling_presets")(manifest)

    return [
        ModelFamily(
            name=FAMILY_NAME,
            architectures=(ARCHITECTURE,),
            model_types=(MODEL_TYPE,),
            description="scripted echo model for client development and GPU-free end-to-end tests",
            expected_weights=_expected_weights,
            load_runtime=_load_runtime,
            build_frontend=build_frontend,
            make_tiny=_make_tiny,
            sampling_presets=sampling_presets,
        )
    ]
