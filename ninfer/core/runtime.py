"""The contract between the engine and a model runtime.

The engine owns all cache memory; a runtime only reads and writes through the views it is handed:

* ``KVCache`` — the paged Main Text KV pool of the full-attention layers. Token ``j`` of a row lives in
  page ``page_tables[row, j // page_size]`` at offset ``j % page_size``.
* ``StateCache`` — the StateImage pool: for every Gated-DeltaNet layer a conv window (the last
  ``conv_window`` inputs of the causal conv, model dtype) and an fp32 SSM state per slot.

``ModelRuntime.forward`` runs one traversal over a batch of rows. Each row continues from
``context_lens[row]`` tokens already in its pages and from the recurrent state in its slot (the engine
resets a slot before a fresh sequence) and appends ``query_lens[row]`` new tokens: a prefill chunk, one
decode token, or k+1 verify tokens. The runtime writes the new KV into the pages and leaves the state
after the row's last new token in the slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Literal, Protocol, Sequence

import attrs
import torch

from ninfer.core.errors import ConfigError
from ninfer.quant.kv_codecs import KVCodec

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.drafting import DraftRow


@attrs.frozen
class AttentionLayerSpec:
    """A full-attention layer that keeps paged KV."""

    layer_index: int
    num_kv_heads: int
    head_dim: int


@attrs.frozen
class RecurrentLayerSpec:
    """A Gated-DeltaNet layer: its StateImage part is a conv window plus an fp32 SSM state."""

    layer_index: int
    conv_dim: int
    conv_window: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def state_bytes(self) -> int:
        return self.num_value_heads * self.key_head_dim * self.value_head_dim * 4


@attrs.frozen
class RuntimeSpec:
    """What the engine must allocate for a runtime."""

    vocab_size: int
    hidden_size: int
    attention_layers: tuple[AttentionLayerSpec, ...]
    recurrent_layers: tuple[RecurrentLayerSpec, ...]
    dtype: torch.dtype
    device: torch.device
    max_position_embeddings: int
    state_update_stops: bool = False  # forward() honours ForwardBatch.state_update_stops (one-token decode batches)

    def kv_bytes_per_token(self, codec: KVCodec | None = None) -> float:
        """K+V bytes one token costs in a pool of the model dtype, or of ``codec``'s exact stored rows."""
        return sum(
            layer.num_kv_heads
            * (
                2 * layer.head_dim * self.dtype.itemsize
                if codec is None
                else codec.bytes_per_token_head(layer.head_dim)
            )
            for layer in self.attention_layers
        )

    def state_image_bytes(self) -> int:
        return sum(
            layer.state_bytes + layer.conv_dim * layer.conv_window * self.dtype.itemsize
            for layer in self.recurrent_layers
        )


@attrs.define
class KVCache:
    """Paged KV: ``key[i]``/``value[i]`` are ``[num_pages, page_size, num_kv_heads, head_dim]`` for attention layer i.

    With a ``codec`` (a quantized ``--kv-dtype``) each token-head vector is stored as the codec's packed bytes
    instead: uint8 ``[num_pages, page_size, num_kv_heads, key/value bytes_per_vector(head_dim)]``. Pages stay
    whole tensors indexed by page, so page copies, the host tier and byte counts need not know the format."""

    page_size: int
    key: list[torch.Tensor]
    value: list[torch.Tensor]
    codec: KVCodec | None = None

    @classmethod
    def allocate(
        cls,
        spec: RuntimeSpec,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype | None = None,
        codec: KVCodec | None = None,
    ) -> "KVCache":
        def planes(width: Callable[[int], int], plane_dtype: torch.dtype) -> list[torch.Tensor]:
            return [
                torch.zeros(
                    (num_pages, page_size, layer.num_kv_heads, width(layer.head_dim)),
                    dtype=plane_dtype,
                    device=spec.device,
                )
                for layer in spec.attention_layers
            ]

        if codec is None:
            dtype = dtype or spec.dtype
            return cls(page_size=page_size, key=planes(lambda dim: dim, dtype), value=planes(lambda dim: dim, dtype))
        for layer in spec.attention_layers:
            problem = codec.head_dim_problem(layer.head_dim)
            if problem is not None:
                raise ConfigError(
                    f"--kv-dtype {codec.name} is not available for this model: {problem}", param="kv_dtype"
                )
        key = planes(codec.key.bytes_per_vector, torch.uint8)
        return cls(page_size, key, planes(codec.value.bytes_per_vector, torch.uint8), codec)

    @property
    def num_pages(self) -> int:
        return self.key[0].shape[0] if self.key else 0


