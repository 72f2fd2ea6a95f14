"""The Qwen3.5 decoder layer kinds over a flat batch of rows: Gated DeltaNet, gated full attention, dense/MoE FFN.

Tokens of all rows are concatenated (``[T, H]``); projections and FFNs run over all of them at once. The
recurrent part runs per group of rows with the same number of new tokens (one group for a decode or verify batch),
and attention reads/writes the paged KV pool.

Each layer kind has two forms over the same weights: the pure-torch reference (the CPU path and the oracle) and, with
``fused=True``, the CUDA prefill form: one GEMM for the projections that read the same input when the weights are
row blocks of one fused tensor (``ninfer.plugins.qwen3_5.model.fused``), and the norms, gates and activations as the Triton
row kernels of ``ninfer.kernels.triton.norms`` / ``attention`` (imported on first use: CPU installs lack triton).

Every projection goes through ``quantized.linear`` (a weight may be a quantized record; the fused CUDA form only ever
sees plain weights: quantized ones are refused on CUDA at load).
"""

from __future__ import annotations

import itertools
from typing import Sequence

import attrs
import torch
import torch.nn.functional as F

from ninfer.kernels.reference.attention import paged_slot_mapping, write_paged_kv
from ninfer.kernels.reference.conv import causal_conv1d
from ninfer.kernels.reference.gated_delta import recurrent_gated_delta_rule
from ninfer.kernels.reference.moe import swiglu
from ninfer.kernels.reference.norms import gated_rms_norm, rms_norm
from ninfer.kernels.reference.prefill import (
    moe_feed_forward,
    prefill_attention,
    prefill_causal_conv1d,
    prefill_gated_delta_rule,
)
from ninfer.kernels.reference.rope import apply_rotary
from ninfer.plugins.qwen3_5.model.config import Qwen35TextConfig
from ninfer.plugins.qwen3_5.model.quantized import Weight, dense, linear
from ninfer.quant.kv_codecs import KVCodec

RECURRENT_MAX_TOKENS = 4  # groups of at most this many new tokens use the token-by-token delta rule


@attrs.frozen
class RowGroup:
    """Rows with the same number of new tokens: ``token_index [B, L]`` into the flat batch, ``slots [B]``.

    ``span``: ``(start, stop)`` when the group's tokens are one run of the flat batch in row order (consecutive
    rows), so they are read and written as a slice instead of gathered by index. ``updates [B]`` bool: the rows
    whose state slot takes the new state (None: all; ``ForwardBatch.state_update_stops``).
    """

    token_index: torch.Tensor
    slots: torch.Tensor
    span: tuple[int, int] | None = None
    updates: torch.Tensor | None = None

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The group's tokens of ``x [T, ...]`` as ``[B, L, ...]``: a view for a span, else a gathered copy."""
        if self.span is None:
            return x[self.token_index]
        start, stop = self.span
        return x[start:stop].view(*self.token_index.shape, *x.shape[1:])

    def put(self, destination: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``value [B, L, ...]`` to the group's tokens of ``destination [T, ...]``."""
        if self.span is None:
            destination[self.token_index] = value
        else:
            start, stop = self.span
            destination[start:stop] = value.reshape(stop - start, *value.shape[2:])


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
        state_update_mask: torch.Tensor | None = None,
    ) -> "BatchLayout":
        lens = [int(n) for n in query_lens]
        starts = list(itertools.accumulate(lens, initial=0))[:-1]
        groups = []
        if state_slots is not None:
            slots = state_slots.to(device=device, dtype=torch.int64)
            updates = None if state_update_mask is None else state_update_mask.to(device)
            for length in sorted(set(lens)):
                members = [row for row, n in enumerate(lens) if n == length]
                rows = torch.tensor(members, device=device)
                first = torch.tensor(starts, device=device)[rows]
                index = first[:, None] + torch.arange(length, device=device)[None, :]
                consecutive = members == list(range(members[0], members[-1] + 1))
                span = (starts[members[0]], starts[members[0]] + len(members) * length) if consecutive else None
                groups.append(RowGroup(index, slots[rows], span, None if updates is None else updates[rows]))
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
    in_proj_qkv: Weight
    in_proj_z: Weight
    in_proj_b: Weight
    in_proj_a: Weight
    conv_weight: torch.Tensor  # [conv_dim, K]
    dt_bias: torch.Tensor  # fp32
    decay_rate: torch.Tensor  # -exp(A_log), fp32
    norm: torch.Tensor
    out_proj: Weight


