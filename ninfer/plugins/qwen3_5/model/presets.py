"""Named Qwen3.5-family text configurations for synthetic (random-weight) runs: benchmarks and smoke tests.

Each preset is a flat Hugging Face ``config.json`` mapping of the text model (``Qwen3_5ForCausalLM`` or
``Qwen3_5MoeForCausalLM``) that both ``Qwen35TextConfig.from_hf`` and transformers' text configs accept. The real
shapes come from ``shared/reference/qwen35.md`` §2; ``qwen3.5-9b-shape`` is transformers' default text config (a
9B-style shape, not a released checkpoint); ``tiny`` / ``tiny-moe`` are toy widths of the real structure for CPU.
"""

from __future__ import annotations

from typing import Any

from ninfer.core.errors import ConfigError
from ninfer.plugins.qwen3_5.model.config import DENSE_CAUSAL, MOE_CAUSAL

REAL_VOCAB_SIZE = 248320
END_OF_TEXT = 248044
IM_END = 248046
#: What a real Qwen3.6 checkpoint's ``generation_config.json`` gives a served model (the end-of-turn and
#: end-of-text ids, the card's sampling): a synthetic model is served with the same.
GENERATION_DEFAULTS: dict[str, Any] = {
    "eos_token_ids": [IM_END, END_OF_TEXT], "temperature": 1.0, "top_p": 0.95, "top_k": 20,
}
_ROPE = {
    "rope_type": "default",
    "rope_theta": 10_000_000,
    "partial_rotary_factor": 0.25,
    "mrope_section": [11, 11, 10],
    "mrope_interleaved": True,
}
_COMMON: dict[str, Any] = {
    "vocab_size": REAL_VOCAB_SIZE,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "head_dim": 256,
    "full_attention_interval": 4,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "rope_parameters": _ROPE,
    "eos_token_id": END_OF_TEXT,
}


def _dense(**fields: Any) -> dict[str, Any]:
    return {"architectures": [DENSE_CAUSAL], "model_type": "qwen3_5_text", **_COMMON, **fields}


def _moe(**fields: Any) -> dict[str, Any]:
    return {"architectures": [MOE_CAUSAL], "model_type": "qwen3_5_moe_text", **_COMMON, **fields}


_TINY_ROPE = {**_ROPE, "mrope_section": [2, 1, 1]}  # rotary dim 8 of head_dim 32
_TINY = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    rope_parameters=_TINY_ROPE,
)

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.6-27b": _dense(
        hidden_size=5120,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        intermediate_size=17408,
    ),
    "qwen3.6-35b-a3b": _moe(
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
    ),
    "qwen3.5-9b-shape": _dense(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        intermediate_size=12288,
    ),
    "tiny": _dense(**_TINY, intermediate_size=128),
    "tiny-moe": _moe(
        **_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
    ),
}


def preset_names(architectures: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """Every preset name, or those whose architecture is one of ``architectures`` (a family's presets)."""
    return tuple(
        name for name, config in PRESETS.items() if architectures is None or config["architectures"][0] in architectures
    )


def preset_config(name: str) -> dict[str, Any]:
    """A fresh copy of the named preset's flat text config; an unknown name is a ``ConfigError``."""
    if name not in PRESETS:
        raise ConfigError(f"unknown synthetic model {name!r}; expected one of {list(PRESETS)}", param="synthetic")
    preset = PRESETS[name]
    return {key: (dict(value) if isinstance(value, dict) else value) for key, value in preset.items()}
