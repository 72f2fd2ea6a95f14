"""Tiny random-weight Qwen3.5 checkpoints of the real architecture (dense or MoE, optional MTP / DFlash / DFlash2
companions) for tests and demos.

The structure is the real one at toy width: 8 layers (3 Gated-DeltaNet + 1 full attention, twice), GQA, grouped
value heads, partial interleaved MRoPE, a small vision tower, the real padded vocabulary (the real tokenizer's ids
reach 248076) and the real special token ids. Weights are deterministic from the seed. A DFlash companion is a
z-lab-shaped drafter (one sliding-window and one full layer, block 16, three target layers, the Qwen3.5 mask id). A
DFlash2 companion has the same trunk with block 8 (as the released Qwen3.8 drafter), two-tap convolutions in groups
of 16 channels and a rank-16, top-16 candidate selector.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ninfer.core.artifact.tiny import TinyModel
from ninfer.core.errors import ConfigError
from ninfer.plugins.qwen3_5.frontend.templates import DEFAULT_TEMPLATE, artifact_resources
from ninfer.plugins.qwen3_5.model.config import DENSE_CONDITIONAL, MOE_CONDITIONAL
from ninfer.plugins.qwen3_5.model.weights import expected_weights
from ninfer.plugins.qwen3_5.speculative.companion import COMPANION_CONFIGS, DFlash2Config, DFlashConfig

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.artifact.tiny import TinyOptions

VOCAB_SIZE = 248320
END_OF_TEXT = 248044
IM_END = 248046
_INIT_STD = 0.02
DFLASH_MASK_TOKEN = 248070
_SELECTOR_STD = 0.5
_FAMILIES = {"qwen3_5": DENSE_CONDITIONAL, "qwen3_5_moe": MOE_CONDITIONAL}


def tiny_config(family: str, *, mtp: bool) -> dict[str, Any]:
    """A full HF-style ``config.json`` (with ``text_config`` and ``vision_config``) of a tiny model."""
    if family not in _FAMILIES:
        raise ConfigError(f"unknown tiny model family {family!r}; expected one of {sorted(_FAMILIES)}", param="family")
    moe = family == "qwen3_5_moe"
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    text: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "layer_types": layer_types * 2,
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10_000_000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],  # [11, 11, 10] scaled to the 4 frequencies of rotary dim 8
            "mrope_interleaved": True,
        },
        "partial_rotary_factor": 0.25,
        "attention_bias": False,
        "attn_output_gate": True,
        "tie_word_embeddings": False,
        "mtp_num_hidden_layers": 1 if mtp else 0,
        "mtp_use_dedicated_embeddings": False,
        "mamba_ssm_dtype": "float32",
        "initializer_range": _INIT_STD,
        "eos_token_id": END_OF_TEXT,
        "dtype": "bfloat16",
    }
    if moe:
        text.update(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            router_aux_loss_coef=0.001,
        )
    else:
        text["intermediate_size"] = 128
    vision = {
        "model_type": "qwen3_5_moe_vision" if moe else "qwen3_5_vision",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "patch_size": 16,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 64,
        "hidden_act": "gelu_pytorch_tanh",
        "deepstack_visual_indexes": [],
    }
    return {
        "architectures": [_FAMILIES[family]],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": False,
    }


def _init_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Real-style initialisation: zero-centred norms near 0, GDN output norm near 1, A/dt like HF, linears N(0, .02)."""
    if name.endswith("linear_attn.A_log"):
        return torch.empty(shape).uniform_(0.01, 16, generator=generator).log_()
    if name.endswith("linear_attn.dt_bias"):
        return torch.ones(shape)
    if name.endswith("linear_attn.conv1d.weight"):
        bound = 1.0 / math.sqrt(shape[-1])
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)
    noise = torch.randn(shape, generator=generator) * _INIT_STD
    if name.endswith("linear_attn.norm.weight"):
        return 1.0 + noise
    if name.startswith("model.visual.") and ".norm" in name:  # LayerNorms: weight 1, bias 0
        return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
    return noise


