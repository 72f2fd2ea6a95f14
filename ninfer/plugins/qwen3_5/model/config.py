"""The Qwen3.5 text-model configuration, parsed and validated from a Hugging Face ``config.json`` mapping.

``Qwen3_5(Moe)ForConditionalGeneration`` configs nest the text model under ``text_config``; ``Qwen3_5(Moe)ForCausalLM``
configs are flat (model_type ``qwen3_5_text`` / ``qwen3_5_moe_text``). Rope settings are read from
``rope_parameters`` (transformers 5) or the older ``rope_theta`` / ``partial_rotary_factor`` / ``rope_scaling`` keys.
Optional keys take the transformers defaults; a missing required key or an invalid value is an ``ArtifactError``.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from ninfer.core.errors import ArtifactError, NotYetAvailableError

DENSE_CONDITIONAL = "Qwen3_5ForConditionalGeneration"
DENSE_CAUSAL = "Qwen3_5ForCausalLM"
MOE_CONDITIONAL = "Qwen3_5MoeForConditionalGeneration"
MOE_CAUSAL = "Qwen3_5MoeForCausalLM"
ARCHITECTURES = (DENSE_CONDITIONAL, DENSE_CAUSAL, MOE_CONDITIONAL, MOE_CAUSAL)
_ARCHITECTURE_OF_MODEL_TYPE = {
    "qwen3_5": DENSE_CONDITIONAL,
    "qwen3_5_text": DENSE_CAUSAL,
    "qwen3_5_moe": MOE_CONDITIONAL,
    "qwen3_5_moe_text": MOE_CAUSAL,
}
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
DEFAULT_MROPE_SECTION = (11, 11, 10)


def resolve_architecture(config: Mapping[str, Any], architecture: str | None = None) -> str:
    """The architecture: the explicit one, else ``config["architectures"][0]``, else implied by ``model_type``."""
    if architecture is None:
        listed = config.get("architectures")
        if isinstance(listed, (list, tuple)) and listed:
            architecture = listed[0]
        else:
            architecture = _ARCHITECTURE_OF_MODEL_TYPE.get(config.get("model_type"))  # type: ignore[arg-type]
    if architecture is None:
        raise ArtifactError("the config names no architecture (no 'architectures' list and no known 'model_type')")
    if architecture not in ARCHITECTURES:
        raise ArtifactError(
            f"architecture {architecture!r} is not a Qwen3.5 architecture (expected one of {ARCHITECTURES})"
        )
    return architecture


def text_config_of(config: Mapping[str, Any], architecture: str) -> Mapping[str, Any]:
    """The text part of a config: ``text_config`` for ConditionalGeneration, the flat config for CausalLM."""
    nested = config.get("text_config")
    if architecture.endswith("ForConditionalGeneration") and not isinstance(nested, Mapping):
        raise ArtifactError(f"config of a {architecture} lacks the 'text_config' object")
    return nested if isinstance(nested, Mapping) else config


class _Reader:
    """Typed field access with errors that name the field."""

    def __init__(self, data: Mapping[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def _fail(self, key: str, problem: str) -> ArtifactError:
        return ArtifactError(f"{self.where}: field {key!r} {problem}")

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.data.get(key, default)
        if value is None:
            raise self._fail(key, "is missing")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._fail(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self._fail(key, f"must be >= {minimum}, got {value}")
        return value

    def number(self, key: str, default: float | None = None, *, positive: bool = True) -> float:
        value = self.data.get(key, default)
        if value is None:
            raise self._fail(key, "is missing")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._fail(key, f"must be a number, got {value!r}")
        if positive and value <= 0:
            raise self._fail(key, f"must be positive, got {value}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._fail(key, f"must be true or false, got {value!r}")
        return value


@attrs.frozen
class Qwen35TextConfig:
    """Everything the text runtime needs about one Qwen3.5 / 3.6 / 3.8 checkpoint (dense or MoE)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    mrope_interleaved: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    mtp_num_hidden_layers: int
    intermediate_size: int | None = None
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.architecture in (MOE_CONDITIONAL, MOE_CAUSAL)

    @property
    def is_conditional_generation(self) -> bool:
        return self.architecture.endswith("ForConditionalGeneration")

    @property
    def text_prefix(self) -> str:
        """Prefix of the text-model tensors: ``model.language_model.`` or ``model.``."""
        return "model.language_model." if self.is_conditional_generation else "model."

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], architecture: str | None = None) -> "Qwen35TextConfig":
        """Parse a Hugging Face config mapping (nested or flat); ``architecture`` overrides ``architectures[0]``."""
        if not isinstance(config, Mapping):
            raise ArtifactError(f"the model config must be a JSON object, got {type(config).__name__}")
        architecture = resolve_architecture(config, architecture)
        text = text_config_of(config, architecture)
        read = _Reader(text, "text_config" if text is not config else "config")
        is_moe = architecture in (MOE_CONDITIONAL, MOE_CAUSAL)
        expected_type = "qwen3_5_moe_text" if is_moe else "qwen3_5_text"
        model_type = text.get("model_type")
        if model_type is not None and model_type != expected_type:
            raise ArtifactError(
                f"{architecture} needs a text model_type {expected_type!r}, the config says {model_type!r}"
            )
        if text.get("hidden_act", "silu") != "silu":
            raise NotYetAvailableError(f"hidden_act={text['hidden_act']!r} is not supported (only 'silu')")
        if text.get("attention_bias", False):
            raise NotYetAvailableError("attention_bias=true is not supported by the Qwen3.5 runtime")
        num_layers = read.integer("num_hidden_layers")
        rope = _rope_settings(text)
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=read.integer("vocab_size"),
            hidden_size=read.integer("hidden_size"),
            num_hidden_layers=num_layers,
            layer_types=_layer_types(text, num_layers),
            num_attention_heads=read.integer("num_attention_heads"),
            num_key_value_heads=read.integer("num_key_value_heads"),
            head_dim=read.integer("head_dim"),
            linear_num_key_heads=read.integer("linear_num_key_heads"),
            linear_num_value_heads=read.integer("linear_num_value_heads"),
            linear_key_head_dim=read.integer("linear_key_head_dim"),
            linear_value_head_dim=read.integer("linear_value_head_dim"),
            linear_conv_kernel_dim=read.integer("linear_conv_kernel_dim", minimum=2),
            rms_norm_eps=read.number("rms_norm_eps", 1e-6),
            max_position_embeddings=read.integer("max_position_embeddings"),
            tie_word_embeddings=_tie_word_embeddings(config, text),
            mtp_num_hidden_layers=read.integer("mtp_num_hidden_layers", config.get("mtp_num_hidden_layers", 0), minimum=0),
            eos_token_ids=_token_ids(text.get("eos_token_id", config.get("eos_token_id"))),
            **rope,
        )
        if is_moe:
            fields.update(
                num_experts=read.integer("num_experts"),
                num_experts_per_tok=read.integer("num_experts_per_tok"),
                moe_intermediate_size=read.integer("moe_intermediate_size"),
                shared_expert_intermediate_size=read.integer("shared_expert_intermediate_size"),
            )
        else:
            fields.update(intermediate_size=read.integer("intermediate_size"))
        parsed = cls(**fields)
        parsed._check_consistency()
        return parsed

    def _check_consistency(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ArtifactError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ArtifactError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        rotary = self.rotary_dim
        if rotary <= 0 or rotary % 2 or rotary > self.head_dim:
            raise ArtifactError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim {rotary} for head_dim "
                f"{self.head_dim}; it must be even and within (0, head_dim]"
            )
        if sum(self.mrope_section) != rotary // 2:
            raise ArtifactError(
                f"mrope_section {list(self.mrope_section)} must sum to rotary_dim // 2 = {rotary // 2}"
            )
        if self.is_moe and self.num_experts_per_tok > self.num_experts:  # type: ignore[operator]
            raise ArtifactError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
            )


