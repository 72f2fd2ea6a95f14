"""The composition root: artifact -> model family -> runtime -> tokenizer -> drafter -> Engine.

``ninfer serve`` (which adds the frontend and the HTTP app), ``ninfer bench`` and the offline ``LLM`` API build
their model here and nowhere else. The plugin registries are built once by the caller and passed in.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import attrs
import torch

from ninfer.core.artifact.container import ModelSource
from ninfer.core.artifact.source import open_model_source
from ninfer.core.drafting import Drafter, SpeculativeConfig
from ninfer.core.errors import ConfigError
from ninfer.core.plugins import given_or_process
from ninfer.core.runtime import LoadOptions, ModelRuntime
from ninfer.core.tokenizer import Tokenizer
from ninfer.engine import Engine, EngineConfig

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.descriptors import ModelFamily
    from ninfer.core.plugins import Registries


def artifact_tokenizer(artifact: ModelSource) -> Tokenizer:
    """The artifact's own tokenizer, ready to detokenize (its byte table is built at load, not on the engine
    thread during the first request)."""
    tokenizer = Tokenizer.from_artifact(artifact)
    tokenizer.prepare_detokenization()
    return tokenizer


def build_drafter(
    artifact: ModelSource, runtime: ModelRuntime, speculative: SpeculativeConfig | None, registries: Registries
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


@attrs.define
class LoadedModel:
    """An opened artifact with its family, runtime, tokenizer and running Engine."""

    artifact: ModelSource
    family: ModelFamily
    runtime: ModelRuntime
    tokenizer: Tokenizer
    engine: Engine

    def close(self) -> None:
        self.engine.shutdown()
        self.artifact.close()


def check_kv_dtype(config: EngineConfig, load_options: LoadOptions) -> None:
    """Refuse a quantized KV dtype on CUDA before the model loads: the Triton decode/prefill kernels and the CUDA
    graphs read model-dtype pages; only the reference (CPU) path decodes the packed codecs."""
    if config.kv_dtype != "bf16" and torch.device(load_options.device).type == "cuda":
        raise ConfigError(
            f"--kv-dtype {config.kv_dtype} on CUDA needs the quantized attention kernels, not available yet",
            param="kv_dtype",
        )


def load_engine(
    source: str | os.PathLike[str] | ModelSource,
    config: EngineConfig,
    *,
    registries: Registries | None = None,
    load_options: LoadOptions | None = None,
    speculative: SpeculativeConfig | None = None,
) -> LoadedModel:
    """Open ``source`` (a .ninfer file, a Hugging Face directory or an opened artifact), load it and start an
    Engine with ``registries`` (default: the process's); ``speculative`` selects a speculative backend (``--spec``)
    and its draft window. An artifact opened
    here is closed at once when loading fails; :meth:`LoadedModel.close` closes the artifact either way."""
    registries = given_or_process(registries)
    opened_here = isinstance(source, (str, os.PathLike))
    artifact = open_model_source(source, registries) if opened_here else source
    try:
        family = registries.family_for(artifact.manifest)
        load_options = load_options or LoadOptions()
        check_kv_dtype(config, load_options)
        runtime = family.require("load_runtime")(artifact, load_options)
        tokenizer = artifact_tokenizer(artifact)
        drafter = build_drafter(artifact, runtime, speculative, registries)
        engine = Engine(
            runtime, config, tokenizer=tokenizer, eos_token_ids=artifact.manifest.eos_token_ids, drafter=drafter
        )
    except BaseException:
        if opened_here:
            artifact.close()
        raise
    return LoadedModel(artifact, family, runtime, tokenizer, engine)
