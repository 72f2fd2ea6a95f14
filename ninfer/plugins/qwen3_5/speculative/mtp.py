"""The checkpoint's multi-token-prediction module (``mtp.*``), runnable one drafting step at a time.

``x = fc(concat[pre_fc_norm_embedding(embed(next_token)), pre_fc_norm_hidden(hidden)])`` (embedding first), then one
full-attention decoder layer with its own paged KV, ``mtp.norm`` and the trunk's lm_head. The embedding and lm_head
are shared with the trunk. Feed the trunk's final-normed hidden state at position t with token t+1 (at position t);
the returned hidden state (after ``mtp.norm``) feeds the next chained step.

On CUDA a step runs through the decode path's fused Triton kernels (:meth:`Qwen35MTP.fused_step`, one or a few
tokens per row): device-resident inputs and outputs, no host sync, the greedy proposal taken on the device, so a
draft's chained steps can be captured as one CUDA graph (:mod:`ninfer.plugins.qwen3_5.cuda.mtp_graph`) and read back once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Sequence

import attrs
import torch
import torch.nn.functional as F

from ninfer.core.runtime import AttentionLayerSpec, KVCache, RuntimeSpec
from ninfer.kernels.reference.norms import rms_norm
from ninfer.plugins.qwen3_5.model.config import FULL_ATTENTION
from ninfer.plugins.qwen3_5.model.fused import FusedProjections, fuse_layer
from ninfer.plugins.qwen3_5.model.layers import (
    BatchLayout,
    DecoderLayerWeights,
    FullAttentionWeights,
    finish_layer,
    full_attention,
)
from ninfer.plugins.qwen3_5.model.model import (
    ForwardBatchError,
    Qwen35Model,
    WeightLoader,
    check_rows,
    load_decoder_layer,
)
from ninfer.plugins.qwen3_5.model.quantized import Weight, linear
from ninfer.plugins.qwen3_5.model.weights import MTP_PREFIX, mtp_weights

if TYPE_CHECKING:
    from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner


@attrs.frozen
class MTPWeights:
    pre_fc_norm_embedding: torch.Tensor
    pre_fc_norm_hidden: torch.Tensor
    fc: Weight  # [H, 2H]; quantized where the source quantizes it
    layers: tuple[DecoderLayerWeights, ...]
    norm: torch.Tensor


class Qwen35MTP:
    """MTP drafter step. ``spec`` describes its own KV (one attention layer per MTP layer, no recurrent state)."""

    def __init__(self, model: Qwen35Model, weights: MTPWeights) -> None:
        self.model = model
        self.weights = weights
        config = model.config
        self.spec = RuntimeSpec(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            attention_layers=tuple(
                AttentionLayerSpec(config.num_hidden_layers + index, config.num_key_value_heads, config.head_dim)
                for index in range(len(weights.layers))
            ),
            recurrent_layers=(),
            dtype=model.dtype,
            device=model.device,
            max_position_embeddings=config.max_position_embeddings,
        )
        self._fused: tuple[FusedProjections, ...] | None = None

    @classmethod
    def load(cls, loader: WeightLoader, model: Qwen35Model) -> "Qwen35MTP | None":
        """The MTP module, or None when the config declares none or the artifact carries no ``mtp.*`` tensors.

        A partial or mis-shaped set of ``mtp.*`` tensors is a WeightMismatchError.
        """
        config = model.config
        expected = mtp_weights(config)
        if not expected or not any(name.startswith(MTP_PREFIX) for name in loader.present):
            return None
        loader.check(expected)
        loader.check_no_extras(expected, within=MTP_PREFIX)
        weights = MTPWeights(
            pre_fc_norm_embedding=loader.take(f"{MTP_PREFIX}pre_fc_norm_embedding.weight"),
            pre_fc_norm_hidden=loader.take(f"{MTP_PREFIX}pre_fc_norm_hidden.weight"),
            fc=loader.take_linear(f"{MTP_PREFIX}fc.weight"),
            layers=tuple(
                load_decoder_layer(loader, f"{MTP_PREFIX}layers.{index}.", FULL_ATTENTION, config)
                for index in range(config.mtp_num_hidden_layers)
            ),
            norm=loader.take(f"{MTP_PREFIX}norm.weight"),
        )
        return cls(model, weights)

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        page_tables: torch.Tensor,
        kv: KVCache,
        *,
        logits: Literal["last", "all", "none"] = "all",
        step: int = 0,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """One MTP step over a flat batch of rows (same layout rules as the trunk's ``ForwardBatch``).

        ``token_ids [T]`` are the next tokens, ``hidden [T, H]`` the matching final-normed hidden states,
        ``positions [3, T]``. Writes the MTP layer's KV into ``kv`` (allocated from ``self.spec``). Returns fp32
        logits (``[T, V]`` for "all", ``[R, V]`` for "last", None for "none") and the post-norm hidden ``[T, H]``.
        ``step`` picks the MTP layer (``step % num_layers``) when a checkpoint has several.
        """
        model, weights, config = self.model, self.weights, self.model.config
        if hidden.dim() != 2 or hidden.shape != (token_ids.shape[0], config.hidden_size):
            raise ForwardBatchError(
                f"MTP hidden must be [T={token_ids.shape[0]}, H={config.hidden_size}]; got {tuple(hidden.shape)}"
            )
        if logits not in ("last", "all", "none"):
            raise ForwardBatchError(f"MTP logits must be 'last', 'all' or 'none', got {logits!r}")
        if len(kv.key) != len(weights.layers):
            raise ForwardBatchError(f"the MTP KV cache has {len(kv.key)} layers, the MTP module {len(weights.layers)}")
        check_rows(token_ids.shape[0], positions, query_lens, context_lens, page_tables, kv.page_size)
        layer_index = step % len(weights.layers)
        layer = weights.layers[layer_index]
        eps = config.rms_norm_eps
        embedded = rms_norm(model.embed(token_ids), weights.pre_fc_norm_embedding, eps, zero_centered=True)
        previous = rms_norm(hidden.to(model.device, model.dtype), weights.pre_fc_norm_hidden, eps, zero_centered=True)
        x = linear(torch.cat([embedded, previous], dim=-1), weights.fc)
        layout = BatchLayout.build(query_lens, context_lens, page_tables, kv.page_size, None, model.device)
        normed = rms_norm(x, layer.input_layernorm, eps, zero_centered=True)
        mixed = full_attention(
            layer.mixer,  # type: ignore[arg-type]
            config,
            normed,
            model.rotary(positions),
            layout,
            kv.key[layer_index],
            kv.value[layer_index],
        )
        out = rms_norm(finish_layer(layer, config, x, mixed), weights.norm, eps, zero_centered=True)
        if logits == "none":
            return None, out
        selected = out if logits == "all" else out[layout.last_token_index]
        return model.logits(selected), out

    def fused_projections(self) -> tuple[FusedProjections, ...]:
        """The MTP layers' concatenated input projections (``fuse_layer``), made on first use; the module's weights
        become views of them, so nothing is held twice."""
        if self._fused is None:
            layers, fused = zip(*(fuse_layer(layer) for layer in self.weights.layers))
            self.weights = attrs.evolve(self.weights, layers=tuple(layers))
            self._fused = tuple(fused)
        return self._fused

    @torch.no_grad()
    def fused_step(
        self,
        runner: "DecodeGraphRunner",
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        context_lens: torch.Tensor,
        page_tables: torch.Tensor,
        kv: KVCache,
        head: torch.Tensor,
        *,
        tokens_per_row: int = 1,
        step: int = 0,
        last_offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step of ``q = tokens_per_row`` tokens per row through the fused kernels, without a host sync.

        Row r's tokens sit at positions ``context_lens[r] .. context_lens[r] + q - 1`` (its MTP KV holds the
        positions before them): ``token_ids [R*q]`` (the next tokens) and ``hidden [R*q, H]`` (the matching trunk or
        MTP hidden states), row after row; ``context_lens [R]`` (int64) and ``page_tables [R, P]`` live on the device.
        ``runner`` (the trunk's decode runner, same config) supplies the attention query and the feed-forward block
        (dense or MoE). Writes the KV of every token into ``kv``; only each row's last token is carried on (its
        attention over the row's whole MTP KV, feed-forward block and norm: the single MTP layer's other outputs
        feed nothing). Returns, for each row's last token, the greedy proposal ``argmax(out @ head^T) [R]`` and the
        post-norm hidden state ``out [R, H]``, both on the device.

        ``last_offsets [R]`` (int64, on the device): rows padded to q tokens, row r holding ``last_offsets[r] + 1``
        real ones followed by padding. A padding token takes its row's last real position and KV slot and an exact
        copy of that token's attention projection, so both write the same K/V bytes and nothing lands past the row's
        real tokens; the row's outputs are those of its last real token, read at its own index (no padding token's
        value is used), attending over the row's real tokens only.
        """
        from ninfer.kernels.triton.attention import paged_attention_decode
        from ninfer.kernels.triton.norms import add_rms_norm

        model, config = self.model, self.model.config
        fused = self.fused_projections()
        index = step % len(fused)
        layer, projections, weights = self.weights.layers[index], fused[index], self.weights
        attention: FullAttentionWeights = layer.mixer  # type: ignore[assignment]
        key_cache, value_cache = kv.key[index], kv.value[index]
        eps, rows, q = config.rms_norm_eps, context_lens.shape[0], tokens_per_row
        _, embedded = add_rms_norm(F.embedding(token_ids, model.embed_tokens), None, weights.pre_fc_norm_embedding, eps)
        _, previous = add_rms_norm(hidden, None, weights.pre_fc_norm_hidden, eps)
        x = F.linear(torch.cat([embedded, previous], dim=-1), weights.fc)
        _, normed = add_rms_norm(x, None, layer.input_layernorm, eps)
        page_size, device = kv.page_size, context_lens.device
        offsets = torch.arange(q, device=device)[None, :]  # [1, q] each token's offset in its row
        if last_offsets is not None:
            offsets = torch.minimum(offsets, last_offsets[:, None])  # [R, q] padding repeats the last real offset
        positions = context_lens[:, None] + offsets  # [R, q]
        pages = page_tables.gather(1, positions // page_size).long()
        positions, slots = positions.reshape(-1), (pages * page_size + positions % page_size).reshape(-1)
        projected = F.linear(normed, projections.mixer_in)
        if last_offsets is not None:  # each padding token's projection row: its row's last real token's, copied
            projected = projected.index_select(0, (torch.arange(rows, device=device)[:, None] * q + offsets).view(-1))
        query, gate = runner.attention_query(
            attention, projected, positions.expand(3, -1), slots, key_cache, value_cache
        )  # writes the KV of every token; only each row's last (real) token goes on
        last_offset = q - 1 if last_offsets is None else last_offsets
        if q > 1:
            last = torch.arange(rows, device=device) * q + last_offset
            query, gate, x = query[last], gate[last], x[last]
        attended = paged_attention_decode(
            query, key_cache, value_cache, page_tables, context_lens + last_offset + 1, scale=config.head_dim**-0.5,
            gate=gate,
        )
        x, normed = add_rms_norm(F.linear(attended, attention.o_proj), x, layer.post_attention_layernorm, eps)
        _, out = add_rms_norm(runner.feed_forward(layer, projections, normed), x, weights.norm, eps)
        return F.linear(out, head).argmax(dim=-1), out
