"""The CUDA verify path of speculative decoding: every verify batch of a round through fused Triton kernels, captured
as CUDA graphs per batch shape, in the style of the decode path (``decode_graph``).

A verify batch (``capture_states``, ``logits="all"``; each row feeds its pending committed tokens plus its drafts)
runs the same fused projections as decode; the Gated DeltaNet layers run a row's tokens in one conv kernel and one
recurrent kernel that also store the conv window and the SSM state after every token (the round's rollback point),
and attention reads each row's paged KV once for its causal queries. The per-token states go to buffers owned by the
runner (grown to the largest batch seen, capturing graphs again when they grow), so ``ForwardOutput.states`` are
views of them: valid until this runner's next forward, which is how the round uses them (rollback right after).

The kernels take the same number of tokens ``q`` in every row. A *ragged* batch (rows that draft fewer tokens near
their output limit, fallback rows of one token) is padded to its largest q, each padded row repeating its last real
token (id and position):

* KV: a padding token writes its K/V into its row's last real slot from an exact copy of that token's projection, so
  both writers store the same bytes. Nothing lands past a row's real tokens, where the engine reserves no pages.
* attention: padding queries read past their row's real end (their outputs are dropped); the page table is widened
  with zeros to cover those reads.
* recurrent state: after the forward, each padded row's slot gets the state after its last real token back from the
  per-token capture (``RowCopy``: one launch per padded row), and the captured states are compacted to the batch's
  flat order (one launch per token that moves).
* outputs: logits, hidden states and layer outputs of the real tokens only, gathered in flat order.

``capture_layers`` (the DFlash drafters' target features): each asked layer's output, the residual stream after it
(``hidden + pending``, as ``Qwen35Model.run`` stores it), is written into a static buffer inside the graph.
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F

from ninfer.core.runtime import CapturedStates, ForwardBatch, ForwardOutput, KVCache, StateCache
from ninfer.kernels.triton import next_power_of_2
from ninfer.kernels.triton.attention import paged_attention_verify
from ninfer.kernels.triton.conv import causal_conv1d_verify
from ninfer.kernels.triton.gated_delta import fused_recurrent_gated_delta
from ninfer.kernels.triton.row_copy import RowCopy
from ninfer.plugins.qwen3_5.cuda.decode_graph import (
    MIN_PAGE_BUCKET,
    CapturedStep,
    DecodeGraphRunner,
    DecodeInputs,
    StepCarry,
    _identity,
)
from ninfer.plugins.qwen3_5.model.config import FULL_ATTENTION
from ninfer.plugins.qwen3_5.model.fused import FusedProjections
from ninfer.plugins.qwen3_5.model.layers import FullAttentionWeights, GatedDeltaNetWeights
from ninfer.plugins.qwen3_5.model.model import Qwen35Model

MAX_TOKENS_PER_ROW = 16  # verify batches with more tokens per row take the generic path


class StateBuffers:
    """Per Gated-DeltaNet layer: the conv window ``[N, C, K-1]`` and SSM state ``[N, Hv, Dk, Dv]`` after each of up
    to ``capacity`` verify tokens."""

    def __init__(self, state: StateCache, capacity: int) -> None:
        self.capacity = capacity
        self.conv = [torch.empty((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in state.conv]
        self.ssm = [torch.empty((capacity, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in state.ssm]

    def fits(self, state: StateCache, tokens: int) -> bool:
        """Room for ``tokens`` tokens of states shaped like ``state``'s."""

        def layout(tensors: list[torch.Tensor]) -> list[tuple]:
            return [(tuple(t.shape[1:]), t.dtype, t.device) for t in tensors]

        return tokens <= self.capacity and layout(self.conv) == layout(state.conv) and layout(self.ssm) == layout(
            state.ssm
        )

    def captured(self, tokens: int) -> CapturedStates:
        """The states after each of the first ``tokens`` tokens (views)."""
        return CapturedStates(conv=[t[:tokens] for t in self.conv], ssm=[t[:tokens] for t in self.ssm])

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every buffer, conv windows first (the order of ``StateCache``'s tensors in ``_realign_states``)."""
        return [*self.conv, *self.ssm]


def padded_index(query_lens: Sequence[int], q: int) -> list[int]:
    """The index of every real token (in the batch's flat order) in the batch padded to ``q`` tokens per row."""
    return [row * q + t for row, n in enumerate(query_lens) for t in range(n)]


def padding_sources(query_lens: Sequence[int], q: int) -> list[int]:
    """For every token of the batch padded to ``q`` tokens per row, the flat index of the real token it repeats
    (itself for a real token, its row's last real token for padding)."""
    starts = itertools.accumulate(query_lens, initial=0)
    return [start + min(t, n - 1) for start, n in zip(starts, query_lens) for t in range(q)]


def pad_batch(batch: ForwardBatch, q: int, width: int) -> ForwardBatch:
    """``batch`` with every row padded to ``q`` tokens (repeats of its last real token) and its page table widened
    with zeros to ``width`` pages."""
    source = torch.tensor(padding_sources(batch.query_lens, q), device=batch.token_ids.device)
    return ForwardBatch(
        token_ids=batch.token_ids[source],
        positions=batch.positions[:, source.to(batch.positions.device)],
        query_lens=[q] * batch.num_rows,
        context_lens=batch.context_lens,
        page_tables=F.pad(batch.page_tables, (0, width - batch.page_tables.shape[1])),
        state_slots=batch.state_slots,
        logits=batch.logits,
        capture_states=batch.capture_states,
    )


class RaggedInputs:
    """Static device inputs of a ragged batch padded to ``q`` tokens per row: ``last_offsets [R]`` (each row's real
    token count - 1) and ``real_index [R*q]`` (``padded_index``; the first T entries hold it), staged like
    ``DecodeInputs``: written into a pinned host buffer and copied over in one asynchronous transfer."""

    def __init__(self, rows: int, q: int, device: torch.device) -> None:
        self.rows, self.q = rows, q
        size = rows * (q + 1)
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        self.host_buffer = torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
        self._copied = torch.cuda.Event() if pinned else None
        self.last_offsets = self.device_buffer[:rows]
        self.real_index = self.device_buffer[rows:]

    def load(self, query_lens: Sequence[int]) -> None:
        """Stage the row lengths of one batch (``len(query_lens) == rows``, each at most ``q``) without a host sync."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous transfer has read the staging buffer
        staged = self.host_buffer.numpy()
        real = padded_index(query_lens, self.q)
        staged[: self.rows] = [n - 1 for n in query_lens]
        staged[self.rows : self.rows + len(real)] = real
        self.device_buffer.copy_(self.host_buffer, non_blocking=True)
        if self._copied is not None:
            self._copied.record()


def load_ragged(
    cache: dict[tuple[int, int], RaggedInputs], q: int, lens: Sequence[int], device: torch.device
) -> RaggedInputs:
    """An eager path's ragged inputs for ``len(lens)`` rows x ``q`` (kept in ``cache``), loaded with ``lens``."""
    ragged = cache.get((len(lens), q))
    if ragged is None:
        ragged = cache[(len(lens), q)] = RaggedInputs(len(lens), q, device)
    ragged.load(lens)
    return ragged


@attrs.define
class VerifyCarry(StepCarry):
    """``StepCarry`` plus, for a padded batch, the flat index of the token whose projection each token's K/V write
    takes (``padding_sources`` on the device)."""

    kv_sources: torch.Tensor | None = None


@attrs.define
class CapturedVerify(CapturedStep):
    """A captured verify forward with its ragged inputs (padded batches) and its layer-output buffer."""

    ragged: RaggedInputs | None = None
    layer_hidden: torch.Tensor | None = None


class VerifyGraphRunner(DecodeGraphRunner):
    """Runs the verify batches of a CUDA-resident ``Qwen35Model`` whose input projections are fused; shares the decode
    path's norms, feed-forward blocks and epilogue."""

    def __init__(
        self,
        model: Qwen35Model,
        fused: Sequence[FusedProjections],
        *,
        use_graphs: bool = True,
        max_batch: int = 64,
        max_tokens_per_row: int = MAX_TOKENS_PER_ROW,
        graph_segments: int = 4,
    ) -> None:
        super().__init__(model, fused, use_graphs=use_graphs, max_batch=max_batch, graph_segments=graph_segments)
        self.max_tokens_per_row = max_tokens_per_row
        self._verify_graphs: dict[tuple, CapturedVerify] = {}
        self._verify_inputs: dict[tuple[int, int, int], DecodeInputs] = {}
        self._ragged_inputs: dict[tuple[int, int], RaggedInputs] = {}
        self._states: StateBuffers | None = None
        self._row_copies: dict[str, tuple[tuple, RowCopy]] = {}
        # the private memory pool of the verify graphs (never the decode graphs'): live exactly while
        # ``_verify_graphs`` holds a graph, since the allocator forgets a pool once its last graph is destroyed and
        # asserts on a capture into it (``use_count > 0``); a capture into an empty set of graphs takes a fresh one
        self._verify_pool: Any = None

    def supports(self, batch: ForwardBatch) -> bool:
        """A verify batch: state capture, all logits, 1..max tokens in each row (ragged or not), any layer outputs."""
        lens = batch.query_lens
        return (
            batch.capture_states
            and batch.logits == "all"
            and 0 < len(lens) <= self.max_batch
            and min(lens) >= 1
            and max(lens) <= self.max_tokens_per_row
        )

    def forward(self, batch: ForwardBatch, kv: KVCache, state: StateCache) -> ForwardOutput:
        lens = [int(n) for n in batch.query_lens]
        rows, q, tokens = len(lens), max(lens), sum(lens)
        ragged = tokens != rows * q
        width = self._page_bucket(batch, q, kv.page_size)
        staged = pad_batch(batch, q, width) if ragged else batch
        layers = tuple(batch.capture_layers)
        buffers = self._state_buffers(state, rows * q)
        key = (rows, q, width, ragged, layers, _identity(kv, state))
        captured = self._verify_graphs.get(key) if self.use_graphs else None
        if captured is not None:
            captured.inputs.load(staged)
            if captured.ragged is not None:
                captured.ragged.load(lens)
            captured.replay()
            index, hidden, logits = captured.ragged, captured.hidden, captured.logits
            layer_hidden = captured.layer_hidden
        else:
            inputs = self._verify_inputs.get((rows, q, width))
            if inputs is None:
                inputs = self._verify_inputs[(rows, q, width)] = DecodeInputs(rows, width, self.model.device, q=q)
            inputs.load(staged)
            index = load_ragged(self._ragged_inputs, q, lens, self.model.device) if ragged else None
            layer_hidden = self._layer_buffer(rows * q, layers)
            layer_outputs = self._layer_outputs(layer_hidden, layers)
            hidden, logits = self.verify_step(inputs, kv, state, buffers, index, layer_outputs)
            if self.use_graphs:
                self._verify_graphs[key] = self._capture_verify(rows, q, width, ragged, layers, kv, state, buffers)
        if ragged:
            self._realign_states(lens, batch.state_slots, buffers, state)

        def real(tensor: torch.Tensor) -> torch.Tensor:
            if index is not None:
                return tensor.index_select(0, index.real_index[:tokens])
            return tensor if captured is None else tensor.clone()  # the next replay overwrites static outputs

        return ForwardOutput(
            logits=real(logits).float(),
            hidden=real(hidden) if batch.return_hidden else None,
            states=buffers.captured(tokens),
            layer_hidden=real(layer_hidden) if layer_hidden is not None else None,
        )

    def captured_verify(self, rows: int, q: int) -> list[CapturedStep]:
        """The verify graphs captured so far for ``rows`` rows of ``q`` tokens (any page-table width or cache)."""
        return [step for key, step in self._verify_graphs.items() if key[:2] == (rows, q)]

    def _page_bucket(self, batch: ForwardBatch, q: int, page_size: int) -> int:
        """The page-table width bucket: the batch's table, widened to every row's context + q positions (as far as the
        padding queries of a ragged batch read), to a power of two from MIN_PAGE_BUCKET."""
        reach = max(-(-(int(context) + q) // page_size) for context in batch.context_lens)
        return max(MIN_PAGE_BUCKET, next_power_of_2(max(batch.page_tables.shape[1], reach)))

    def _layer_buffer(self, tokens: int, layers: tuple[int, ...]) -> torch.Tensor | None:
        """``[tokens, len(layers) * H]`` for the outputs of ``layers`` (None when none are asked for)."""
        if not layers:
            return None
        shape = (tokens, len(layers) * self.config.hidden_size)
        return torch.empty(shape, dtype=self.model.dtype, device=self.model.device)

    def _layer_outputs(self, buffer: torch.Tensor | None, layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """Layer index -> its columns of ``buffer`` (in ``capture_layers`` order)."""
        if buffer is None:
            return {}
        size = self.config.hidden_size
        return {layer: buffer[:, k * size : (k + 1) * size] for k, layer in enumerate(layers)}

    def _state_buffers(self, state: StateCache, tokens: int) -> StateBuffers:
        """The per-token state buffers, (re)allocated when too small; graphs bound to the old ones are dropped."""
        if self._states is None or not self._states.fits(state, tokens):
            self._verify_graphs.clear()  # their pool dies with them: the next capture takes a fresh one
            self._row_copies.clear()
            self._states = None  # free the old buffers first
            self._states = StateBuffers(state, tokens)
        return self._states

    def _realign_states(
        self, lens: Sequence[int], state_slots: torch.Tensor, buffers: StateBuffers, state: StateCache
    ) -> None:
        """After a padded forward: each padded row's slot gets the state after its last real token, and the
        per-token states move from their padded index to their flat one.

        The moves go in flat order, one launch each (ordered on the stream), and a token's flat index never exceeds its
        padded one: a move writes below the padded index of every token still to move, so nothing still to be read is
        overwritten.
        """
        q = max(lens)
        restore = self._row_copy("slots", buffers.tensors, [*state.conv, *state.ssm])
        for row, (n, slot) in enumerate(zip(lens, state_slots.tolist())):
            if n < q:
                restore(row * q + n - 1, slot)
        compact = self._row_copy("compact", buffers.tensors, buffers.tensors)
        for flat, padded in enumerate(padded_index(lens, q)):
            if padded != flat:
                compact(padded, flat)

    def _row_copy(self, name: str, sources: list[torch.Tensor], destinations: list[torch.Tensor]) -> RowCopy:
        """The ``RowCopy`` named ``name``, built again when its tensors are not the ones it was built for."""
        identity = tuple((t.data_ptr(), t.stride(0), t.dtype) for t in (*sources, *destinations))
        cached = self._row_copies.get(name)
        if cached is None or cached[0] != identity:
            cached = self._row_copies[name] = (identity, RowCopy(sources, destinations))
        return cached[1]

    def _capture_verify(
        self, rows: int, q: int, width: int, ragged: bool, layers: tuple[int, ...], kv: KVCache, state: StateCache,
        buffers: StateBuffers,
    ) -> CapturedVerify:
        """Record one verify forward over fresh static inputs (capturing executes nothing, so no cache is touched).

        The segments share the runner's verify pool, captured in launch order, so each one's live outputs (the carry)
        stay valid for the next; a capture that fails leaves no graph behind and the pool as it was.
        """
        inputs = DecodeInputs(rows, width, self.model.device, q=q)
        ragged_inputs = RaggedInputs(rows, q, self.model.device) if ragged else None
        layer_hidden = self._layer_buffer(rows * q, layers)
        layer_outputs = self._layer_outputs(layer_hidden, layers)
        torch.cuda.synchronize(self.model.device)  # the eager warm-up forward has finished
        if not self._verify_graphs:  # no graph keeps the previous pool alive
            self._verify_pool = torch.cuda.graph_pool_handle()
        bounds = self._segment_bounds()
        graphs: list[torch.cuda.CUDAGraph] = []
        carry: VerifyCarry | None = None
        for index, (start, stop) in enumerate(bounds):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._verify_pool):
                if carry is None:
                    carry = self._verify_prologue(inputs, kv, ragged_inputs)
                carry = self._verify_layers(carry, inputs, kv, state, buffers, start, stop, layer_outputs)
                if index == len(bounds) - 1:
                    hidden, logits = self._epilogue(carry)
            graphs.append(graph)
        return CapturedVerify(
            graphs=graphs, inputs=inputs, hidden=hidden, logits=logits, ragged=ragged_inputs,
            layer_hidden=layer_hidden,
        )

    def verify_step(
        self,
        inputs: DecodeInputs,
        kv: KVCache,
        state: StateCache,
        buffers: StateBuffers,
        ragged: RaggedInputs | None,
        layer_outputs: dict[int, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One verify traversal over the static buffers: final-normed hidden ``[R*q, H]`` and logits ``[R*q, V]``
        (``_epilogue``; ``forward`` returns them as fp32).

        ``ragged``: the inputs are a padded batch with these row lengths (None: every row has q tokens);
        ``layer_outputs``: layer index -> where its output goes (empty: none asked for).
        """
        carry = self._verify_prologue(inputs, kv, ragged)
        carry = self._verify_layers(carry, inputs, kv, state, buffers, 0, len(self.model.layers), layer_outputs)
        return self._epilogue(carry)

    def _verify_prologue(self, inputs: DecodeInputs, kv: KVCache, ragged: RaggedInputs | None) -> VerifyCarry:
        """Embeddings and each token's KV slot (a padding token's is its row's last real slot); ``total_lens`` carries
        the rows' cached lengths."""
        page_size, device = kv.page_size, inputs.context_lens.device
        offsets = torch.arange(inputs.q, device=device)[None, :]
        kv_sources = None
        if ragged is not None:
            offsets = torch.minimum(offsets, ragged.last_offsets[:, None])  # [R, q]
            kv_sources = (torch.arange(inputs.rows, device=device)[:, None] * inputs.q + offsets).reshape(-1)
        positions = inputs.context_lens[:, None] + offsets  # [R, q] KV position of each token
        pages = inputs.page_tables.gather(1, positions // page_size)
        return VerifyCarry(
            hidden=F.embedding(inputs.token_ids, self.model.embed_tokens),
            pending=None,
            slot_mapping=(pages * page_size + positions % page_size).reshape(-1),
            total_lens=inputs.context_lens,
            kv_sources=kv_sources,
        )

    def _verify_layers(
        self, carry: VerifyCarry, inputs: DecodeInputs, kv: KVCache, state: StateCache, buffers: StateBuffers,
        start: int, stop: int, layer_outputs: dict[int, torch.Tensor],
    ) -> VerifyCarry:
        """Layers ``[start, stop)`` of the trunk over the verify tokens; the outputs of those in ``layer_outputs`` are
        stored there."""
        model, config = self.model, self.config
        kinds = config.layer_types
        attention_index = sum(1 for kind in kinds[:start] if kind == FULL_ATTENTION)
        recurrent_index = start - attention_index
        hidden, pending = carry.hidden, carry.pending
        for index in range(start, stop):
            layer, fused = model.layers[index], self.fused[index]
            hidden, normed = self._add_norm(pending, hidden, layer.input_layernorm)
            if kinds[index] == FULL_ATTENTION:
                pending = self._verify_attention(
                    layer.mixer, fused, normed, inputs, carry,  # type: ignore[arg-type]
                    kv.key[attention_index], kv.value[attention_index],
                )
                attention_index += 1
            else:
                pending = self._verify_gated_deltanet(
                    layer.mixer, fused, normed, inputs,  # type: ignore[arg-type]
                    state.conv[recurrent_index], state.ssm[recurrent_index],
                    buffers.conv[recurrent_index], buffers.ssm[recurrent_index],
                )
                recurrent_index += 1
            hidden, normed = self._add_norm(pending, hidden, layer.post_attention_layernorm)
            pending = self.feed_forward(layer, fused, normed)
            destination = layer_outputs.get(index)
            if destination is not None:
                torch.add(hidden, pending, out=destination)
        return attrs.evolve(carry, hidden=hidden, pending=pending)

    def _verify_gated_deltanet(
        self,
        weights: GatedDeltaNetWeights,
        fused: FusedProjections,
        normed: torch.Tensor,
        inputs: DecodeInputs,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
        conv_states: torch.Tensor,
        ssm_states: torch.Tensor,
    ) -> torch.Tensor:
        config = self.config
        qkv, z, b, a = self.gated_deltanet_inputs(F.linear(normed, fused.mixer_in))
        mixed = causal_conv1d_verify(
            qkv, weights.conv_weight, conv_cache, inputs.state_slots, tokens_per_row=inputs.q,
            states_out=conv_states,
        )
        core, _ = fused_recurrent_gated_delta(
            mixed, a, b, weights.decay_rate, weights.dt_bias, ssm_cache, inputs.state_slots,
            key_heads=config.linear_num_key_heads, tokens_per_row=inputs.q, z=z, norm_weight=weights.norm,
            norm_eps=config.rms_norm_eps, states_out=ssm_states,
        )
        return self._out_projection(core.view(normed.shape[0], config.linear_value_dim), weights.out_proj)

    def _verify_attention(
        self,
        weights: FullAttentionWeights,
        fused: FusedProjections,
        normed: torch.Tensor,
        inputs: DecodeInputs,
        carry: VerifyCarry,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        projected = F.linear(normed, fused.mixer_in)
        if carry.kv_sources is not None:
            # a padded batch: a padding token's projection row is an exact copy of its row's last real token's, whose
            # position and KV slot it has too, so the two tokens writing one slot store the same K/V bytes
            projected = projected.index_select(0, carry.kv_sources)
        query, gate = self.attention_query(
            weights, projected, inputs.positions, carry.slot_mapping, key_cache, value_cache
        )
        attended = paged_attention_verify(
            query, key_cache, value_cache, inputs.page_tables, inputs.context_lens, tokens_per_row=inputs.q,
            scale=self.config.head_dim**-0.5, gate=gate,
        )
        return self._out_projection(attended, weights.o_proj)