@attrs.frozen
class FullAttentionWeights:
    q_proj: Weight  # query and output gate interleaved per head
    k_proj: Weight
    v_proj: Weight
    o_proj: Weight
    q_norm: torch.Tensor
    k_norm: torch.Tensor


@attrs.frozen
class DenseMLPWeights:
    gate_proj: Weight
    up_proj: Weight
    down_proj: Weight


@attrs.frozen
class MoEWeights:
    router: torch.Tensor
    gate_up: Weight
    down: Weight
    shared_gate: Weight
    shared_up: Weight
    shared_down: Weight
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


def stacked_rows(weights: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One ``[sum of rows, in]`` view over ``[out_i, in]`` weights that are consecutive row blocks of one contiguous
    tensor (as ``fuse_model`` leaves a layer's input projections), else None."""
    first = weights[0]
    columns, storage, offset = first.shape[-1], first.untyped_storage().data_ptr(), first.storage_offset()
    for weight in weights:
        if (
            weight.dim() != 2
            or weight.shape[1] != columns
            or weight.dtype != first.dtype
            or not weight.is_contiguous()
            or weight.untyped_storage().data_ptr() != storage
            or weight.storage_offset() != offset
        ):
            return None
        offset += weight.numel()
    return first.as_strided((sum(w.shape[0] for w in weights), columns), (columns, 1))


def stacked_linear(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``x`` through every weight, outputs side by side: one GEMM when the weights are stacked (``stacked_rows``)."""
    stacked = stacked_rows(weights)
    if stacked is None:
        return torch.cat([linear(x, weight) for weight in weights], dim=-1)
    return F.linear(x, stacked)


def gated_deltanet(
    weights: GatedDeltaNetWeights,
    config: Qwen35TextConfig,
    x: torch.Tensor,
    layout: BatchLayout,
    conv_cache: torch.Tensor,
    ssm_cache: torch.Tensor,
    capture: RecurrentCapture | None = None,
    *,
    fused: bool = False,
) -> torch.Tensor:
    """The linear-attention mixer over ``x [T, H]``; reads and updates the rows' conv windows and SSM states.

    ``fused``: z, b and a come from one GEMM and the output norm is the Triton ``gated_rms_norm`` (CUDA prefill).
    """
    tokens = x.shape[0]
    value_dim, heads_v = config.linear_value_dim, config.linear_num_value_heads
    mixed = linear(x, weights.in_proj_qkv)
    gate_weights = (weights.in_proj_z, weights.in_proj_b, weights.in_proj_a)
    if fused:
        z, b, a = torch.split(stacked_linear(x, gate_weights), [value_dim, heads_v, heads_v], dim=-1)
    else:
        z, b, a = (linear(x, weight) for weight in gate_weights)
    gate_z = z.view(tokens, heads_v, config.linear_value_head_dim)
    beta = torch.sigmoid(b.float())
    decay = weights.decay_rate * F.softplus(a.float() + weights.dt_bias)
    core = _recurrent_core(weights, config, mixed, decay, beta, layout, conv_cache, ssm_cache, capture)
    if fused:
        from ninfer.kernels.triton.norms import gated_rms_norm as triton_gated_rms_norm

        normed = triton_gated_rms_norm(core, gate_z, weights.norm, config.rms_norm_eps)
    else:
        normed = gated_rms_norm(core, gate_z, weights.norm, config.rms_norm_eps)
    return linear(normed.reshape(tokens, value_dim), weights.out_proj)


def _recurrent_core(
    weights: GatedDeltaNetWeights,
    config: Qwen35TextConfig,
    mixed: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    layout: BatchLayout,
    conv_cache: torch.Tensor,
    ssm_cache: torch.Tensor,
    capture: RecurrentCapture | None,
) -> torch.Tensor:
    """Conv + gated delta rule of every row group over ``mixed [T, conv_dim]``: ``core [T, Hv, Dv]``.

    A group that is the whole batch in row order (a single prefill row) hands its output over as is.
    """
    tokens = mixed.shape[0]
    core_shape = (tokens, config.linear_num_value_heads, config.linear_value_head_dim)
    inputs = (mixed, decay, beta, conv_cache, ssm_cache, capture)
    if len(layout.groups) == 1 and layout.groups[0].span == (0, tokens):
        return _recurrent_group(weights, config, layout.groups[0], *inputs).reshape(core_shape)
    core = mixed.new_empty(core_shape)
    for group in layout.groups:
        group.put(core, _recurrent_group(weights, config, group, *inputs))
    return core


def _recurrent_group(
    weights: GatedDeltaNetWeights,
    config: Qwen35TextConfig,
    group: RowGroup,
    mixed: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    conv_cache: torch.Tensor,
    ssm_cache: torch.Tensor,
    capture: RecurrentCapture | None,
) -> torch.Tensor:
    """One row group's conv and delta rule: its output ``[B, L, Hv, Dv]``; its cache slots (and capture) updated."""
    key_dim, value_dim = config.linear_key_dim, config.linear_value_dim
    heads_k, heads_v = config.linear_num_key_heads, config.linear_num_value_heads
    slots = group.slots
    batch, length = group.token_index.shape
    rows = group.take(mixed)
    if capture is None:
        conv_out, conv_state = prefill_causal_conv1d(rows, weights.conv_weight, conv_cache[slots])
    else:
        conv_out, conv_state, conv_states = causal_conv1d(
            rows, weights.conv_weight, conv_cache[slots], output_states=True
        )
    q, k, v = torch.split(conv_out, [key_dim, key_dim, value_dim], dim=-1)
    q = q.reshape(batch, length, heads_k, config.linear_key_head_dim)
    k = k.reshape(batch, length, heads_k, config.linear_key_head_dim)
    v = v.reshape(batch, length, heads_v, config.linear_value_head_dim)
    initial = ssm_cache[slots]
    if capture is not None or length <= RECURRENT_MAX_TOKENS:
        out, final, states = recurrent_gated_delta_rule(
            q, k, v, group.take(decay), group.take(beta), initial, output_states=capture is not None
        )
    else:
        out, final = prefill_gated_delta_rule(q, k, v, group.take(decay), group.take(beta), initial)
    conv_state = conv_state.to(conv_cache.dtype)
    if group.updates is not None:  # masked rows keep their slot's state
        conv_state = torch.where(group.updates[:, None, None], conv_state, conv_cache[slots])
        final = torch.where(group.updates[:, None, None, None], final, ssm_cache[slots])
    conv_cache.index_copy_(0, slots, conv_state)
    ssm_cache.index_copy_(0, slots, final)
    if capture is not None:
        group.put(capture.conv, conv_states.to(capture.conv.dtype))
        group.put(capture.ssm, states)
    return out


def full_attention(
    weights: FullAttentionWeights,
    config: Qwen35TextConfig,
    x: torch.Tensor,
    rotary: tuple[torch.Tensor, torch.Tensor],
    layout: BatchLayout,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    codec: KVCodec | None = None,
) -> torch.Tensor:
    """Gated softmax attention over ``x [T, H]``: writes the new KV into the pages (through ``codec``, a quantized
    pool's, when set), attends, gates, projects."""
    tokens = x.shape[0]
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    query, gate = linear(x, weights.q_proj).view(tokens, heads, 2 * dim).chunk(2, dim=-1)
    key = linear(x, weights.k_proj).view(tokens, kv_heads, dim)
    value = linear(x, weights.v_proj).view(tokens, kv_heads, dim)
    query = rms_norm(query, weights.q_norm, config.rms_norm_eps, zero_centered=True)
    key = rms_norm(key, weights.k_norm, config.rms_norm_eps, zero_centered=True)
    cos, sin = rotary
    query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
    write_paged_kv(key_cache, value_cache, key, value, layout.slot_mapping, codec)
    attended = prefill_attention(
        query, key_cache, value_cache, layout.page_tables, layout.query_lens, layout.context_lens, scale=dim**-0.5,
        codec=codec,
    )
    gated = attended.reshape(tokens, heads * dim) * torch.sigmoid(gate.reshape(tokens, heads * dim))
    return linear(gated, weights.o_proj)


def full_attention_fused(
    weights: FullAttentionWeights,
    config: Qwen35TextConfig,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    layout: BatchLayout,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    codec: KVCodec | None = None,
) -> torch.Tensor:
    """``full_attention`` for CUDA prefill: one GEMM for q+gate/k/v, q/k norm + MRoPE + KV write in one Triton
    kernel, the sigmoid output gate in another. ``rope`` is ``(positions [3, T] with contiguous rows,
    inverse_frequencies, axis_of_frequency)`` of the model. Model-dtype pools only (no ``codec``)."""
    if codec is not None:
        raise ValueError(f"the fused CUDA prefill writes model-dtype KV pages, not {codec.name}")
    from ninfer.kernels.triton.attention import qk_norm_rope_write_kv
    from ninfer.kernels.triton.norms import sigmoid_gate

    tokens = x.shape[0]
    heads, dim = config.num_attention_heads, config.head_dim
    projected = stacked_linear(x, (weights.q_proj, weights.k_proj, weights.v_proj))
    positions, inverse_frequencies, axis_of_frequency = rope
    query = qk_norm_rope_write_kv(
        projected, weights.q_norm, weights.k_norm, positions, inverse_frequencies, axis_of_frequency,
        key_cache, value_cache, layout.slot_mapping, config.rms_norm_eps, query_heads=heads,
    )
    attended = prefill_attention(
        query, key_cache, value_cache, layout.page_tables, layout.query_lens, layout.context_lens, scale=dim**-0.5
    )
    gate = projected[:, : heads * 2 * dim].view(tokens, heads, 2 * dim)[:, :, dim:]
    return linear(sigmoid_gate(attended, gate).view(tokens, heads * dim), weights.o_proj)


def feed_forward(
    weights: DenseMLPWeights | MoEWeights, config: Qwen35TextConfig, x: torch.Tensor, *, fused: bool = False
) -> torch.Tensor:
    """The FFN block; ``fused``: a dense MLP's gate/up as one GEMM and the Triton ``silu_mul`` (CUDA prefill).

    The reference kernels take plain matrices, so quantized ones are dequantized for the call (``quantized.dense``).
    """
    if isinstance(weights, DenseMLPWeights):
        if fused:
            from ninfer.kernels.triton.norms import silu_mul

            return linear(silu_mul(stacked_linear(x, (weights.gate_proj, weights.up_proj))), weights.down_proj)
        return swiglu(x, *(dense(w, x.dtype) for w in (weights.gate_proj, weights.up_proj, weights.down_proj)))
    return moe_feed_forward(
        x,
        weights.router,
        dense(weights.gate_up, x.dtype),
        dense(weights.down, x.dtype),
        config.num_experts_per_tok,  # type: ignore[arg-type]
        shared_gate=dense(weights.shared_gate, x.dtype),
        shared_up=dense(weights.shared_up, x.dtype),
        shared_down=dense(weights.shared_down, x.dtype),
        shared_expert_gate=weights.shared_expert_gate,
    )


def finish_layer(
    weights: DecoderLayerWeights, config: Qwen35TextConfig, residual: torch.Tensor, mixed: torch.Tensor
) -> torch.Tensor:
    """Add the mixer output to the residual stream, then the pre-normed FFN block."""
    hidden = residual + mixed
    normed = rms_norm(hidden, weights.post_attention_layernorm, config.rms_norm_eps, zero_centered=True)
    return hidden + feed_forward(weights.mlp, config, normed)
