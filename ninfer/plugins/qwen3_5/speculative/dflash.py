"""The DFlash block-diffusion drafter (``dflash.*``) over a Qwen3.5 target: context KV injection and block drafting.

A stack of Qwen3-style decoder layers (plain RMSNorm, QK-norm, 1-D RoPE over the whole head, SwiGLU) with no
embedding or lm_head of its own. The target's outputs at ``target_layer_ids`` for a committed token are
concatenated, fused by ``fc`` and ``hidden_norm`` into one context vector, and every draft layer projects that vector
with its own ``k_proj``/``v_proj`` (K gets ``k_norm`` and RoPE at the token's position) into its paged context KV;
context never enters the residual stream. A draft block ``[last token, MASK x k]`` at positions ``fed..fed+k`` then
runs once, non-causally: every block query sees the context KV and all block positions. Sliding-window layers only see
context keys less than ``sliding_window`` positions behind the query.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import attrs
import torch
import torch.nn.functional as F

from ninfer.core.errors import ConfigError
from ninfer.core.runtime import AttentionLayerSpec, KVCache, RuntimeSpec
from ninfer.kernels.reference.attention import write_paged_kv
from ninfer.kernels.reference.moe import swiglu
from ninfer.kernels.reference.norms import rms_norm
from ninfer.kernels.reference.rope import apply_rotary, rope_inverse_frequencies, rotary_cos_sin
from ninfer.plugins.qwen3_5.model.model import Qwen35Model, WeightLoader
from ninfer.plugins.qwen3_5.speculative.companion import (
    SLIDING_ATTENTION,
    DFlashConfig,
    companion_config,
    read_drafter_config,
)

DFLASH_PREFIX = "dflash."

TakeTensor = Callable[..., torch.Tensor]


@attrs.frozen
class DFlashLayer:
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate_proj: torch.Tensor
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    window: int | None  # sliding window, None for full attention


@attrs.frozen
class BlockRow:
    """One row of a draft block: its token ids, first position and the page ids of its context KV."""

    tokens: tuple[int, ...]
    start: int
    pages: Sequence[int]


@attrs.frozen
class DraftBlock:
    """The rows of one draft forward, prepared once for every layer: block tokens and positions concatenated by
    row, their rotary tables, each row's context page ids and each token's index within its row's block."""

    rows: Sequence[BlockRow]
    tokens: torch.Tensor
    rotary: tuple[torch.Tensor, torch.Tensor]
    pages: list[torch.Tensor]
    offsets: torch.Tensor


