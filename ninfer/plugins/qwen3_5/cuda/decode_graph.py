"""The CUDA decode path: one token per row through fused Triton kernels, captured as one CUDA graph per batch size.

A decode step reads only static device buffers (token ids, MRoPE positions, cached lengths, page tables, state
slots), so it has no host syncs and no control flow that depends on tensor values; the KV pages and state slots are
updated in place. The first step of a batch size (and page-table width bucket) runs eagerly and serves as warm-up;
the step is captured right after it and replayed from then on. With graphs disabled the same kernels run eagerly.

The captured step can be split into ``graph_segments`` graphs of consecutive layers, launched one after the other,
of 1, 4, 16, ... layers (the last takes the rest, ``segment_bounds``). The GPU starts a graph only once its launch
call returns, which costs the host up to ~0.1 ms for a whole step, so when every step waits for its token on the
host a one-layer first graph lets the GPU start at once. With overlapped decode (the engine's CUDA default) the next
step is launched while this one runs, so the default is one graph: each segment boundary is a gap that no
programmatic dependent launch bridges (35B-A3B on the H200, one graph against 4 segments: graphs 2.284 against
2.306 ms, overlapped step 2.327 against 2.351 ms, the plain step the same).

For batches of at most ``norm_gemv_rows`` rows the norms fold into the GEMVs that read them (``norm_gemv``): the
input add+RMSNorm into the mixer's input projection, the Gated DeltaNet output norm into its out projection, and
(``norm_gemv_ffn``) the post-attention add+RMSNorm into the FFN entry (the MoE block's router: the persistent
kernel's first phase or the grouped router launch; or the dense / MoE entry GEMV), so a layer runs without a separate
norm launch.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import attrs
import torch
import torch.nn.functional as F

from ninfer.core.runtime import ForwardBatch, ForwardOutput, KVCache, StateCache, state_update_mask
from ninfer.kernels.transfer import copy_stream
from ninfer.kernels.triton import next_power_of_2, triton_available
from ninfer.kernels.triton.act_gemv import act_gemv
from ninfer.kernels.triton.attention import paged_attention_decode, qk_norm_rope_write_kv
from ninfer.kernels.triton.conv import causal_conv1d_update
from ninfer.kernels.triton.gated_delta import fused_recurrent_gated_delta
from ninfer.kernels.triton.moe import combine_experts, expert_gemv, route_top_k
from ninfer.kernels.triton.moe_grouped import MAX_TOKENS as GROUPED_MOE_MAX_ROWS
from ninfer.kernels.triton.moe_grouped import grouped_moe_decode, grouped_moe_decode_add_norm, moe_workspace
from ninfer.kernels.triton.moe_persistent import NotResidentError, persistent_moe_decode
from ninfer.kernels.triton.norm_gemv import MAX_ROWS as NORM_GEMV_MAX_ROWS
from ninfer.kernels.triton.norm_gemv import (
    ArgmaxEpilogue,
    ConvEpilogue,
    add_norm_gemv,
    argmax_keys,
    gated_norm_gemv,
    greedy_ids_from_keys,
)
from ninfer.kernels.triton.norms import add_rms_norm, silu_mul
from ninfer.kernels.triton.pending_state import PendingLayer, PendingStateUpdates
from ninfer.kernels.triton.staging import decode_prologue, stage_inputs
from ninfer.plugins.qwen3_5.model.config import FULL_ATTENTION, Qwen35TextConfig
from ninfer.plugins.qwen3_5.model.fused import FusedProjections, moe_widths
from ninfer.plugins.qwen3_5.model.layers import (
    DecoderLayerWeights,
    DenseMLPWeights,
    FullAttentionWeights,
    GatedDeltaNetWeights,
    MoEWeights,
)
from ninfer.plugins.qwen3_5.model.model import Qwen35Model

log = logging.getLogger("ninfer.decode")

MIN_PAGE_BUCKET = 64  # page-table widths are bucketed to powers of two from here
SEGMENT_GROWTH = 4  # each graph segment of a step holds this many times the layers of the one before
# DecodeInputs' fields, in buffer order
TOKEN_IDS, POSITIONS, CONTEXT_LENS, STATE_SLOTS, PAGE_TABLES, LOGITS_ADDRESS, GREEDY_ADDRESS, GREEDY_BELOW = range(8)


class DecodeInputs:
    """Static device buffers of one captured batch shape: ``rows`` rows of ``q`` tokens each (1 for decode, k+1 for a
    speculative verify), page tables ``width`` pages wide.

    All inputs live in one int64 device buffer filled by a single copy from a pinned host staging buffer:
    ``token_ids [T]``, ``positions [3, T]`` (MRoPE rows), ``context_lens [R]`` (tokens cached before this forward),
    ``state_slots [R]``, ``page_tables [R, W]`` (T = R*q) and, for a step whose lm_head folds the final norm,
    ``logits_address [1]`` and ``greedy_address [1]`` (where it stores its logits and greedy ids: tensors allocated
    for that step) and ``greedy_below [1]`` (the argmax's column limit; 0: no argmax). ``argmax_keys [R]``: the
    lm_head's argmax keys (``ArgmaxEpilogue``), ``INT64_MIN`` between steps.
    """

    def __init__(self, rows: int, width: int, device: torch.device, q: int = 1) -> None:
        self.rows, self.q, self.width = rows, q, width
        tokens = rows * q
        self._bounds = (tokens, 4 * tokens, 4 * tokens + rows, 4 * tokens + 2 * rows, 4 * tokens + rows * (2 + width))
        size = self._bounds[-1] + 3
        self.device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self.host_buffer = torch.zeros(size, dtype=torch.int64, pin_memory=cuda)
        # CUDA: the host fields land in a buffer of their own on the inbound copy stream, ahead of the step, and
        # one launch on the compute stream stages them with the sampled ids and the masked slots
        self._landing = torch.zeros_like(self.device_buffer) if cuda else None
        self._copied = torch.cuda.Event() if cuda else None  # the landing copy is done
        self._staged = torch.cuda.Event() if cuda else None  # the staging launch has read the landing buffer
        self._device_views = self._views(self.device_buffer)
        (self.token_ids, self.positions, self.context_lens, self.state_slots, self.page_tables,
         self.logits_address, self.greedy_address, self.greedy_below) = self._device_views
        self.argmax_keys = argmax_keys(rows, device)
        self._host_views = self._views(self.host_buffer.numpy())
        self._landing_views = self._views(self._landing) if cuda else None

    def _views(self, buffer: Any) -> tuple[Any, ...]:
        """The eight fields as views of ``buffer`` (the device tensor or the host numpy array)."""
        a, b, c, d, e = self._bounds
        return (
            buffer[:a],
            buffer[a:b].reshape(3, a),
            buffer[b:c],
            buffer[c:d],
            buffer[d:e].reshape(self.rows, self.width),
            buffer[e : e + 1],
            buffer[e + 1 : e + 2],
            buffer[e + 2 :],
        )

    def load(
        self, batch: ForwardBatch, logits: torch.Tensor | None = None, greedy_ids: torch.Tensor | None = None
    ) -> None:
        """Stage one batch into the device buffer without a host sync; ``logits`` and ``greedy_ids``: the tensors
        whose addresses the step finds in ``logits_address`` and ``greedy_address`` (the argmax below
        ``batch.greedy_below`` columns).

        Host fields are written through numpy views of the pinned buffer (no torch op, no allocation) and go over in
        one asynchronous transfer; fields already on the device are copied device to device after it. With
        ``state_update_stops`` the slot ``s`` of each row whose state must not take its token becomes ``-1 - s``,
        which the recurrent kernels read from and do not write. On CUDA the transfer runs on the inbound copy
        stream into a landing buffer (while the previous step still reads the device buffer), and one launch
        (``stage_inputs``) moves it into the device buffer with the device-resident token ids (a sampler's, fed
        back) and the slot masking.
        """
        if self._copied is not None:
            self._copied.synchronize()  # the previous transfer has read the pinned buffer
        self._host_views[CONTEXT_LENS][...] = batch.context_lens
        self._host_views[LOGITS_ADDRESS][...] = 0 if logits is None else logits.data_ptr()
        self._host_views[GREEDY_ADDRESS][...] = 0 if greedy_ids is None else greedy_ids.data_ptr()
        self._host_views[GREEDY_BELOW][...] = 0 if greedy_ids is None else batch.greedy_below
        width = batch.page_tables.shape[1]
        on_device = []
        fields = (
            (batch.token_ids, TOKEN_IDS), (batch.positions, POSITIONS), (batch.state_slots, STATE_SLOTS),
            (batch.page_tables, PAGE_TABLES),
        )
        for source, field in fields:
            if source.device.type == "cpu":
                _field(self._host_views, field, width)[...] = source.numpy()
            else:
                on_device.append((field, source))
        stops = batch.state_update_stops  # a masked row's slot s goes to the kernels as -1 - s: read, not written
        if stops is not None:
            stops = stops.to(self.device_buffer.device)
        if self._landing is None:
            self._load_plain(on_device, stops, width)
            return
        stream = copy_stream(self.device_buffer.device, to_host=False)
        stream.wait_event(self._staged)
        with torch.cuda.stream(stream):
            self._landing.copy_(self.host_buffer, non_blocking=True)
        self._copied.record(stream)
        torch.cuda.current_stream(self.device_buffer.device).wait_event(self._copied)
        ids = None
        for field, source in on_device:
            if field == TOKEN_IDS:
                ids = source
            else:
                _field(self._landing_views, field, width).copy_(source)
        slots_at = self._bounds[STATE_SLOTS - 1]  # where the field before the slots ends
        stage_inputs(self._landing, self.device_buffer, ids, stops, slots_at=slots_at)
        self._staged.record()

    def _load_plain(self, on_device: list[tuple[int, torch.Tensor]], stops: torch.Tensor | None, width: int) -> None:
        """``load`` off CUDA: one copy into the device buffer, then the device fields and the masking as torch ops."""
        self.device_buffer.copy_(self.host_buffer)
        for field, source in on_device:
            _field(self._device_views, field, width).copy_(source)
        if stops is not None:
            keep = state_update_mask(self.token_ids, stops)
            self.state_slots.copy_(torch.where(keep, self.state_slots, -1 - self.state_slots))


def _field(views: tuple[Any, ...], field: int, width: int) -> Any:
    """Field ``field`` of ``DecodeInputs._views``, the page tables cut to their first ``width`` columns."""
    return views[field][:, :width] if field == PAGE_TABLES else views[field]


@attrs.define
class CapturedStep:
    """One captured decode step or verify forward: its graphs (layer segments, launched in order) and static
    inputs/outputs."""

    graphs: list[torch.cuda.CUDAGraph]
    inputs: DecodeInputs
    hidden: torch.Tensor
    logits: torch.Tensor | None  # None where the step stores them at ``inputs.logits_address``

    def replay(self) -> None:
        for graph in self.graphs:
            graph.replay()


@attrs.define
class StepCarry:
    """What flows from one layer segment to the next: the residual stream and the pending block output."""

    hidden: torch.Tensor
    pending: torch.Tensor | None
    slot_mapping: torch.Tensor
    total_lens: torch.Tensor


class DecodeGraphRunner:
    """Runs pure-decode batches of a CUDA-resident ``Qwen35Model`` whose input projections are fused."""

    def __init__(
        self,
        model: Qwen35Model,
        fused: Sequence[FusedProjections],
        *,
        use_graphs: bool = True,
        max_batch: int = 64,
        graph_segments: int = 1,
        grouped_moe_rows: int = 1,
        gdn_value_split: int = 4,
        norm_gemv_rows: int = 0,
        norm_gemv_ffn: bool = True,
        down_gemv_rows: int = 1,
        out_gemv_rows: int = 1,
        persistent_moe: bool = True,
        pending_updates: int = 4,
    ) -> None:
        if not triton_available(model.device):
            raise ValueError(f"the decode runner needs Triton on the model's device ({model.device})")
        if model.device.type != "cuda" and use_graphs:
            raise ValueError("CUDA graphs need a CUDA model")
        self.model = model
        self.config: Qwen35TextConfig = model.config
        self.fused = tuple(fused)
        self.use_graphs = use_graphs
        self.max_batch = max_batch
        if graph_segments < 1:
            raise ValueError(f"graph_segments must be >= 1, got {graph_segments}")
        self.graph_segments = min(graph_segments, len(model.layers))
        # MoE block as three launches with each selected expert read once per batch (``grouped_moe_decode``:
        # router GEMV + routing, grouped gate/up + SiLU·mul, grouped down + combine + shared expert) for batches
        # of at most this many rows (0: never; capped at GROUPED_MOE_MAX_ROWS); its counters live in one
        # workspace that every call leaves zeroed. Default 1: faster at batch 1 on the H200, slower at 8 rows.
        self.grouped_moe_rows = grouped_moe_rows
        # one-row MoE blocks as one persistent launch (``persistent_moe_decode``: router, gate/up and down phases
        # behind grid barriers) instead of the grouped kernels' three
        self.persistent_moe = persistent_moe
        self._moe_workspace = moe_workspace(self.config.hidden_size, model.device) if self.config.is_moe else None
        # programs per Gated DeltaNet value head in the decode kernel (> 1: the output norm becomes a second launch;
        # 4: the fastest at 1 and 8 rows on the H200)
        self.gdn_value_split = gdn_value_split
        # the Gated DeltaNet steps leave up to this many updates of a state pending (``pending_state``) and store it
        # once every ``pending_updates + 1`` steps (0: every step); 4: the fastest on the H200 (8 is no faster than
        # storing every step: the replay before the step grows)
        if pending_updates < 0:
            raise ValueError(f"pending_updates must be >= 0, got {pending_updates}")
        self.pending_updates = pending_updates
        # norms folded into the GEMVs that read them (``norm_gemv``) for batches of at most this many rows (0: never;
        # capped at NORM_GEMV_MAX_ROWS); ``norm_gemv_ffn``: the post-attention norm too. ``accelerate`` chooses it
        # per model from the H200 measurements (docs/lab/performance-history.md).
        for name, rows in (("norm_gemv_rows", norm_gemv_rows), ("down_gemv_rows", down_gemv_rows),
                           ("out_gemv_rows", out_gemv_rows)):
            if rows < 0:
                raise ValueError(f"{name} must be >= 0, got {rows}")
        self.norm_gemv_rows = norm_gemv_rows
        self.norm_gemv_ffn = norm_gemv_ffn
        # batches of at most this many rows run the dense MLP's SiLU·mul + down projection as one ``act_gemv``
        # launch (``down_gemv_rows``) and the attention / unfolded GDN output projections on ``act_gemv`` instead of
        # cuBLAS (``out_gemv_rows``); 0: never
        self.down_gemv_rows = down_gemv_rows
        self.out_gemv_rows = out_gemv_rows
        self._graphs: dict[tuple, CapturedStep] = {}
        self._eager_inputs: dict[tuple[int, int], DecodeInputs] = {}
        self._pool = None

    def reset(self) -> None:
        """Drop every captured decode step (after a change of its kernels or launch shapes); their memory pool goes
        with them, and the next step of each batch size captures again."""
        self._graphs.clear()
        self._pool = None

    def supports(self, batch: ForwardBatch) -> bool:
        """A pure decode batch (one new token per row, no state capture) this runner can take."""
        return (
            not batch.capture_states
            and 0 < batch.num_rows <= self.max_batch
            and all(n == 1 for n in batch.query_lens)
        )

    def forward(self, batch: ForwardBatch, kv: KVCache, state: StateCache) -> ForwardOutput:
        updates = self._pending_updates(state)
        rows = batch.num_rows
        width = max(MIN_PAGE_BUCKET, next_power_of_2(batch.page_tables.shape[1]))
        key = (rows, width, _identity(kv, state))
        captured = self._graphs.get(key) if self.use_graphs else None
        # where the lm_head folds the final norm, the step writes tensors of its own through staged addresses
        folds, device = self._lm_head_folds(rows), self.model.device
        logits = torch.empty((rows, self.model.lm_head.shape[0]), dtype=torch.float32, device=device) if folds else None
        greedy = batch.greedy_below is not None and folds
        greedy_ids = torch.empty(rows, dtype=torch.int64, device=device) if greedy else None
        if captured is not None:
            captured.inputs.load(batch, logits, greedy_ids)
            captured.replay()
            hidden, static_logits = captured.hidden, captured.logits
            hidden = hidden.clone() if batch.return_hidden else None
        else:
            inputs = self._eager_inputs.get((rows, width))
            if inputs is None:
                inputs = self._eager_inputs[(rows, width)] = DecodeInputs(rows, width, self.model.device)
            inputs.load(batch, logits, greedy_ids)
            hidden, static_logits = self.step(inputs, kv, state)
            if self.use_graphs:
                self._graphs[key] = self._capture(rows, width, kv, state)
        if updates is not None:
            updates.dirty = True
        if logits is None and batch.logits != "none":
            logits = static_logits.to(torch.float32, copy=True)  # a copy, which the next replay cannot overwrite
        return ForwardOutput(
            logits=None if batch.logits == "none" else logits, hidden=hidden if batch.return_hidden else None,
            greedy_ids=greedy_ids,
        )

    def _pending_updates(self, state: StateCache) -> PendingStateUpdates | None:
        """``state``'s pending updates (attached on first use), or None where every step stores its states."""
        if not self.pending_updates or not state.unsettled_ssm():
            return None
        if state.pending is None:
            state.pending = PendingStateUpdates.allocate(
                state.unsettled_ssm(), self.pending_updates, self.gdn_value_split
            )
        updates = state.pending
        shape = (self.pending_updates, self.gdn_value_split)
        if not isinstance(updates, PendingStateUpdates) or (updates.capacity, updates.value_split) != shape:
            raise ValueError("the state cache's pending updates are not this decode runner's")
        return updates

    def captured(self, rows: int) -> list[CapturedStep]:
        """The graphs captured so far for batches of ``rows`` rows (any page-table width or cache)."""
        return [step for key, step in self._graphs.items() if key[0] == rows]

    def _capture(self, rows: int, width: int, kv: KVCache, state: StateCache) -> CapturedStep:
        """Record one step over fresh static buffers (capturing executes nothing, so no cache is touched).

        The segments share one memory pool and are captured in launch order, so each one's live outputs (the carry)
        stay valid for the next.
        """
        inputs = DecodeInputs(rows, width, self.model.device)
        torch.cuda.synchronize(self.model.device)  # the eager warm-up step has finished
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        bounds = self._segment_bounds()
        graphs: list[torch.cuda.CUDAGraph] = []
        carry: StepCarry | None = None
        for index, (start, stop) in enumerate(bounds):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                if carry is None:
                    carry = self._prologue(inputs, kv)
                carry = self._layers(carry, inputs, kv, state, start, stop)
                if index == len(bounds) - 1:
                    hidden, logits = self._epilogue(carry, inputs)
            graphs.append(graph)
        return CapturedStep(graphs=graphs, inputs=inputs, hidden=hidden, logits=logits)

    def _segment_bounds(self) -> list[tuple[int, int]]:
        return segment_bounds(len(self.model.layers), self.graph_segments)

    def step(
        self, inputs: DecodeInputs, kv: KVCache, state: StateCache
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode traversal over the static buffers: returns final-normed hidden ``[B, H]`` and the logits
        (``_epilogue``: None where they go to ``inputs.logits_address``; else ``forward`` returns an fp32 copy)."""
        carry = self._layers(self._prologue(inputs, kv), inputs, kv, state, 0, len(self.model.layers))
        return self._epilogue(carry, inputs)

    def _prologue(self, inputs: DecodeInputs, kv: KVCache) -> StepCarry:
        hidden, slot_mapping, total_lens = decode_prologue(
            inputs.token_ids, inputs.context_lens, inputs.page_tables, self.model.embed_tokens, kv.page_size
        )
        # pending: the previous block's output, not yet added to the residual stream
        return StepCarry(hidden=hidden, pending=None, slot_mapping=slot_mapping, total_lens=total_lens)

    def _layers(
        self, carry: StepCarry, inputs: DecodeInputs, kv: KVCache, state: StateCache, start: int, stop: int
    ) -> StepCarry:
        """Layers ``[start, stop)`` of the trunk."""
        model, config = self.model, self.config
        kinds = config.layer_types
        attention_index = sum(1 for kind in kinds[:start] if kind == FULL_ATTENTION)
        recurrent_index = start - attention_index
        hidden, pending = carry.hidden, carry.pending
        updates = self._pending_updates(state)
        fold_norms = hidden.shape[0] <= min(self.norm_gemv_rows, NORM_GEMV_MAX_ROWS)
        for layer, fused, kind in zip(model.layers[start:stop], self.fused[start:stop], kinds[start:stop]):
            recurrent = kind != FULL_ATTENTION
            if fold_norms:  # a GDN layer's conv step runs inside its input projection
                conv = (
                    ConvEpilogue(layer.mixer.conv_weight, state.conv[recurrent_index], inputs.state_slots)
                    if recurrent else None
                )
                hidden, projected, _ = add_norm_gemv(
                    hidden, pending, layer.input_layernorm, fused.mixer_in, config.rms_norm_eps, conv=conv
                )
            else:
                hidden, normed = self._add_norm(pending, hidden, layer.input_layernorm)
                projected = F.linear(normed, fused.mixer_in)
            if not recurrent:
                pending = self._attention(
                    layer.mixer, projected, inputs, carry.slot_mapping, carry.total_lens,  # type: ignore[arg-type]
                    kv.key[attention_index], kv.value[attention_index],
                )
                attention_index += 1
            else:
                pending = self._gated_deltanet(
                    layer.mixer, projected, inputs.state_slots,  # type: ignore[arg-type]
                    state.conv[recurrent_index], state.unsettled_ssm()[recurrent_index], fold_norms,
                    None if updates is None else updates.layers[recurrent_index],
                )
                recurrent_index += 1
            if fold_norms and self.norm_gemv_ffn:
                hidden, pending = self._feed_forward_add_norm(layer, fused, hidden, pending)
            else:
                hidden, normed = self._add_norm(pending, hidden, layer.post_attention_layernorm)
                pending = self.feed_forward(layer, fused, normed)
        return StepCarry(hidden=hidden, pending=pending, slot_mapping=carry.slot_mapping, total_lens=carry.total_lens)

    def _lm_head_folds(self, tokens: int) -> bool:
        """Whether the final norm of ``tokens`` rows goes inside the lm_head GEMV (``_epilogue``)."""
        return tokens <= max(1, min(self.norm_gemv_rows, NORM_GEMV_MAX_ROWS))

    def _epilogue(
        self, carry: StepCarry, inputs: DecodeInputs | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(final-normed hidden, logits with the activation dtype's values)``: at one row, and where the layers
        fold their norms, the final norm goes inside the lm_head GEMV, which stores the logits as fp32 (faster than
        the norm launch and cuBLAS at one row: 35B-A3B 222 against 242 µs, 27B 562 against 597 µs on the H200).
        With the step's ``inputs`` (a decode step) it stores them at the staged ``logits_address`` (then the logits
        returned are None: no copy after a replay) and takes the argmax below the staged ``greedy_below`` into
        ``greedy_address`` (``ArgmaxEpilogue``: no argmax launches after it)."""
        model, eps = self.model, self.config.rms_norm_eps
        if self._lm_head_folds(carry.hidden.shape[0]):
            _, logits, final = add_norm_gemv(
                carry.hidden, carry.pending, model.norm, model.lm_head, eps, keep_normed=True, out_dtype=torch.float32,
                out_address=None if inputs is None else inputs.logits_address,
                argmax=None if inputs is None else ArgmaxEpilogue(inputs.argmax_keys, inputs.greedy_below),
            )
            if inputs is not None:
                greedy_ids_from_keys(inputs.argmax_keys, inputs.greedy_address)
            return final, logits
        _, final = self._add_norm(carry.pending, carry.hidden, model.norm)
        return final, model.activation_logits(final)

    def _add_norm(
        self, pending: torch.Tensor | None, hidden: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if pending is None:
            return add_rms_norm(hidden, None, weight, self.config.rms_norm_eps)
        return add_rms_norm(pending, hidden, weight, self.config.rms_norm_eps)

    def _gated_deltanet(
        self,
        weights: GatedDeltaNetWeights,
        projected: torch.Tensor,
        slots: torch.Tensor,
        conv_cache: torch.Tensor,
        ssm_cache: torch.Tensor,
        fold_norm: bool,
        updates: PendingLayer | None = None,
    ) -> torch.Tensor:
        """The GDN mixer from its fused input projection; ``fold_norm``: the projection came from ``add_norm_gemv``
        with the conv step inside (its q|k|v columns are the conv's output) and the gated output norm goes inside the
        out GEMV; ``updates``: the state's records of pending updates."""
        config = self.config
        qkv, z, b, a = self.gated_deltanet_inputs(projected)
        mixed = qkv if fold_norm else causal_conv1d_update(qkv, weights.conv_weight, conv_cache, slots)
        output_norm = {} if fold_norm else dict(z=z, norm_weight=weights.norm, norm_eps=config.rms_norm_eps)
        core, _ = fused_recurrent_gated_delta(
            mixed, a, b, weights.decay_rate, weights.dt_bias, ssm_cache, slots,
            key_heads=config.linear_num_key_heads, value_split=self.gdn_value_split, pending=updates, **output_norm,
        )
        if fold_norm:
            return gated_norm_gemv(core, z, weights.norm, weights.out_proj, config.rms_norm_eps)
        return self._out_projection(core.view(projected.shape[0], config.linear_value_dim), weights.out_proj)

    def gated_deltanet_inputs(
        self, projected: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The strided views ``(qkv, z, b, a)`` of the fused GDN entry projection ``normed @ mixer_in^T``."""
        config = self.config
        conv_dim, value_dim, value_heads = config.conv_dim, config.linear_value_dim, config.linear_num_value_heads
        z = projected[:, conv_dim : conv_dim + value_dim]
        b = projected[:, conv_dim + value_dim : conv_dim + value_dim + value_heads]
        return projected[:, :conv_dim], z, b, projected[:, conv_dim + value_dim + value_heads :]

    def attention_query(
        self,
        weights: FullAttentionWeights,
        projected: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """From the fused q/gate/k/v projection (``normed @ mixer_in^T``): q/k norms + RoPE with the new K/V written;
        returns ``(query, output gate view)``."""
        config, model = self.config, self.model
        heads, dim = config.num_attention_heads, config.head_dim
        query = qk_norm_rope_write_kv(
            projected, weights.q_norm, weights.k_norm, positions, model.inverse_frequencies,
            model.axis_of_frequency, key_cache, value_cache, slot_mapping, config.rms_norm_eps, query_heads=heads,
        )
        return query, projected[:, : heads * 2 * dim].view(-1, heads, 2 * dim)[:, :, dim:]

    def _attention(
        self,
        weights: FullAttentionWeights,
        projected: torch.Tensor,
        inputs: DecodeInputs,
        slot_mapping: torch.Tensor,
        total_lens: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        query, gate = self.attention_query(weights, projected, inputs.positions, slot_mapping, key_cache, value_cache)
        attended = paged_attention_decode(
            query, key_cache, value_cache, inputs.page_tables, total_lens, scale=self.config.head_dim**-0.5, gate=gate
        )
        return self._out_projection(attended, weights.o_proj)

    def _out_projection(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A mixer's output projection: ``act_gemv`` for small batches (``out_gemv_rows``), else cuBLAS."""
        if x.shape[0] <= min(self.out_gemv_rows, NORM_GEMV_MAX_ROWS):
            return act_gemv(x, weight)
        return F.linear(x, weight)

    def _down_projection(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The dense MLP's ``down(silu(gate) * up)``: one ``act_gemv`` for small batches (``down_gemv_rows``)."""
        if gate_up.shape[0] <= min(self.down_gemv_rows, NORM_GEMV_MAX_ROWS):
            return act_gemv(gate_up, weight, silu_mul=True)
        return F.linear(silu_mul(gate_up), weight)

    def feed_forward(self, layer: DecoderLayerWeights, fused: FusedProjections, normed: torch.Tensor) -> torch.Tensor:
        """The layer's dense or MoE block on the decode kernels (also the MTP layer's, see ``Qwen35MTP``)."""
        mlp = layer.mlp
        if isinstance(mlp, DenseMLPWeights):
            return self._down_projection(F.linear(normed, fused.ffn_in), mlp.down_proj)
        persistent = self._persistent_moe_block(normed, None, None, 0.0, mlp, fused)
        if persistent is not None:
            return persistent[0]
        if self._grouped_moe(normed.shape[0]):
            return grouped_moe_decode(normed, **self._grouped_moe_weights(mlp, fused))
        return self._routed_experts(mlp, normed, F.linear(normed, fused.ffn_in))

    def _feed_forward_add_norm(
        self, layer: DecoderLayerWeights, fused: FusedProjections, hidden: torch.Tensor, pending: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(new hidden, block output)``: ``feed_forward`` with the post-attention add+RMSNorm inside its entry."""
        mlp, norm, eps = layer.mlp, layer.post_attention_layernorm, self.config.rms_norm_eps
        if isinstance(mlp, DenseMLPWeights):
            hidden, gate_up, _ = add_norm_gemv(hidden, pending, norm, fused.ffn_in, eps)
            return hidden, self._down_projection(gate_up, mlp.down_proj)
        persistent = self._persistent_moe_block(hidden, pending, norm, eps, mlp, fused)
        if persistent is not None:
            return persistent[1], persistent[0]
        if self._grouped_moe(hidden.shape[0]):
            weights = self._grouped_moe_weights(mlp, fused)
            out, hidden = grouped_moe_decode_add_norm(hidden, pending, norm, eps, **weights)
            return hidden, out
        hidden, entry, normed = add_norm_gemv(hidden, pending, norm, fused.ffn_in, eps, keep_normed=True)
        return hidden, self._routed_experts(mlp, normed, entry)  # type: ignore[arg-type]

    def _persistent_moe_block(
        self,
        hidden: torch.Tensor,
        pending: torch.Tensor | None,
        norm: torch.Tensor | None,
        eps: float,
        mlp: MoEWeights,
        fused: FusedProjections,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(block output, new hidden)`` of a one-row MoE block from ``persistent_moe_decode``, or None when the
        batch has more rows or the device cannot hold its grid at once (the runner then keeps the grouped kernels;
        that is found at the first, eager, step)."""
        if hidden.shape[0] != 1 or not self.persistent_moe:
            return None
        try:
            out, new_hidden, _ = persistent_moe_decode(
                hidden, pending, norm, eps, **self._grouped_moe_weights(mlp, fused)
            )
        except NotResidentError as exc:
            log.warning("the persistent MoE block does not fit this device (%s): the grouped kernels run instead", exc)
            self.persistent_moe = False
            return None
        return out, new_hidden

    def _grouped_moe(self, rows: int) -> bool:
        return rows <= min(self.grouped_moe_rows, GROUPED_MOE_MAX_ROWS)

    def _grouped_moe_weights(self, mlp: MoEWeights, fused: FusedProjections) -> dict[str, Any]:
        """The grouped (and persistent) MoE kernels' weight arguments: views of the fused entry rows
        ``[router | shared gate | shared up | shared expert gate]`` and the expert tensors."""
        num_experts, shared_inner = moe_widths(mlp)
        rows = fused.ffn_in
        return dict(
            router=rows[:num_experts], gate_up=mlp.gate_up, down=mlp.down, top_k=self.config.num_experts_per_tok,
            shared_gate_up=rows[num_experts : num_experts + 2 * shared_inner], shared_down=mlp.shared_down,
            shared_expert_gate=rows[num_experts + 2 * shared_inner :], workspace=self._moe_workspace,
        )

    def _routed_experts(self, mlp: MoEWeights, normed: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        """The MoE block as separate launches, from the normed rows and their entry GEMM ``normed @ ffn_in^T``."""
        top_k = self.config.num_experts_per_tok
        num_experts, shared_inner = moe_widths(mlp)
        shared_gate_up = entry[:, num_experts : num_experts + 2 * shared_inner]
        weights, experts = route_top_k(entry[:, :num_experts], top_k)  # type: ignore[arg-type]
        shared = F.linear(silu_mul(shared_gate_up), mlp.shared_down)
        activated = silu_mul(expert_gemv(normed, mlp.gate_up, experts, pairs_per_x=top_k))  # type: ignore[arg-type]
        expert_out = expert_gemv(activated, mlp.down, experts, pairs_per_x=1)
        return combine_experts(expert_out, weights, shared, entry[:, num_experts + 2 * shared_inner :])


def segment_bounds(layers: int, segments: int) -> list[tuple[int, int]]:
    """``[start, stop)`` layers of at most ``segments`` graphs: 1, 4, 16, ... layers, the last one taking the rest."""
    bounds, start, size = [], 0, 1
    for index in range(segments):
        stop = layers if index == segments - 1 else min(layers, start + size)
        if stop > start:
            bounds.append((start, stop))
        start, size = stop, size * SEGMENT_GROWTH
    return bounds


def _identity(kv: KVCache, state: StateCache) -> tuple[int, ...]:
    """The cache storage a captured graph is bound to (caches are allocated whole, so the ends identify them)."""
    ends = [t[i].data_ptr() for t in (kv.key, kv.value, state.conv, state.unsettled_ssm()) if t for i in (0, -1)]
    return (kv.page_size, *ends)
