"""Tiny random-weight artifacts of a real architecture, for tests and the CPU demo (``ninfer make-tiny``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs
import torch

from ninfer.core.artifact.container import (
    Identity,
    Manifest,
    tensor_entries,
    write_artifact,
)
from ninfer.core.plugins import Registries

TEMPLATE_CHOICES = ("qwen3_6", "qwen3_8")


@attrs.frozen
class TinyModel:
    """What a family's ``make_tiny(options)`` returns: a tiny checkpoint of its real structure (``tensors`` are
    exactly ``expected_weights(config)``) and the resources its artifact embeds (tokenizer, chat template)."""

    architecture: str
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    generation_defaults: dict[str, Any]
    resources: dict[str, bytes]


@attrs.frozen
class TinyOptions:
    """What ``make-tiny`` builds. ``template`` picks which ninfer-written Qwen chat template to embed."""

    family: str = "qwen3_5"
    mtp: bool = False
    dflash: bool = False
    dflash2: bool = False
    template: str = "qwen3_6"
    seed: int = 0

    @property
    def model_id(self) -> str:
        companions = "".join(f"-{name}" for name in ("mtp", "dflash", "dflash2") if getattr(self, name))
        return f"ninfer-tiny-{self.family.replace('_', '-')}{companions}"


def write_tiny_artifact(out: str | os.PathLike[str], options: TinyOptions, registries: Registries) -> Path:
    """Build the family's tiny model deterministically from ``options.seed`` and write it as a .ninfer file."""
    family = registries.model_families.get(options.family)
    if family is None:
        from ninfer.core.errors import ConfigError

        raise ConfigError(f"unknown model family {options.family!r}; choose one of: {', '.join(registries.model_families)}")
    tiny = family.require("make_tiny")(options)
    companions = tuple(name for name in ("mtp", "dflash", "dflash2") if getattr(options, name))
    manifest = Manifest(
        identity=Identity(options.model_id),
        architecture=tiny.architecture,
        config=tiny.config,
        weight_format={"dtype": "bfloat16", "quantization": None, "random_weights": True},
        companions=companions,
        generation_defaults=tiny.generation_defaults,
        family=family.name,
    )
    return write_artifact(out, manifest, tensor_entries(tiny.tensors), tiny.resources)
