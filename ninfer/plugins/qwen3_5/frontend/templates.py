"""ninfer's own Qwen chat templates, shipped as package data (one per template generation).

``qwen3_6`` serves Qwen3.5/3.6 checkpoints (closed-turn reasoning dropped unless ``preserve_thinking`` is true);
``qwen3_8`` adds ``reasoning_effort`` and keeps closed-turn reasoning unless ``preserve_thinking`` is false.
Both render byte-identical text to the official templates of their generation.
"""

from __future__ import annotations

from importlib import resources
from typing import Literal, get_args

from ninfer.core.artifact.container import CHAT_TEMPLATE_RESOURCE, TOKENIZER_RESOURCE
from ninfer.core.errors import ConfigError

TemplateName = Literal["qwen3_6", "qwen3_8"]
TEMPLATE_NAMES: tuple[str, ...] = get_args(TemplateName)
#: The template a tiny artifact embeds unless its options name one.
DEFAULT_TEMPLATE: TemplateName = "qwen3_6"


def template_source(name: TemplateName) -> str:
    """The text of ninfer's chat template ``name``."""
    if name not in TEMPLATE_NAMES:
        raise ConfigError(f"unknown Qwen chat template {name!r}; choose one of {', '.join(TEMPLATE_NAMES)}")
    return resources.files(__package__).joinpath("templates", f"{name}.jinja").read_text(encoding="utf-8")


def artifact_resources(name: TemplateName) -> dict[str, bytes]:
    """The resources a Qwen-vocabulary artifact embeds: the built-in tokenizer and ninfer's template ``name``."""
    from ninfer.plugins.qwen3_5.frontend.vocabulary import build_qwen_tokenizer_json

    return {
        TOKENIZER_RESOURCE: build_qwen_tokenizer_json().encode("utf-8"),
        CHAT_TEMPLATE_RESOURCE: template_source(name).encode("utf-8"),
    }
