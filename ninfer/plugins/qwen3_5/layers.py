"""The Qwen3.5 decoder layer kinds over a flat batch of rows: Gated DeltaNet, gated full attention, dense/MoE FFN.

Tokens of all rows are concatenated (``[T, H]``); projections and FFNs run over all of them at once. The
recurrent part runs per group of rows with the same number of new tokens (one group for a decode or verify batch),
and attention reads/writes the paged KV pool.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import attrs
import torch
import torch.nn.functional as F

from ninfer.kernels.attention import paged_slot_mapping, write_paged_kv
from ninfer.kernels.conv import causal_conv1d
from ninfer.kernels.gated_delta import recurrent_gated_delta_rule
from ninfer.kernels.moe import swiglu
from ninfer.kernels.norms import gated_rms_norm, rms_norm
from ninfer.kernels.prefill import (
    moe_feed_forward,
    prefill_attention,
    prefill_causal_conv1d,
    prefill_gated_delta_rule,
)
from ninfer.kernels.rope import apply_rotary
from ninfer.plugins.qwen3_5.config import Qwen35TextConfig

RECURRENT_MAX_TOKENS = 4  # groups of at most this many new tokens use the token-by-token delta rule


@attrs.frozen
class RowGroup:
    """Rows with the same number of new tokens: ``token_index [B, L]`` into the flat batch, ``slots [B]``."""

    token_index: torch.Tensor
    slots: torch.Tensor


@attrs.frozen
class BatchLayout:
    """Where each row's new tokens sit in the flat batch and in the caches."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    page_tables: torch.Tensor
    slot_mapping: torch.Tensor  # [T] flat KV slot of every new token
    groups: tuple[RowGroup, ...]
    last_token_index: torch.Tensor  # [R]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        page_tables: torch.Tensor,
        page_size: int,
        state_slots: torch.Tensor | None,
        device: torch.device,
    ) -> "BatchLayout":
        lens = [int(n) for n in query_lens]
        starts = list(itertools.accumulate(lens, initial=0))[:-1]
        groups = []
        if state_slots is not None:
            slots = state_slots.to(device=device, dtype=torch.int64)
            for length in sorted(set(lens)):
                rows = torch.tensor([row for row, n in enumerate(lens) if n == length], device=device)
                first = torch.tensor(starts, device=device)[rows]
                index = first[:, None] + torch.arange(length, device=device)[None, :]
                groups.append(RowGroup(index, slots[rows]))
        page_tables = page_tables.to(device)
        return cls(
            query_lens=tuple(lens),
            context_lens=tuple(int(n) for n in context_lens),
            page_tables=page_tables,
            slot_mapping=paged_slot_mapping(page_tables, lens, context_lens, page_size),
            groups=tuple(groups),
            last_token_index=torch.tensor([s + n - 1 for s, n in zip(starts, lens)], device=device, dtype=torch.int64),
        )


@attrs.frozen
class GatedDeltaNetWeights:
    in_proj_qkv: torch.Tensor
    in_proj_z: torch.Tensor
    in_proj_b: torch.Tensor
    in_proj_a: torch.Tensor
    conv_weight: torch.Tensor  # [conv_dim, K]
    dt_bias: torch.Tensor  # fp32
    decay_rate: torch.Tensor  # -exp(A_log), fp32
    norm: torch.Tensor
    out_proj: torch.Tensor


@attrs.frozen
class FullAttentionWeights:
    q_proj: torch.Tensor  # query and output gate interleaved per head
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@attrs.frozen
class DenseMLPWeights:
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor


@attrs.frozen
class MoEWeights:
    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    shared_gate: torch.Tensor
    shared_up: torch.Tensor
    shared_down: torch.Tensor
    shared_expert_gate: torch.Tensor


@attrs.frozen
class DecoderLayerWeights:
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    mixer: GatedDeltaNetWeights | FullAttentionWeights
    mlp: DenseMLPWeights | MoEWeights


@attrs.define
class RecurrentCapture:
    """Per-token states of one recurrent layer being filled: ``conv [T, C, K-1]``, ``ssm [T, Hv, Dk, Dv]``."""

    conv: torch.Tensor
    ssm: torch.Tensor