class PendingUpdates(Protocol):
    """State updates that a runtime's decode kernels leave pending instead of storing them into the SSM states."""

    def settle(self) -> None:
        """Apply every pending update to its state, so the stored states are whole."""
        ...


@attrs.define
class StateCache:
    """StateImage slots: ``conv[i]`` is ``[slots, conv_dim, conv_window]``, ``ssm[i]`` ``[slots, Hv, Dk, Dv]`` fp32.

    A runtime may attach ``pending``: its decode kernels then leave some state updates pending (recorded beside the
    states), and reading ``ssm`` settles them first, so every other reader and writer sees whole states.
    """

    conv: list[torch.Tensor]
    _ssm: list[torch.Tensor] = attrs.field(alias="ssm")
    pending: PendingUpdates | None = None

    @property
    def ssm(self) -> list[torch.Tensor]:
        """The SSM states, every pending update applied (``settle``)."""
        self.settle()
        return self._ssm

    def settle(self) -> None:
        """Apply the pending updates, if any, to the SSM states (for holders of the state tensors themselves)."""
        if self.pending is not None:
            self.pending.settle()

    def unsettled_ssm(self) -> list[torch.Tensor]:
        """The SSM states as stored, without settling ``pending``: for the kernels that read and leave its updates."""
        return self._ssm

    @classmethod
    def allocate(cls, spec: RuntimeSpec, num_slots: int) -> "StateCache":
        return cls(
            conv=[
                torch.zeros((num_slots, layer.conv_dim, layer.conv_window), dtype=spec.dtype, device=spec.device)
                for layer in spec.recurrent_layers
            ],
            ssm=[
                torch.zeros(
                    (num_slots, layer.num_value_heads, layer.key_head_dim, layer.value_head_dim),
                    dtype=torch.float32,
                    device=spec.device,
                )
                for layer in spec.recurrent_layers
            ],
        )

    @property
    def num_slots(self) -> int:
        return self._ssm[0].shape[0] if self._ssm else 0

    def reset(self, slot: int) -> None:
        for tensor in (*self.conv, *self.ssm):
            tensor[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        for tensor in (*self.conv, *self.ssm):
            tensor[dst].copy_(tensor[src])


@attrs.define
class ForwardBatch:
    """One model traversal over ``len(query_lens)`` rows whose new tokens are concatenated.

    The tensors may be host (CPU) tensors on a device runtime (the engine builds them so); the runtime moves them.
    """

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [3, T] int64 MRoPE (t, h, w) ids; equal rows for text
    query_lens: Sequence[int]  # new tokens per row; sum == T
    context_lens: Sequence[int]  # tokens already cached per row before this traversal
    page_tables: torch.Tensor  # [R, max_pages] int32
    state_slots: torch.Tensor  # [R] int64
    logits: Literal["last", "all", "none"] = "last"
    capture_states: bool = False  # also return the recurrent state after every new token (verify)
    return_hidden: bool = False  # also return final-normed hidden states (MTP drafting)
    capture_layers: tuple[int, ...] = ()  # also return these decoder layers' outputs per token (DFlash drafting)
    # [R, 1 + W] int64 on the token ids' device, for one-token-per-row batches: row r's recurrent state takes the
    # token it is fed only if column 0 is non-zero and ``token_ids[r]`` is none of its stop ids (columns 1.., padded
    # with -1; ``state_update_mask``); otherwise its outputs are computed and its KV written past its frontier, its
    # state slot is untouched (the engine's overlapped decode feeds a row the token it is about to commit before
    # the host knows whether the row ends there). None: every row's state takes its token. Only runtimes whose spec
    # says ``state_update_stops`` take it.
    state_update_stops: torch.Tensor | None = None
    # with logits "last": also the argmax of each row's logits below this many columns (ForwardOutput.greedy_ids)
    # where the runtime takes it with the logits; the caller takes it itself where the output has none
    greedy_below: int | None = None

    @property
    def num_rows(self) -> int:
        return len(self.query_lens)


def state_update_mask(token_ids: torch.Tensor, stops: torch.Tensor) -> torch.Tensor:
    """Bool ``[R]``: which rows' recurrent state takes its token ``token_ids [R]`` under ``stops [R, 1 + W]``
    (``ForwardBatch.state_update_stops``), on their device. The CUDA decode runner applies the same rule inside its
    staging launch (``ninfer.kernels.triton.staging.stage_inputs``)."""
    return stops[:, 0].bool() & ~(token_ids[:, None] == stops[:, 1:]).any(1)


@attrs.define
class CapturedStates:
    """Recurrent state after each new token: ``conv[i]`` ``[T, conv_dim, window]``, ``ssm[i]`` ``[T, Hv, Dk, Dv]``."""

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]


