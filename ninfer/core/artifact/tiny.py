"""Tiny random-weight artifacts of a real architecture, for tests and the CPU demo (``ninfer make-tiny``)."""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from ninfer.core.artifact.container import (
    CHAT_TEMPLATE_RESOURCE,
    TOKENIZER_RESOURCE,
    Identity,
    Manifest,
    tensor_entries,
    write_artifact,
)
from ninfer.core.plugins import Registries

TEMPLATE_CHOICES = ("qwen3_6", "qwen3_8")


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


def tiny_resources(template: str) -> dict[str, bytes]:
    """The real Qwen tokenizer and a ninfer-written chat template, as artifact resources."""
    from ninfer.core.tokenizer import build_qwen_tokenizer_json
    from ninfer.plugins.qwen3_5.frontend.templates import template_source

    return {
        TOKENIZER_RESOURCE: build_qwen_tokenizer_json().encode("utf-8"),
        CHAT_TEMPLATE_RESOURCE: template_source(template).encode("utf-8"),
    }


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
    return write_artifact(out, manifest, tensor_entries(tiny.tensors), tiny_resources(options.template))
