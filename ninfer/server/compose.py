"""Building an Engine for an artifact: its runtime (through the model family), tokenizer and stop ids."""

from __future__ import annotations

import os
from typing import Any

import attrs

from ninfer.core.artifact.container import TOKENIZER_RESOURCE, Manifest, open_model_source
from ninfer.core.descriptors import ModelFamily
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Engine
from ninfer.core.drafting import Drafter, SpeculativeConfig
from ninfer.core.errors import ConfigError
from ninfer.core.plugins import Registries
from ninfer.core.runtime import LoadOptions


def eos_token_ids(manifest: Manifest) -> tuple[int, ...]:
    """End-of-sequence ids: the generation defaults' ``eos_token_ids``, else the config's ``eos_token_id``."""
    ids = manifest.generation_defaults.get("eos_token_ids")
    if ids is None:
        ids = manifest.text_config.get("eos_token_id", manifest.config.get("eos_token_id"))
    if ids is None:
        return ()
    return tuple(int(token) for token in ([ids] if isinstance(ids, int) else ids))


def artifact_tokenizer(artifact: Any) -> Any:
    """The artifact's own tokenizer (``resource/tokenizer/tokenizer.json``), ready to detokenize (its byte table is
    built at load, not on the engine thread during the first request)."""
    from ninfer.core.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_json(artifact.resource_text(TOKENIZER_RESOURCE))
    tokenizer.prepare_detokenization()
    return tokenizer


def build_drafter(
    artifact: Any, runtime: Any, speculative: SpeculativeConfig | None, registries: Registries
) -> Drafter | None:
    """The ``--spec`` backend's drafter for ``runtime`` (None without speculation)."""
    if speculative is None:
        return None
    backend = registries.speculative_backend(speculative.backend)
    backend.validate_draft_tokens(speculative.draft_tokens)
    if speculative.lm_head_draft and not backend.supports_lm_head_draft:
        raise ConfigError(
            f"--lm-head-draft cannot be combined with --spec {backend.name}: it drafts with the full LM head",
            param="lm_head_draft",
        )
    return backend.require_drafter()(runtime, artifact, speculative)


def build_engine(
    artifact: Any, runtime: Any, config: EngineConfig, tokenizer: Any | None = None, drafter: Drafter | None = None
) -> Engine:
    """An Engine over an already loaded runtime, with the artifact's tokenizer and stop ids."""
    tokenizer = tokenizer if tokenizer is not None else artifact_tokenizer(artifact)
    return Engine(
        runtime, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids(artifact.manifest), drafter=drafter
    )


@attrs.define
class LoadedModel:
    """An opened artifact with its family, runtime, tokenizer and running Engine."""

    artifact: Any
    family: ModelFamily
    runtime: Any
    tokenizer: Any
    engine: Engine

    def close(self) -> None:
        self.engine.shutdown()
        self.artifact.close()


def load_engine(
    source: str | os.PathLike[str] | Any,
    config: EngineConfig,
    *,
    load_options: LoadOptions | None = None,
    registries: Registries | None = None,
    speculative: SpeculativeConfig | None = None,
) -> LoadedModel:
    """Open ``source`` (a .ninfer file, a Hugging Face directory or an opened artifact), load it, start an Engine.

    ``speculative`` selects a speculative backend (``--spec``) and its draft window.
    """
    if registries is None:
        from ninfer.core.plugins import load_plugin_manager

        registries = load_plugin_manager().registries
    artifact = open_model_source(source) if isinstance(source, (str, os.PathLike)) else source
    try:
        family = registries.family_for(artifact.manifest)
        runtime = family.require("load_runtime")(artifact, load_options or LoadOptions())
        tokenizer = artifact_tokenizer(artifact)
        drafter = build_drafter(artifact, runtime, speculative, registries)
        engine = build_engine(artifact, runtime, config, tokenizer, drafter)
    except BaseException:
        if isinstance(source, (str, os.PathLike)):
            artifact.close()
        raise
    return LoadedModel(artifact, family, runtime, tokenizer, engine)