def gated_deltanet(
    weights: GatedDeltaNetWeights,
    config: Qwen35TextConfig,
    x: torch.Tensor,
    layout: BatchLayout,
    conv_cache: torch.Tensor,
    ssm_cache: torch.Tensor,
    capture: RecurrentCapture | None = None,
) -> torch.Tensor:
    """The linear-attention mixer over ``x [T, H]``; reads and updates the rows' conv windows and SSM states."""
    tokens = x.shape[0]
    key_dim, value_dim = config.linear_key_dim, config.linear_value_dim
    heads_k, heads_v = config.linear_num_key_heads, config.linear_num_value_heads
    mixed = F.linear(x, weights.in_proj_qkv)
    gate_z = F.linear(x, weights.in_proj_z).view(tokens, heads_v, config.linear_value_head_dim)
    beta = torch.sigmoid(F.linear(x, weights.in_proj_b).float())
    decay = weights.decay_rate * F.softplus(F.linear(x, weights.in_proj_a).float() + weights.dt_bias)
    core = x.new_empty((tokens, heads_v, config.linear_value_head_dim))
    for group in layout.groups:
        index, slots = group.token_index, group.slots
        batch, length = index.shape
        use_recurrent = capture is not None or length <= RECURRENT_MAX_TOKENS
        if capture is None:
            conv_out, conv_state = prefill_causal_conv1d(mixed[index], weights.conv_weight, conv_cache[slots])
        else:
            conv_out, conv_state, conv_states = causal_conv1d(
                mixed[index], weights.conv_weight, conv_cache[slots], output_states=True
            )
        q, k, v = torch.split(conv_out, [key_dim, key_dim, value_dim], dim=-1)
        q = q.reshape(batch, length, heads_k, config.linear_key_head_dim)
        k = k.reshape(batch, length, heads_k, config.linear_key_head_dim)
        v = v.reshape(batch, length, heads_v, config.linear_value_head_dim)
        initial = ssm_cache[slots]
        if use_recurrent:
            out, final, states = recurrent_gated_delta_rule(
                q, k, v, decay[index], beta[index], initial, output_states=capture is not None
            )
        else:
            out, final = prefill_gated_delta_rule(q, k, v, decay[index], beta[index], initial)
            states = None
        core[index] = out
        conv_cache.index_copy_(0, slots, conv_state.to(conv_cache.dtype))
        ssm_cache.index_copy_(0, slots, final)
        if capture is not None:
            capture.conv[index] = conv_states.to(capture.conv.dtype)
            capture.ssm[index] = states
    normed = gated_rms_norm(core, gate_z, weights.norm, config.rms_norm_eps)
    return F.linear(normed.reshape(tokens, value_dim), weights.out_proj)


def full_attention(
    weights: FullAttentionWeights,
    config: Qwen35TextConfig,
    x: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    layout: BatchLayout,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
) -> torch.Tensor:
    """Gated softmax attention over ``x [T, H]``: writes the new KV into the pages, attends, gates, projects."""
    tokens = x.shape[0]
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    query, gate = F.linear(x, weights.q_proj).view(tokens, heads, 2 * dim).chunk(2, dim=-1)
    key = F.linear(x, weights.k_proj).view(tokens, kv_heads, dim)
    value = F.linear(x, weights.v_proj).view(tokens, kv_heads, dim)
    query = rms_norm(query, weights.q_norm, config.rms_norm_eps, zero_centered=True)
    key = rms_norm(key, weights.k_norm, config.rms_norm_eps, zero_centered=True)
    cos, sin = rotary
    query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
    write_paged_kv(key_cache, value_cache, key, value, layout.slot_mapping)
    attended = prefill_attention(
        query, key_cache, value_cache, layout.page_tables, layout.query_lens, layout.context_lens, scale=dim**-0.5
    )
    gated = attended.reshape(tokens, heads * dim) * torch.sigmoid(gate.reshape(tokens, heads * dim))
    return F.linear(gated, weights.o_proj)


def feed_forward(weights: DenseMLPWeights | MoEWeights, config: Qwen35TextConfig, x: torch.Tensor) -> torch.Tensor:
    if isinstance(weights, DenseMLPWeights):
        return swiglu(x, weights.gate_proj, weights.up_proj, weights.down_proj)
    return moe_feed_forward(
        x,
        weights.router,
        weights.gate_up,
        weights.down,
        config.num_experts_per_tok,  # type: ignore[arg-type]
        shared_gate=weights.shared_gate,
        shared_up=weights.shared_up,
        shared_down=weights.shared_down,
        shared_expert_gate=weights.shared_expert_gate,
    )


def finish_layer(
    weights: DecoderLayerWeights, config: Qwen35TextConfig, residual: torch.Tensor, mixed: torch.Tensor
) -> torch.Tensor:
    """Add the mixer output to the residual stream, then the pre-normed FFN block."""
    hidden = residual + mixed
    normed = rms_norm(hidden, weights.post_attention_layernorm, config.rms_norm_eps, zero_centered=True)
    return hidden + feed_forward(weights.mlp, config, normed)