def tiny_dflash_config(text: dict[str, Any]) -> dict[str, Any]:
    """A z-lab-style DFlash drafter ``config.json`` for a tiny target with text config ``text``."""
    layers = int(text["num_hidden_layers"])
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": text["hidden_size"],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000_000,
        "rope_scaling": None,
        "max_position_embeddings": 262144,
        "vocab_size": text["vocab_size"],
        "tie_word_embeddings": False,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 8,
        "block_size": 16,
        "num_target_layers": layers,
        "is_causal": False,
        "dflash_config": {"mask_token_id": DFLASH_MASK_TOKEN, "target_layer_ids": [1, (layers - 1) // 2, layers - 3]},
        "dtype": "bfloat16",
    }


def tiny_dflash_tensors(config: dict[str, Any], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random drafter tensors (z-lab names): plain-RMSNorm weights near 1, linears N(0, .02)."""
    shapes = DFlashConfig.from_dict(config, "tiny DFlash config").tensor_shapes()
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator) * _INIT_STD
        tensors[name] = (1.0 + noise if name.endswith("norm.weight") else noise).to(torch.bfloat16)
    return tensors


def tiny_dflash2_config(text: dict[str, Any]) -> dict[str, Any]:
    """A DFlash2 drafter ``config.json`` for a tiny target: the DFlash trunk, block 8 in ``dflash_config``, the
    released conv and softcap settings and a small selector rank."""
    config = tiny_dflash_config(text)
    del config["block_size"]
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"] = {
        **config["dflash_config"],
        "block_size": 8,
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 16,
        "selector_top_k": 16,
        "output_multiplier": 1.0,
        "final_logit_softcapping": 20.0,
    }
    return config


def tiny_dflash2_tensors(config: dict[str, Any], generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random DFlash2 drafter tensors (z-lab names): DFlash's, convolutions near the identity (tap 0 of each base
    kernel near 1) and selector codebooks large enough that the pairwise term can overrule the unary logits."""
    shapes = DFlash2Config.from_dict(config, "tiny DFlash2 config").tensor_shapes()
    tensors = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator) * _INIT_STD
        if name.endswith("norm.weight"):
            noise = 1.0 + noise
        elif name.endswith("base_kernel"):
            noise[:, 0] += 1.0
        elif name.endswith("_codebook"):
            noise = noise * (_SELECTOR_STD / _INIT_STD)
        tensors[name] = noise.to(torch.bfloat16)
    return tensors


def make_tiny(options: "TinyOptions") -> TinyModel:
    """A tiny model of ``options.family`` (with MTP weights if ``options.mtp``, a DFlash companion if
    ``options.dflash``, a DFlash2 companion if ``options.dflash2``), deterministic from ``options.seed``."""
    config = tiny_config(options.family, mtp=bool(options.mtp))
    generator = torch.Generator().manual_seed(int(options.seed))
    tensors = {
        name: _init_tensor(name, shape, generator).to(torch.bfloat16)
        for name, shape in expected_weights(config).items()
    }
    drafters = {
        "dflash": (tiny_dflash_config, tiny_dflash_tensors),
        "dflash2": (tiny_dflash2_config, tiny_dflash2_tensors),
    }
    for name, (make_config, make_tensors) in drafters.items():
        if getattr(options, name, False):
            drafter = make_config(config["text_config"])
            config.setdefault(COMPANION_CONFIGS, {})[name] = drafter
            tensors.update({f"{name}.{tensor}": value for tensor, value in make_tensors(drafter, generator).items()})
    return TinyModel(
        architecture=config["architectures"][0],
        config=config,
        tensors=tensors,
        generation_defaults={"eos_token_ids": [IM_END, END_OF_TEXT], "temperature": 1.0, "top_p": 0.95, "top_k": 20},
        resources=artifact_resources(getattr(options, "template", DEFAULT_TEMPLATE)),
    )