class DFlashModel:
    """The drafter's weights and forwards; ``spec`` describes its paged context KV (one attention layer per layer).

    Subclasses (DFlash2) name their own ``companion`` and config reader, add weights in :meth:`_from_weights` and
    reshape a layer in :meth:`_layer_forward`.
    """

    companion = "dflash"
    label = "DFlash"

    def __init__(self, target: Qwen35Model, config: DFlashConfig, fc: torch.Tensor, hidden_norm: torch.Tensor,
                 norm: torch.Tensor, layers: tuple[DFlashLayer, ...]) -> None:
        self.target = target
        self.config = config
        self.fc = fc
        self.hidden_norm = hidden_norm
        self.norm = norm
        self.layers = layers
        base = target.config.num_hidden_layers
        self.spec = RuntimeSpec(
            vocab_size=target.config.vocab_size,
            hidden_size=config.hidden_size,
            attention_layers=tuple(
                AttentionLayerSpec(base + index, config.num_key_value_heads, config.head_dim)
                for index in range(config.num_hidden_layers)
            ),
            recurrent_layers=(),
            dtype=target.dtype,
            device=target.device,
            max_position_embeddings=target.config.max_position_embeddings,
        )
        self._inverse_frequencies = rope_inverse_frequencies(config.head_dim, config.rope_theta, target.device)
        self._axis = torch.zeros(config.head_dim // 2, dtype=torch.int64, device=target.device)

    @classmethod
    def load(cls, loader: WeightLoader, target: Qwen35Model) -> Any:
        """The drafter of ``loader``'s artifact (an instance of ``cls``), or None when it carries no
        ``<companion>.*`` tensors and no config."""
        prefix = cls.companion + "."
        present = any(name.startswith(prefix) for name in loader.present)
        raw = companion_config(loader.artifact.manifest, cls.companion)
        if not present and raw is None:
            return None
        source = f"{loader.artifact.path} ({cls.companion} companion)"
        if raw is None:
            raise ConfigError(f"{source}: the artifact has {prefix}* tensors but no stored {cls.label} config")
        config = read_drafter_config(raw, cls.companion, source)
        trunk = target.config
        config.check_target(trunk.hidden_size, trunk.num_hidden_layers, trunk.vocab_size, source)
        expected = {prefix + name: shape for name, shape in config.tensor_shapes().items()}
        loader.check(expected)
        loader.check_no_extras(expected, within=prefix)
        return cls._from_weights(target, config, lambda name, dtype=None: loader.take(prefix + name, dtype))

    @classmethod
    def _from_weights(cls, target: Qwen35Model, config: Any, take: TakeTensor) -> Any:
        layers = load_layers(config, take)
        return cls(target, config, take("fc.weight"), take("hidden_norm.weight"), take("norm.weight"), layers)

    # -- pieces --------------------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.config.rms_norm_eps, zero_centered=False)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_cos_sin(positions, self._inverse_frequencies, self._axis)

    def _keys_values(
        self, layer: DFlashLayer, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        heads, dim = self.config.num_key_value_heads, self.config.head_dim
        key = self._norm(F.linear(x, layer.k_proj).view(-1, heads, dim), layer.k_norm)
        return apply_rotary(key, *rotary), F.linear(x, layer.v_proj).view(-1, heads, dim)

    # -- forwards ------------------------------------------------------------------------------------

    @torch.no_grad()
    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv: KVCache) -> None:
        """Fuse target features ``[N, K*H]`` of committed tokens at ``positions [N]`` and write every layer's
        context K/V at the flat KV ``slots [N]``."""
        device = self.target.device
        context = self._norm(F.linear(features.to(device, self.target.dtype), self.fc), self.hidden_norm)
        rotary = self._rotary(positions.to(device))
        for index, layer in enumerate(self.layers):
            key, value = self._keys_values(layer, context, rotary)
            write_paged_kv(kv.key[index], kv.value[index], key, value, slots.to(device))

    @torch.no_grad()
    def draft_hidden(self, rows: Sequence[BlockRow], kv: KVCache) -> torch.Tensor:
        """One non-causal forward over each row's block; returns the final-normed hidden states ``[T, H]`` of all
        block tokens (concatenated by row). Row ``r``'s context KV covers positions ``[0, start)``."""
        block = self._block(rows)
        x = self.target.embed(block.tokens)
        for index, layer in enumerate(self.layers):
            x = self._layer_forward(index, layer, x, block, kv)
        return self._norm(x, self.norm)

    def _block(self, rows: Sequence[BlockRow]) -> DraftBlock:
        device = self.target.device
        tokens = torch.tensor([t for row in rows for t in row.tokens], dtype=torch.int64, device=device)
        offsets = torch.tensor([i for row in rows for i in range(len(row.tokens))], dtype=torch.int64, device=device)
        starts = torch.tensor([row.start for row in rows for _ in row.tokens], dtype=torch.int64, device=device)
        pages = [torch.as_tensor(list(row.pages), dtype=torch.int64, device=device) for row in rows]
        return DraftBlock(rows, tokens, self._rotary(starts + offsets), pages, offsets)

    def _layer_forward(
        self, index: int, layer: DFlashLayer, x: torch.Tensor, block: DraftBlock, kv: KVCache
    ) -> torch.Tensor:
        """One draft layer over the block's residual stream ``x``: attention, then the SwiGLU MLP, pre-norm."""
        x = x + self._attention(index, layer, self._norm(x, layer.input_layernorm), block, kv)
        normed = self._norm(x, layer.post_attention_layernorm)
        return x + swiglu(normed, layer.gate_proj, layer.up_proj, layer.down_proj)

    def _attention(
        self, index: int, layer: DFlashLayer, normed: torch.Tensor, block: DraftBlock, kv: KVCache
    ) -> torch.Tensor:
        """Layer ``index``'s attention output (through ``o_proj``) for block inputs ``normed``: queries and the
        block's own K/V come from ``normed``, context K/V from the paged cache."""
        heads, dim = self.config.num_attention_heads, self.config.head_dim
        query = F.linear(normed, layer.q_proj).view(-1, heads, dim)
        query = apply_rotary(self._norm(query, layer.q_norm), *block.rotary)
        key, value = self._keys_values(layer, normed, block.rotary)
        attended = self._attend(
            block.rows, block.pages, query, key, value, kv.key[index], kv.value[index], layer.window
        )
        return F.linear(attended.reshape(-1, heads * dim), layer.o_proj)

    def _attend(
        self,
        rows: Sequence[BlockRow],
        pages: Sequence[torch.Tensor],
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        """Each row's block queries over its context KV (from its ``pages``) and all its block K/V; fp32 math."""
        heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[2]
        group = heads // kv_heads
        page_size = key_cache.shape[1]
        output = torch.empty_like(query)
        offset = 0
        for row, row_pages in zip(rows, pages):
            length = len(row.tokens)
            low = 0 if window is None else max(0, row.start - window + 1)  # what the block's first query sees
            context_positions = torch.arange(low, row.start, device=query.device)
            page_ids, within = row_pages[context_positions // page_size], context_positions % page_size
            block = slice(offset, offset + length)
            keys = torch.cat([key_cache[page_ids, within], key[block]]).float()
            values = torch.cat([value_cache[page_ids, within], value[block]]).float()
            q = query[block].float().view(length, kv_heads, group, dim)
            scores = torch.einsum("qhgd,khd->hgqk", q, keys) * dim**-0.5
            if window is not None:
                query_positions = torch.arange(row.start, row.start + length, device=query.device)
                key_positions = torch.cat([context_positions, query_positions])
                hidden = query_positions[:, None] - key_positions[None, :] >= window
                scores = scores.masked_fill(hidden, float("-inf"))
            attended = torch.einsum("hgqk,khd->qhgd", torch.softmax(scores, dim=-1), values)
            output[block] = attended.reshape(length, heads, dim).to(query.dtype)
            offset += length
        return output


def load_layers(config: DFlashConfig, take: TakeTensor) -> tuple[DFlashLayer, ...]:
    """The decoder layers' weights (z-lab names through ``take``)."""
    layers = []
    for index, kind in enumerate(config.layer_types):
        prefix = f"layers.{index}."
        layers.append(DFlashLayer(
            input_layernorm=take(prefix + "input_layernorm.weight"),
            post_attention_layernorm=take(prefix + "post_attention_layernorm.weight"),
            q_proj=take(prefix + "self_attn.q_proj.weight"),
            k_proj=take(prefix + "self_attn.k_proj.weight"),
            v_proj=take(prefix + "self_attn.v_proj.weight"),
            o_proj=take(prefix + "self_attn.o_proj.weight"),
            q_norm=take(prefix + "self_attn.q_norm.weight"),
            k_norm=take(prefix + "self_attn.k_norm.weight"),
            gate_proj=take(prefix + "mlp.gate_proj.weight"),
            up_proj=take(prefix + "mlp.up_proj.weight"),
            down_proj=take(prefix + "mlp.down_proj.weight"),
            window=config.sliding_window if kind == SLIDING_ATTENTION else None,
        ))
    return tuple(layers)
