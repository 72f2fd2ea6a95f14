"""Name -> shape of every tensor of a Qwen3.5 checkpoint, in the real Hugging Face naming.

The one source of truth shared by the converter (checks a checkpoint), the loader and ``make-tiny``.
``Qwen3_5(Moe)ForConditionalGeneration``: text model under ``model.language_model.``, ``lm_head.weight`` (unless tied),
``mtp.*`` when ``mtp_num_hidden_layers > 0`` and ``model.visual.*`` when a ``vision_config`` is present.
``Qwen3_5(Moe)ForCausalLM``: text model under ``model.`` plus ``lm_head.weight`` (unless tied).
"""

from __future__ import annotations

from typing import Any, Mapping

from ninfer.core.errors import ArtifactError
from ninfer.plugins.qwen3_5.model.config import FULL_ATTENTION, Qwen35TextConfig

Shapes = dict[str, tuple[int, ...]]
MTP_PREFIX = "mtp."
VISUAL_PREFIX = "model.visual."
_VISION_DEFAULTS = {  # transformers' Qwen3_5VisionConfig defaults
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}


#: How the projection matrices ``ninfer convert --quantize`` encodes end; the runtime applies each through
#: ``quantized.linear``. Kept dense: the embedding and lm_head (a lookup, and the speculative drafters' vocabulary head),
#: the norms, the GDN a/b projections (one row per value head: tiny, and they feed the decay and the gate), the conv,
#: A_log and dt_bias, the MoE router and shared-expert gate (routing decisions), and the vision tower.
_QUANTIZABLE_ENDINGS = (
    ".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight",
    ".in_proj_qkv.weight", ".in_proj_z.weight", ".out_proj.weight",
    ".gate_proj.weight", ".up_proj.weight", ".down_proj.weight", ".experts.gate_up_proj", ".experts.down_proj",
    f"{MTP_PREFIX}fc.weight",
)


def quantizable_weights(config: Mapping[str, Any]) -> list[str]:
    """The weights of a checkpoint with this config that ``convert --quantize`` encodes (the one policy)."""
    return [
        name for name in expected_weights(config)
        if name.endswith(_QUANTIZABLE_ENDINGS) and not name.startswith(VISUAL_PREFIX)
    ]


def expected_weights(
    config: Mapping[str, Any], *, architecture: str | None = None, text_only: bool = False
) -> Shapes:
    """Every tensor of a checkpoint with this config; ``text_only`` keeps the text model and lm_head only.

    ``architecture`` overrides ``config["architectures"][0]``.
    """
    text = Qwen35TextConfig.from_hf(config, architecture)
    shapes = text_model_weights(text)
    if not text_only and text.is_conditional_generation:
        shapes.update(mtp_weights(text))
        vision = config.get("vision_config")
        if vision:
            shapes.update(vision_weights(vision))
    return shapes


