"""Concatenated input projections: one GEMM per layer input instead of three or four.

For every decoder layer the projections that read the same normed input are stored as row blocks of one tensor,
and the per-projection weights of the model become views of those blocks, so nothing is held twice:

* Gated DeltaNet: ``[in_proj_qkv | in_proj_z | in_proj_b | in_proj_a]``
* full attention: ``[q_proj (query+gate interleaved) | k_proj | v_proj]``
* dense MLP: ``[gate_proj | up_proj]``
* MoE: ``[router | shared gate_proj | shared up_proj | shared_expert_gate]``
"""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from ninfer.plugins.qwen3_5.model.layers import (
    DecoderLayerWeights,
    DenseMLPWeights,
    FullAttentionWeights,
    GatedDeltaNetWeights,
    MoEWeights,
)
from ninfer.plugins.qwen3_5.model.model import Qwen35Model


@attrs.frozen
class FusedProjections:
    """One layer's concatenated mixer-input and FFN-input projections (``[out, hidden]`` each)."""

    mixer_in: torch.Tensor
    ffn_in: torch.Tensor


def _concatenate(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One contiguous tensor of the row blocks, and a view of it for every part."""
    fused = torch.cat(parts, dim=0)
    views, start = [], 0
    for part in parts:
        views.append(fused[start : start + part.shape[0]])
        start += part.shape[0]
    return fused, views


def fuse_layer(layer: DecoderLayerWeights) -> tuple[DecoderLayerWeights, FusedProjections]:
    """The layer with its input projections re-pointed into fused tensors, and those fused tensors."""
    mixer = layer.mixer
    if isinstance(mixer, GatedDeltaNetWeights):
        mixer_in, (qkv, z, b, a) = _concatenate([mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a])
        mixer = attrs.evolve(mixer, in_proj_qkv=qkv, in_proj_z=z, in_proj_b=b, in_proj_a=a)
    elif isinstance(mixer, FullAttentionWeights):
        mixer_in, (q, k, v) = _concatenate([mixer.q_proj, mixer.k_proj, mixer.v_proj])
        mixer = attrs.evolve(mixer, q_proj=q, k_proj=k, v_proj=v)
    else:
        raise TypeError(f"unknown mixer weights {type(mixer).__name__}")
    mlp = layer.mlp
    if isinstance(mlp, DenseMLPWeights):
        ffn_in, (gate, up) = _concatenate([mlp.gate_proj, mlp.up_proj])
        mlp = attrs.evolve(mlp, gate_proj=gate, up_proj=up)
    else:
        ffn_in, (router, shared_gate, shared_up, shared_expert_gate) = _concatenate(
            [mlp.router, mlp.shared_gate, mlp.shared_up, mlp.shared_expert_gate]
        )
        mlp = attrs.evolve(
            mlp, router=router, shared_gate=shared_gate, shared_up=shared_up, shared_expert_gate=shared_expert_gate
        )
    return attrs.evolve(layer, mixer=mixer, mlp=mlp), FusedProjections(mixer_in=mixer_in, ffn_in=ffn_in)


def fuse_model(
    model: Qwen35Model, on_layer: Callable[[int, DecoderLayerWeights], None] | None = None
) -> tuple[Qwen35Model, tuple[FusedProjections, ...]]:
    """The model with every layer fused (``fuse_layer``) and the per-layer fused tensors.

    ``on_layer(index, fused_layer)`` runs after each layer, e.g. to re-point another holder of the old tensors at the
    new views so that the originals can be freed early.
    """
    layers, fused = [], []
    for index, layer in enumerate(model.layers):
        new_layer, projections = fuse_layer(layer)
        layers.append(new_layer)
        fused.append(projections)
        if on_layer is not None:
            on_layer(index, new_layer)
    return attrs.evolve(model, layers=tuple(layers)), tuple(fused)


def moe_widths(weights: MoEWeights) -> tuple[int, int]:
    """``(num_experts, shared_inner)``: where the router logits and the shared gate/up blocks end in ``ffn_in``."""
    return weights.router.shape[0], weights.shared_gate.shape[0]
