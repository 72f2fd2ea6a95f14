"""The echo artifact: its config, its one marker weight and the tiny-artifact builder behind ``make-tiny``."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from ninfer_echo import ARCHITECTURE, MODEL_TYPE

from ninfer.core.artifact.tiny import TinyModel
from ninfer.core.errors import ConfigError
from ninfer.plugins.qwen3_5.frontend.templates import DEFAULT_TEMPLATE, artifact_resources

VOCAB_SIZE = 248320
IM_END = 248046
END_OF_TEXT = 248044
MAX_POSITION_EMBEDDINGS = 262144
MARKER_WEIGHT = "echo.marker"


def echo_config() -> dict[str, Any]:
    """The ``config.json`` of an echo artifact: the real Qwen vocabulary size and end-of-sequence ids."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": VOCAB_SIZE,
        "eos_token_id": [IM_END, END_OF_TEXT],
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
    }


def expected_weights(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of an echo artifact: a single one-element marker (the model computes nothing)."""
    return {MARKER_WEIGHT: (1,)}


def make_tiny(options: Any) -> TinyModel:
    """The echo artifact's contents, with the Qwen tokenizer and the chat template ``options.template``."""
    if getattr(options, "mtp", False):
        raise ConfigError("the echo family has no MTP companion weights; drop --mtp", param="mtp")
    config = echo_config()
    return TinyModel(
        architecture=ARCHITECTURE,
        config=config,
        tensors={name: torch.ones(shape, dtype=torch.bfloat16) for name, shape in expected_weights(config).items()},
        generation_defaults={"eos_token_ids": [IM_END, END_OF_TEXT]},
        resources=artifact_resources(getattr(options, "template", DEFAULT_TEMPLATE)),
    )