def text_model_weights(config: Qwen35TextConfig) -> Shapes:
    """The trunk: embeddings, decoder layers, final norm and (unless tied) ``lm_head.weight``."""
    prefix = config.text_prefix
    hidden = config.hidden_size
    shapes: Shapes = {f"{prefix}embed_tokens.weight": (config.vocab_size, hidden)}
    for index, kind in enumerate(config.layer_types):
        for name, shape in decoder_layer_weights(config, kind).items():
            shapes[f"{prefix}layers.{index}.{name}"] = shape
    shapes[f"{prefix}norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def mtp_weights(config: Qwen35TextConfig) -> Shapes:
    """The multi-token-prediction module (``mtp.*``); empty when ``mtp_num_hidden_layers`` is 0."""
    if config.mtp_num_hidden_layers == 0:
        return {}
    hidden = config.hidden_size
    shapes: Shapes = {
        f"{MTP_PREFIX}pre_fc_norm_embedding.weight": (hidden,),
        f"{MTP_PREFIX}pre_fc_norm_hidden.weight": (hidden,),
        f"{MTP_PREFIX}fc.weight": (hidden, 2 * hidden),
    }
    for index in range(config.mtp_num_hidden_layers):
        for name, shape in decoder_layer_weights(config, FULL_ATTENTION).items():
            shapes[f"{MTP_PREFIX}layers.{index}.{name}"] = shape
    shapes[f"{MTP_PREFIX}norm.weight"] = (hidden,)
    return shapes


def decoder_layer_weights(config: Qwen35TextConfig, kind: str) -> Shapes:
    """One decoder layer's tensors, named relative to the layer (``input_layernorm.weight``, ...)."""
    hidden = config.hidden_size
    shapes: Shapes = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    if kind == FULL_ATTENTION:
        query = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        shapes.update(
            {
                "self_attn.q_proj.weight": (2 * query, hidden),
                "self_attn.k_proj.weight": (kv, hidden),
                "self_attn.v_proj.weight": (kv, hidden),
                "self_attn.o_proj.weight": (hidden, query),
                "self_attn.q_norm.weight": (config.head_dim,),
                "self_attn.k_norm.weight": (config.head_dim,),
            }
        )
    else:
        value_heads = config.linear_num_value_heads
        shapes.update(
            {
                "linear_attn.in_proj_qkv.weight": (config.conv_dim, hidden),
                "linear_attn.in_proj_z.weight": (config.linear_value_dim, hidden),
                "linear_attn.in_proj_b.weight": (value_heads, hidden),
                "linear_attn.in_proj_a.weight": (value_heads, hidden),
                "linear_attn.conv1d.weight": (config.conv_dim, 1, config.linear_conv_kernel_dim),
                "linear_attn.dt_bias": (value_heads,),
                "linear_attn.A_log": (value_heads,),
                "linear_attn.norm.weight": (config.linear_value_head_dim,),
                "linear_attn.out_proj.weight": (hidden, config.linear_value_dim),
            }
        )
    shapes.update(_mlp_weights(config))
    return shapes


def _mlp_weights(config: Qwen35TextConfig) -> Shapes:
    hidden = config.hidden_size
    if not config.is_moe:
        inner = config.intermediate_size
        return {
            "mlp.gate_proj.weight": (inner, hidden),
            "mlp.up_proj.weight": (inner, hidden),
            "mlp.down_proj.weight": (hidden, inner),
        }
    experts, inner, shared = config.num_experts, config.moe_intermediate_size, config.shared_expert_intermediate_size
    return {
        "mlp.gate.weight": (experts, hidden),
        "mlp.experts.gate_up_proj": (experts, 2 * inner, hidden),
        "mlp.experts.down_proj": (experts, hidden, inner),
        "mlp.shared_expert.gate_proj.weight": (shared, hidden),
        "mlp.shared_expert.up_proj.weight": (shared, hidden),
        "mlp.shared_expert.down_proj.weight": (hidden, shared),
        "mlp.shared_expert_gate.weight": (1, hidden),
    }


def vision_weights(vision_config: Mapping[str, Any]) -> Shapes:
    """The vision tower (``model.visual.*``): Conv3d patch embed, learned positions, ViT blocks, 2x2 merger."""
    if not isinstance(vision_config, Mapping):
        raise ArtifactError(f"field 'vision_config' must be a JSON object, got {vision_config!r}")
    values: dict[str, int] = {}
    for key, default in _VISION_DEFAULTS.items():
        value = vision_config.get(key, default)
        if isinstance(value, (list, tuple)) and len(set(value)) == 1:  # patch sizes may be given per axis
            value = value[0]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ArtifactError(f"vision_config: field {key!r} must be a positive integer, got {value!r}")
        values[key] = value
    width, inner = values["hidden_size"], values["intermediate_size"]
    patch, merged = values["patch_size"], width * values["spatial_merge_size"] ** 2
    p = VISUAL_PREFIX
    shapes: Shapes = {
        f"{p}patch_embed.proj.weight": (width, values["in_channels"], values["temporal_patch_size"], patch, patch),
        f"{p}patch_embed.proj.bias": (width,),
        f"{p}pos_embed.weight": (values["num_position_embeddings"], width),
    }
    for index in range(values["depth"]):
        block = f"{p}blocks.{index}."
        shapes.update(
            {
                f"{block}norm1.weight": (width,),
                f"{block}norm1.bias": (width,),
                f"{block}norm2.weight": (width,),
                f"{block}norm2.bias": (width,),
                f"{block}attn.qkv.weight": (3 * width, width),
                f"{block}attn.qkv.bias": (3 * width,),
                f"{block}attn.proj.weight": (width, width),
                f"{block}attn.proj.bias": (width,),
                f"{block}mlp.linear_fc1.weight": (inner, width),
                f"{block}mlp.linear_fc1.bias": (inner,),
                f"{block}mlp.linear_fc2.weight": (width, inner),
                f"{block}mlp.linear_fc2.bias": (width,),
            }
        )
    shapes.update(
        {
            f"{p}merger.norm.weight": (width,),
            f"{p}merger.norm.bias": (width,),
            f"{p}merger.linear_fc1.weight": (merged, merged),
            f"{p}merger.linear_fc1.bias": (merged,),
            f"{p}merger.linear_fc2.weight": (values["out_hidden_size"], merged),
            f"{p}merger.linear_fc2.bias": (values["out_hidden_size"],),
        }
    )
    return shapes
