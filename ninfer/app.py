"""``ninfer serve``: resolve the artifact, check every selected capability, load the model, serve."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ninfer.core.artifact import open_model_source
from ninfer.core.errors import NotYetAvailableError
from ninfer.core.observability import oplog
from ninfer.core.runtime import LoadOptions

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.config import ServeConfig
    from ninfer.core.plugins import PluginManager


def check_capabilities(config: "ServeConfig", plugins: "PluginManager") -> None:
    """Fail before anything loads when an option selects something that is not implemented yet."""
    registries = plugins.registries
    registries.kv_dtype(config.kv_dtype).require_storage()
    if config.spec is not None:
        registries.speculative_backend(config.spec).require_drafter()
    if config.vision:
        raise NotYetAvailableError("--vision is not yet available: the vision runtime has not been implemented")


def device_for(config: "ServeConfig") -> str:
    import torch

    return f"cuda:{config.device}" if torch.cuda.is_available() else "cpu"


def serve(config: "ServeConfig", plugins: "PluginManager") -> None:
    log = oplog.configure(config.log_level)
    check_capabilities(config, plugins)
    registries = plugins.registries
    if config.artifact is None:
        from ninfer.core.demo import demo_artifact_path

        path = demo_artifact_path(registries)
        log.info(f"no artifact given: serving the built-in tiny demo model {path} (its weights are random)")
    else:
        path = config.artifact
    artifact = open_model_source(path)
    family = registries.family_for(artifact.manifest)
    log.info(f"loading {artifact.manifest.identity.model_id} ({family.name}, {artifact.manifest.architecture})")
    runtime = family.require("load_runtime")(artifact, LoadOptions(device=device_for(config), dtype=config.dtype))
    log.info(f"model loaded: {len(runtime.spec.attention_layers)} attention + {len(runtime.spec.recurrent_layers)} recurrent layers on {runtime.spec.device}")
    raise NotYetAvailableError(
        "the model loaded, but the resident engine and HTTP server are not yet available in this build"
    )
