"""The CUDA verify path of speculative decoding: q = k+1 tokens per row through fused Triton kernels, captured as CUDA
graphs per (rows, q), in the style of the decode path (``decode_graph``).

A verify batch (every row ``q`` new tokens, ``capture_states``, ``logits="all"``) runs the same fused projections as
decode; the Gated DeltaNet layers run the q tokens of a row in one conv kernel and one recurrent kernel that also
store the conv window and the SSM state after every token (the round's rollback point), and attention reads each
row's paged KV once for its q causal queries. The per-token states go to buffers owned by the runner (grown to the
largest batch seen, capturing graphs again when they grow), so ``ForwardOutput.states`` are views of them: valid
until this runner's next forward, which is how the round uses them (rollback right after the verify).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ninfer.core.runtime import CapturedStates, ForwardBatch, ForwardOutput, KVCache, StateCache
from ninfer.kernels.triton import next_power_of_2
from ninfer.kernels.triton.attention import paged_attention_verify
from ninfer.kernels.triton.conv import causal_conv1d_verify
from ninfer.kernels.triton.gated_delta import fused_recurrent_gated_delta
from ninfer.plugins.qwen3_5.config import FULL_ATTENTION
from ninfer.plugins.qwen3_5.decode_graph import (
    MIN_PAGE_BUCKET,
    CapturedStep,
    DecodeGraphRunner,
    DecodeInputs,
    StepCarry,
    _identity,
)
from ninfer.plugins.qwen3_5.fused import FusedProjections
from ninfer.plugins.qwen3_5.layers import FullAttentionWeights, GatedDeltaNetWeights
from ninfer.plugins.qwen3_5.model import Qwen35Model

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


class VerifyGraphRunner(DecodeGraphRunner):
    """Runs uniform verify batches of a CUDA-resident ``Qwen35Model`` whose input projections are fused; shares the
    decode path's norms, feed-forward blocks and epilogue."""

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
        self._verify_graphs: dict[tuple, CapturedStep] = {}
        self._verify_inputs: dict[tuple[int, int, int], DecodeInputs] = {}
        self._states: StateBuffers | None = None
        # the private memory pool of the verify graphs (never the decode graphs'): live exactly while
        # ``_verify_graphs`` holds a graph, since the allocator forgets a pool once its last graph is destroyed and
        # asserts on a capture into it (``use_count > 0``); a capture into an empty set of graphs takes a fresh one
        self._verify_pool: Any = None

    def supports(self, batch: ForwardBatch) -> bool:
        """A uniform verify batch: every row the same 2..max tokens, state capture, all logits, no layer outputs."""
        lens = batch.query_lens
        return (
            batch.capture_states
            and batch.logits == "all"
            and not batch.capture_layers
            and 0 < len(lens) <= self.max_batch
            and 2 <= lens[0] <= self.max_tokens_per_row
            and all(n == lens[0] for n in lens)
        )

    def forward(self, batch: ForwardBatch, kv: KVCache, state: StateCache) -> ForwardOutput:
        rows, q = batch.num_rows, batch.query_lens[0]
        width = max(MIN_PAGE_BUCKET, next_power_of_2(batch.page_tables.shape[1]))
        buffers = self._state_buffers(state, rows * q)
        key = (rows, q, width, _identity(kv, state))
        captured = self._verify_graphs.get(key) if self.use_graphs else None
        if captured is not None:
            captured.inputs.load(batch)
            captured.replay()
            # the next replay overwrites the static outputs
            hidden, logits = captured.hidden.clone() if batch.return_hidden else None, captured.logits.clone()
        else:
            inputs = self._verify_inputs.get((rows, q, width))
            if inputs is None:
                inputs = self._verify_inputs[(rows, q, width)] = DecodeInputs(rows, width, self.model.device, q=q)
            inputs.load(batch)
            hidden, logits = self.verify_step(inputs, kv, state, buffers)
            if self.use_graphs:
                self._verify_graphs[key] = self._capture_verify(rows, q, width, kv, state, buffers)
        return ForwardOutput(
            logits=logits, hidden=hidden if batch.return_hidden else None, states=buffers.captured(rows * q)
        )

    def captured_verify(self, rows: int, q: int) -> list[CapturedStep]:
        """The verify graphs captured so far for ``rows`` rows of ``q`` tokens (any page-table width or cache)."""
        return [step for key, step in self._verify_graphs.items() if key[:2] == (rows, q)]

    def _state_buffers(self, state: StateCache, tokens: int) -> StateBuffers:
        """The per-token state buffers, (re)allocated when too small; graphs bound to the old ones are dropped."""
        if self._states is None or not self._states.fits(state, tokens):
            self._verify_graphs.clear()  # their pool dies with them: the next capture takes a fresh one
            self._states = None  # free the old buffers first
            self._states = StateBuffers(state, tokens)
        return self._states

    def _capture_verify(
        self, rows: int, q: int, width: int, kv: KVCache, state: StateCache, buffers: StateBuffers
    ) -> CapturedStep:
        """Record one verify forward over fresh static inputs (capturing executes nothing, so no cache is touched).

        The segments share the runner's verify pool, captured in launch order, so each one's live outputs (the carry)
        stay valid for the next; a capture that fails leaves no graph behind and the pool as it was.
        """
        inputs = DecodeInputs(rows, width, self.model.device, q=q)
        torch.cuda.synchronize(self.model.device)  # the eager warm-up forward has finished
        if not self._verify_graphs:  # no graph keeps the previous pool alive
            self._verify_pool = torch.cuda.graph_pool_handle()
        bounds = self._segment_bounds()
        graphs: list[torch.cuda.CUDAGraph] = []
        carry: StepCarry | None = None
        for index, (start, stop) in enumerate(bounds):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._verify_pool):
                if carry is None:
                    carry = self._verify_prologue(inputs, kv)
                carry = self._verify_layers(carry, inputs, kv, state, buffers, start, stop)
                if index == len(bounds) - 1:
                    hidden, logits = self._epilogue(carry)
            graphs.append(graph)
        return CapturedStep(graphs=graphs, inputs=inputs, hidden=hidden, logits=logits)

    def verify_step(
        self, inputs: DecodeInputs, kv: KVCache, state: StateCache, buffers: StateBuffers
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One verify traversal over the static buffers: final-normed hidden ``[T, H]`` and fp32 logits ``[T, V]``."""
        carry = self._verify_prologue(inputs, kv)
        carry = self._verify_layers(carry, inputs, kv, state, buffers, 0, len(self.model.layers))
        return self._epilogue(carry)

    def _verify_prologue(self, inputs: DecodeInputs, kv: KVCache) -> StepCarry:
        """Embeddings and each new token's KV slot; ``total_lens`` carries the rows' cached lengths."""
        page_size = kv.page_size
        offsets = torch.arange(inputs.q, device=inputs.context_lens.device)
        positions = inputs.context_lens[:, None] + offsets[None, :]  # [R, q] position of each new token
        pages = inputs.page_tables.gather(1, positions // page_size)
        return StepCarry(
            hidden=F.embedding(inputs.token_ids, self.model.embed_tokens),
            pending=None,
            slot_mapping=(pages * page_size + positions % page_size).reshape(-1),
            total_lens=inputs.context_lens,
        )

    def _verify_layers(
        self, carry: StepCarry, inputs: DecodeInputs, kv: KVCache, state: StateCache, buffers: StateBuffers,
        start: int, stop: int,
    ) -> StepCarry:
        """Layers ``[start, stop)`` of the trunk over the verify tokens."""
        model, config = self.model, self.config
        kinds = config.layer_types
        attention_index = sum(1 for kind in kinds[:start] if kind == FULL_ATTENTION)
        recurrent_index = start - attention_index
        hidden, pending = carry.hidden, carry.pending
        for layer, fused, kind in zip(model.layers[start:stop], self.fused[start:stop], kinds[start:stop]):
            hidden, normed = self._add_norm(pending, hidden, layer.input_layernorm)
            if kind == FULL_ATTENTION:
                pending = self._verify_attention(
                    layer.mixer, fused, normed, inputs, carry.slot_mapping,  # type: ignore[arg-type]
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
        return StepCarry(hidden=hidden, pending=pending, slot_mapping=carry.slot_mapping, total_lens=carry.total_lens)

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
        qkv, z, b, a = self.gated_deltanet_inputs(fused, normed)
        mixed = causal_conv1d_verify(
            qkv, weights.conv_weight, conv_cache, inputs.state_slots, tokens_per_row=inputs.q,
            states_out=conv_states,
        )
        core, _ = fused_recurrent_gated_delta(
            mixed, a, b, weights.decay_rate, weights.dt_bias, ssm_cache, inputs.state_slots,
            key_heads=config.linear_num_key_heads, tokens_per_row=inputs.q, z=z, norm_weight=weights.norm,
            norm_eps=config.rms_norm_eps, states_out=ssm_states,
        )
        return F.linear(core.view(normed.shape[0], config.linear_value_dim), weights.out_proj)

    def _verify_attention(
        self,
        weights: FullAttentionWeights,
        fused: FusedProjections,
        normed: torch.Tensor,
        inputs: DecodeInputs,
        slot_mapping: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        query, gate = self.attention_query(weights, fused, normed, inputs.positions, slot_mapping, key_cache, value_cache)
        attended = paged_attention_verify(
            query, key_cache, value_cache, inputs.page_tables, inputs.context_lens, tokens_per_row=inputs.q,
            scale=self.config.head_dim**-0.5, gate=gate,
        )
        return F.linear(attended, weights.o_proj)
