"""``load_runtime``: the Qwen3.5 model runtime the engine drives through ``ninfer.core.runtime.ModelRuntime``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import attrs
import torch

from ninfer.core.artifact.container import ModelSource
from ninfer.core.errors import ConfigError
from ninfer.core.runtime import (
    AttentionLayerSpec,
    ForwardBatch,
    ForwardOutput,
    KVCache,
    LoadOptions,
    RecurrentLayerSpec,
    RuntimeSpec,
    StateCache,
    WarmUpShapes,
    state_update_mask,
)
from ninfer.kernels.triton import triton_available
from ninfer.plugins.qwen3_5.model.config import Qwen35TextConfig
from ninfer.plugins.qwen3_5.model.layers import BatchLayout
from ninfer.plugins.qwen3_5.model.model import ForwardBatchError, Qwen35Model, WeightLoader, check_rows
from ninfer.plugins.qwen3_5.model.quantized import refuse_on_cuda
from ninfer.plugins.qwen3_5.speculative.mtp import Qwen35MTP

if TYPE_CHECKING:
    from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner
    from ninfer.plugins.qwen3_5.cuda.verify_graph import VerifyGraphRunner


def runtime_spec(config: Qwen35TextConfig, dtype: torch.dtype, device: torch.device) -> RuntimeSpec:
    """What the engine allocates: paged KV per full-attention layer, a StateImage part per Gated-DeltaNet layer."""
    return RuntimeSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        attention_layers=tuple(
            AttentionLayerSpec(index, config.num_key_value_heads, config.head_dim)
            for index in config.full_attention_layers
        ),
        recurrent_layers=tuple(
            RecurrentLayerSpec(
                layer_index=index,
                conv_dim=config.conv_dim,
                conv_window=config.linear_conv_kernel_dim - 1,
                num_value_heads=config.linear_num_value_heads,
                key_head_dim=config.linear_key_head_dim,
                value_head_dim=config.linear_value_head_dim,
            )
            for index in config.linear_attention_layers
        ),
        dtype=dtype,
        device=device,
        max_position_embeddings=config.max_position_embeddings,
        state_update_stops=True,
    )


class Qwen35Runtime:
    """The hybrid Gated-DeltaNet trunk plus, when the artifact carries it, the MTP drafter (``mtp``)."""

    def __init__(self, model: Qwen35Model, mtp: Qwen35MTP | None, decoder: "DecodeGraphRunner | None" = None) -> None:
        """With ``decoder`` (the CUDA decode path: Triton kernels, CUDA graphs) the runtime also verifies
        speculative batches through the CUDA verify runner and runs every other batch through the Triton traversal;
        without it (CPU) every batch takes the reference traversal."""
        self.model = model
        self.config = model.config
        self.mtp = mtp
        self.decoder = decoder
        self.verifier: "VerifyGraphRunner | None" = None
        if decoder is not None:
            from ninfer.plugins.qwen3_5.cuda import verify_graph  # imported here: CPU installs lack triton

            self.verifier = verify_graph.VerifyGraphRunner(
                decoder.model, decoder.fused, use_graphs=decoder.use_graphs, max_batch=decoder.max_batch
            )
        self.spec = runtime_spec(model.config, model.dtype, model.device)

    def forward(self, batch: ForwardBatch, kv: KVCache, state: StateCache) -> ForwardOutput:
        """One traversal: each row continues its KV pages and state slot with ``query_lens[row]`` new tokens.

        ``logits``/``hidden`` are per row for "last" and per token for "all"; with "none" there are no logits and
        ``hidden`` (if asked for) is per token. ``states`` holds the recurrent state after every new token when
        ``capture_states`` is set (from the CUDA verify runner: views of its buffers, valid until its next forward).
        Pure decode batches take the decode runner, verify batches (ragged ones padded) the verify runner, every
        other batch one ``Qwen35Model.run``: the Triton traversal alongside the decode runner, else the reference one.
        """
        self._check(batch, kv, state)
        if self.decoder is not None and not batch.capture_layers and self.decoder.supports(batch):
            return self.decoder.forward(batch, kv, state)
        if self.verifier is not None and self.verifier.supports(batch):
            return self.verifier.forward(batch, kv, state)
        device = self.model.device
        token_ids, positions = batch.token_ids.to(device), batch.positions.to(device)  # host batches move once
        stops = batch.state_update_stops
        layout = BatchLayout.build(
            batch.query_lens, batch.context_lens, batch.page_tables, kv.page_size, batch.state_slots, device,
            None if stops is None else state_update_mask(token_ids, stops.to(device)),
        )
        layer_outputs = dict.fromkeys(batch.capture_layers, None) if batch.capture_layers else None
        with torch.no_grad():
            hidden, captured = self.model.run(
                token_ids, positions, layout, kv, state, batch.capture_states, layer_outputs,
                fused=self.decoder is not None,
            )
            selected = hidden[layout.last_token_index] if batch.logits == "last" else hidden
            logits = None if batch.logits == "none" else self.model.logits(selected)
        layer_hidden = None
        if layer_outputs is not None:
            layer_hidden = torch.cat([layer_outputs[index] for index in batch.capture_layers], dim=-1)
        return ForwardOutput(
            logits=logits, hidden=selected if batch.return_hidden else None, states=captured, layer_hidden=layer_hidden
        )

    def warm_up(self, kv: KVCache, state: StateCache, shapes: WarmUpShapes) -> None:
        """Compile the CUDA prefill kernels for every length class a chunk can have (powers of two up to the chunk
        at root; continuing cached context at lengths and contexts that are and are not multiples of 16) and capture the decode graph of every batch size at every page-table
        width bucket; all on scratch (page 0, the first slots). Nothing to do on the reference (CPU) path."""
        if self.decoder is None:
            return
        from ninfer.plugins.qwen3_5.cuda.decode_graph import MIN_PAGE_BUCKET

        page_size = kv.page_size
        chunk = shapes.prefill_chunk
        lengths = sorted({*(1 << k for k in range(chunk.bit_length())), chunk})
        # Triton specializes integer arguments on divisibility by 16: continuing chunks of both kinds of length
        # after both kinds of context
        continuing = [(length, context) for length in (chunk, 3) for context in (chunk, chunk + 5)]
        for length, context in [*((n, 0) for n in lengths), *continuing]:
            self.forward(_scratch_batch([length], context, -(-(context + length) // page_size)), kv, state)
        width = MIN_PAGE_BUCKET
        while True:
            for rows in range(1, shapes.max_rows + 1):
                batch = _scratch_batch([1] * rows, min(width, shapes.max_pages) * page_size - 1, width)
                stops = torch.tensor([[1, -1]] * rows, dtype=torch.int64, device=self.model.device)
                ids = batch.token_ids.to(self.model.device)
                self.forward(attrs.evolve(batch, token_ids=ids, state_update_stops=stops,
                                          greedy_below=self.spec.vocab_size), kv, state)
            if width >= shapes.max_pages:
                break
            width *= 2
        torch.cuda.synchronize(self.model.device)

    def _check(self, batch: ForwardBatch, kv: KVCache, state: StateCache) -> None:
        if batch.logits not in ("last", "all", "none"):
            raise ForwardBatchError(f"logits must be 'last', 'all' or 'none', got {batch.logits!r}")
        if batch.token_ids.dim() != 1:
            raise ForwardBatchError(f"token_ids must be a flat [T] tensor; got {tuple(batch.token_ids.shape)}")
        check_rows(
            batch.token_ids.shape[0], batch.positions, batch.query_lens, batch.context_lens, batch.page_tables,
            kv.page_size,
        )
        rows = batch.num_rows
        if tuple(batch.state_slots.shape) != (rows,):
            raise ForwardBatchError(f"state_slots must be [{rows}]; got {tuple(batch.state_slots.shape)}")
        stops = batch.state_update_stops
        if stops is not None:
            if (
                stops.dtype != torch.int64 or stops.dim() != 2 or stops.shape[0] != rows or stops.shape[1] < 1
                or stops.device != batch.token_ids.device or any(n != 1 for n in batch.query_lens)
            ):
                raise ForwardBatchError(
                    f"state_update_stops must be an int64 [{rows}, 1 + W] on the token ids' device, of a "
                    "one-token-per-row batch"
                )
            # the ids of a masked batch are a sampler's, fed back on the device: checking them would read them back
            slots, low, high = batch.state_slots.tolist(), 0, 0
        else:
            slots, low, high = _slots_and_token_range(batch.state_slots, batch.token_ids)
        if len(set(slots)) != rows or min(slots) < 0 or max(slots) >= state.num_slots:
            raise ForwardBatchError(f"state_slots {slots} must be distinct slots in [0, {state.num_slots})")
        state_layers = len(state.unsettled_ssm())  # a count: no need to settle pending updates
        if len(kv.key) != len(self.spec.attention_layers) or state_layers != len(self.spec.recurrent_layers):
            raise ForwardBatchError(
                f"caches have {len(kv.key)} KV layers and {state_layers} state layers; this model needs "
                f"{len(self.spec.attention_layers)} and {len(self.spec.recurrent_layers)}"
            )
        bad_layers = [i for i in batch.capture_layers if not 0 <= i < self.config.num_hidden_layers]
        if bad_layers or len(set(batch.capture_layers)) != len(batch.capture_layers):
            raise ForwardBatchError(
                f"capture_layers {list(batch.capture_layers)} must be distinct decoder layers in "
                f"[0, {self.config.num_hidden_layers})"
            )
        if batch.greedy_below is not None and not (
            batch.logits == "last" and 1 <= batch.greedy_below <= self.spec.vocab_size
        ):
            raise ForwardBatchError(
                f"greedy_below must be in [1, {self.spec.vocab_size}] with logits 'last'; got {batch.greedy_below}"
            )
        if low < 0 or high >= self.config.vocab_size:
            raise ForwardBatchError(f"token ids must be in [0, {self.config.vocab_size}); got {low}..{high}")


def _scratch_batch(query_lens: list[int], context: int, width: int) -> ForwardBatch:
    """Rows of ``query_lens`` zero tokens after ``context`` cached ones, every page table all page 0, slots 0..R-1."""
    positions = torch.cat([torch.arange(context, context + length) for length in query_lens])
    return ForwardBatch(
        token_ids=torch.zeros(sum(query_lens), dtype=torch.int64),
        positions=positions.expand(3, -1),
        query_lens=query_lens,
        context_lens=[context] * len(query_lens),
        page_tables=torch.zeros(len(query_lens), width, dtype=torch.int32),
        state_slots=torch.arange(len(query_lens)),
    )


def _slots_and_token_range(slots: torch.Tensor, token_ids: torch.Tensor) -> tuple[list[int], int, int]:
    """The state slots and the lowest and highest token id, with one host transfer when both are on the device."""
    if slots.device == token_ids.device and slots.device.type != "cpu":
        low, high = token_ids.aminmax()
        values = torch.cat([slots.long(), low[None].long(), high[None].long()])
        *host_slots, low, high = values.tolist()
        return host_slots, low, high
    low, high = token_ids.aminmax()
    return slots.tolist(), int(low), int(high)


def load_target(options: LoadOptions) -> tuple[torch.dtype, torch.device]:
    """The dtype and device weights load as (``auto``: bf16 on CUDA, fp32 on the CPU); a ConfigError if unusable."""
    try:
        dtype = options.torch_dtype()
        device = torch.device(options.device)
    except (KeyError, RuntimeError) as exc:
        raise ConfigError(f"invalid load options {options!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {options.device!r} was requested but CUDA is not available")
    return dtype, device


def load_runtime(artifact: ModelSource, options: LoadOptions) -> Qwen35Runtime:
    """Build the runtime from an opened artifact: checks every tensor, loads the trunk and (if present) MTP.

    Quantized weights run on the CPU reference path only (``quantized.refuse_on_cuda``)."""
    dtype, device = load_target(options)
    refuse_on_cuda(artifact, device)
    config = Qwen35TextConfig.from_hf(artifact.manifest.config, artifact.manifest.architecture)
    loader = WeightLoader(artifact, dtype, device)
    model = Qwen35Model.load(loader, config)
    model, decoder = accelerate(model, cuda_graphs=options.cuda_graphs)
    return Qwen35Runtime(model, Qwen35MTP.load(loader, model), decoder)


def accelerate(
    model: Qwen35Model, *, cuda_graphs: bool, on_layer: Callable[[int, Any], None] | None = None
) -> tuple[Qwen35Model, "DecodeGraphRunner | None"]:
    """On CUDA with Triton: fuse the input projections and build the decode runner; elsewhere the model as is.

    ``on_layer`` is handed to ``fuse_model`` (called with each fused layer).
    """
    if model.device.type != "cuda" or not triton_available(model.device):
        return model, None
    from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner
    from ninfer.plugins.qwen3_5.model.fused import fuse_model

    model, fused = fuse_model(model, on_layer)
    # norms folded into the GEMVs at batch 1 (H200: 35B-A3B step 2.74 ms against 2.95 ms unfolded; 27B overlapped
    # step 13.13 against 13.46 ms, the GEMV taking 5120-wide rows in 1024-column steps); at 8 rows cuBLAS is faster
    # for both
    return model, DecodeGraphRunner(model, fused, use_graphs=cuda_graphs, norm_gemv_rows=1)