def _layer_types(text: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = _Reader(text, "text_config").integer("full_attention_interval", 4)
        return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))
    if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
        raise ArtifactError(f"field 'layer_types' must list {num_layers} layer kinds, got {layer_types!r}")
    for kind in layer_types:
        if kind not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise ArtifactError(f"field 'layer_types' has an unknown layer kind {kind!r}")
    return tuple(layer_types)


def _rope_settings(text: Mapping[str, Any]) -> dict[str, Any]:
    parameters = text.get("rope_parameters") or {}
    legacy = text.get("rope_scaling") or {}
    if not isinstance(parameters, Mapping) or not isinstance(legacy, Mapping):
        raise ArtifactError("fields 'rope_parameters' / 'rope_scaling' must be JSON objects")
    rope_type = parameters.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if rope_type not in ("default", "mrope"):
        raise NotYetAvailableError(f"rope_type {rope_type!r} (context extension) is not supported yet; only 'default'")
    merged = {**legacy, **parameters}
    for key in ("rope_theta", "partial_rotary_factor"):
        if key not in merged and key in text:
            merged[key] = text[key]
    read = _Reader(merged, "rope_parameters")
    section = merged.get("mrope_section", DEFAULT_MROPE_SECTION)
    if (
        not isinstance(section, (list, tuple))
        or len(section) != 3
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in section)
    ):
        raise ArtifactError(f"field 'mrope_section' must be three non-negative integers, got {section!r}")
    factor = read.number("partial_rotary_factor", 0.25)
    if factor > 1:
        raise ArtifactError(f"field 'partial_rotary_factor' must be <= 1, got {factor}")
    return dict(
        rope_theta=read.number("rope_theta"),
        partial_rotary_factor=factor,
        mrope_section=tuple(section),
        mrope_interleaved=read.flag("mrope_interleaved", True),
    )


def _tie_word_embeddings(config: Mapping[str, Any], text: Mapping[str, Any]) -> bool:
    """transformers ties by the top-level flag; a nested-only flag is used when the top level has none."""
    value = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if not isinstance(value, bool):
        raise ArtifactError(f"field 'tie_word_embeddings' must be true or false, got {value!r}")
    return value


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ArtifactError(f"field 'eos_token_id' must be an integer or a list of integers, got {value!r}")
    return tuple(values)