@attrs.define
class ForwardOutput:
    """``logits`` (fp32) and ``hidden`` are ``[R, ...]`` for ``"last"`` and ``[T, ...]`` for ``"all"``.

    ``layer_hidden`` is ``[T, K*H]`` whatever ``logits`` is: the outputs (residual stream, before any norm) of the
    ``capture_layers`` decoder layers for every new token, concatenated in ``capture_layers`` order.
    """

    logits: torch.Tensor | None
    hidden: torch.Tensor | None = None
    states: CapturedStates | None = None
    layer_hidden: torch.Tensor | None = None
    greedy_ids: torch.Tensor | None = None  # int64 [R] on the logits' device: ForwardBatch.greedy_below's argmax


@attrs.frozen
class LoadOptions:
    """How to load a runtime: ``dtype`` is auto|bfloat16|float16|float32 (auto: bf16 on CUDA, fp32 on CPU).

    ``cuda_graphs``: capture decode steps as CUDA graphs on CUDA devices (``--no-cuda-graph`` turns it off).
    """

    device: str = "cpu"
    dtype: str = "auto"
    cuda_graphs: bool = True

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.dtype]


class ModelRuntime(Protocol):
    """What a model family's ``load_runtime`` returns.

    A runtime that compiles, autotunes or captures anything on the first use of a shape may also offer
    ``warm_up(kv, state, shapes: WarmUpShapes) -> None``: it runs every shape ``shapes`` allows once, before any
    request, writing only scratch (any page, the first ``shapes.max_rows`` state slots), which the engine never
    reads before it has written or reset it.
    """

    spec: RuntimeSpec

    def forward(self, batch: ForwardBatch, kv: KVCache, state: StateCache) -> ForwardOutput: ...


@attrs.frozen
class WarmUpShapes:
    """The shapes an engine can ask a runtime for: up to ``max_rows`` rows per batch, ``max_pages`` pages per row's
    page table, prefill chunks of up to ``prefill_chunk`` tokens."""

    max_rows: int
    max_pages: int
    prefill_chunk: int


def page_table(rows: Sequence["DraftRow"], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[R, max_pages]`` int32 page ids of ``rows`` (zero-padded)."""
    width = max(len(seq.pages) for seq in rows)
    padded = [[*seq.pages, *([0] * (width - len(seq.pages)))] for seq in rows]
    return torch.tensor(padded, dtype=torch.int32, device=device)


def text_positions(positions: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """``[3, T]`` MRoPE ids of text tokens (three equal rows)."""
    return torch.tensor([positions] * 3, dtype=torch.int64, device=device)
