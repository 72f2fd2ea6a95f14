"""The Qwen3.5 text model: weights loaded from a .ninfer artifact and the trunk traversal over a flat batch.

Weights are plain tensors, except projections a source stores quantized (``quantized``: records of their codes and
scales, applied through ``quantized.linear``). A tensor whose stored dtype already is the compute dtype on CPU is used
as a zero-copy view of the mapped artifact; anything else is converted once at load.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Sequence

import attrs
import torch
import torch.nn.functional as F

from ninfer.core.artifact.container import ModelSource
from ninfer.core.artifact.quantized import logical_shapes, quantized_formats
from ninfer.core.errors import NinferError, WeightMismatchError
from ninfer.core.runtime import CapturedStates, KVCache, StateCache
from ninfer.kernels.reference.norms import rms_norm
from ninfer.kernels.reference.rope import mrope_axis_of_frequency, rope_inverse_frequencies, rotary_cos_sin
from ninfer.plugins.qwen3_5.model.config import FULL_ATTENTION, Qwen35TextConfig
from ninfer.plugins.qwen3_5.model.layers import (
    BatchLayout,
    DecoderLayerWeights,
    DenseMLPWeights,
    FullAttentionWeights,
    GatedDeltaNetWeights,
    MoEWeights,
    RecurrentCapture,
    feed_forward,
    full_attention,
    full_attention_fused,
    gated_deltanet,
)
from ninfer.plugins.qwen3_5.model.quantized import Weight, dense, load_quantized
from ninfer.plugins.qwen3_5.model.weights import MTP_PREFIX, VISUAL_PREFIX, Shapes, text_model_weights

COMPANION_PREFIXES = (MTP_PREFIX, VISUAL_PREFIX, "dflash.", "dflash2.")


class ForwardBatchError(NinferError):
    """A forward batch (or MTP step) whose tensors do not fit together or do not fit the caches."""

    code = "invalid_forward_batch"


def check_rows(
    num_tokens: int,
    positions: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    page_tables: torch.Tensor,
    page_size: int,
) -> None:
    """The row description of a flat batch is coherent and every row fits its page table."""
    rows = len(query_lens)
    if rows == 0:
        raise ForwardBatchError("a forward batch needs at least one row")
    if len(context_lens) != rows:
        raise ForwardBatchError(f"{rows} query_lens but {len(context_lens)} context_lens")
    if any(n < 1 for n in query_lens) or any(n < 0 for n in context_lens):
        raise ForwardBatchError(
            f"query_lens must be >= 1 and context_lens >= 0; got {list(query_lens)}, {list(context_lens)}"
        )
    if sum(query_lens) != num_tokens:
        raise ForwardBatchError(f"query_lens sum to {sum(query_lens)} but the batch has {num_tokens} tokens")
    if positions.dim() != 2 or tuple(positions.shape) != (3, num_tokens):
        raise ForwardBatchError(f"positions must be [3, {num_tokens}]; got {tuple(positions.shape)}")
    if page_tables.dim() != 2 or page_tables.shape[0] != rows:
        raise ForwardBatchError(f"page_tables must be [{rows}, max_pages]; got {tuple(page_tables.shape)}")
    capacity = page_tables.shape[1] * page_size
    for row, (new, cached) in enumerate(zip(query_lens, context_lens)):
        if new + cached > capacity:
            raise ForwardBatchError(
                f"row {row} needs {new + cached} KV slots but its page table holds {capacity} ({page_size} per page)"
            )


class WeightLoader:
    """Checks an artifact's tensors against the expected shapes and hands them out in the compute dtype/device.

    A quantized weight (``Manifest.quantized``) counts with its dense shape, its scales as part of it: ``take_linear``
    hands it out as its record (``quantized``), ``take`` dequantized (for weights read other than through ``linear``).
    """

    def __init__(self, artifact: ModelSource, dtype: torch.dtype, device: torch.device) -> None:
        self.artifact = artifact
        self.dtype = dtype
        self.device = device
        self.formats = quantized_formats(artifact.manifest)
        self.shapes = logical_shapes({n: artifact.tensor_info(n) for n in artifact.tensor_names}, self.formats)
        self.present = set(self.shapes)

    def check(self, expected: Shapes) -> None:
        """Every expected tensor is present with its shape; names are reported with expected vs. found shape."""
        for name, shape in expected.items():
            if name not in self.present:
                raise WeightMismatchError(
                    f"{self.artifact.path}: tensor {name!r} is missing (expected shape {list(shape)})"
                )
            if self.shapes[name] != tuple(shape):
                raise WeightMismatchError(
                    f"{self.artifact.path}: tensor {name!r} has shape {list(self.shapes[name])}, expected {list(shape)}"
                )

    def check_no_extras(
        self, expected: Iterable[str], *, allowed_prefixes: tuple[str, ...] = (), within: str = ""
    ) -> None:
        """No tensor named ``within...`` is outside ``expected`` unless it starts with an allowed prefix."""
        known = set(expected)
        for name, shape in self.shapes.items():
            if name.startswith(within) and name not in known and not name.startswith(allowed_prefixes):
                raise WeightMismatchError(
                    f"{self.artifact.path}: unexpected tensor {name!r} (shape {list(shape)}) is not part of this model"
                )

    def take(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        fmt = self.formats.get(name)
        if fmt is not None:
            return dense(load_quantized(self.artifact, name, fmt, self.device), dtype)
        tensor = self.artifact.tensor(name)
        if tensor.dtype == dtype and self.device.type == "cpu":
            return tensor
        return tensor.to(device=self.device, dtype=dtype)

    def take_linear(self, name: str) -> Weight:
        """A weight applied through ``linear``: its quantized record as stored, else ``take(name)``."""
        fmt = self.formats.get(name)
        return self.take(name) if fmt is None else load_quantized(self.artifact, name, fmt, self.device)


def load_decoder_layer(loader: WeightLoader, prefix: str, kind: str, config: Qwen35TextConfig) -> DecoderLayerWeights:
    """One decoder layer's weights from the tensors named ``prefix + <relative name>``; the projections applied
    through ``linear`` as stored (quantized records where the source quantizes them)."""
    take = lambda name: loader.take(prefix + name)  # noqa: E731
    projection = lambda name: loader.take_linear(prefix + name)  # noqa: E731
    if kind == FULL_ATTENTION:
        mixer: GatedDeltaNetWeights | FullAttentionWeights = FullAttentionWeights(
            q_proj=projection("self_attn.q_proj.weight"),
            k_proj=projection("self_attn.k_proj.weight"),
            v_proj=projection("self_attn.v_proj.weight"),
            o_proj=projection("self_attn.o_proj.weight"),
            q_norm=take("self_attn.q_norm.weight"),
            k_norm=take("self_attn.k_norm.weight"),
        )
    else:
        a_log = loader.take(prefix + "linear_attn.A_log", torch.float32)
        mixer = GatedDeltaNetWeights(
            in_proj_qkv=projection("linear_attn.in_proj_qkv.weight"),
            in_proj_z=projection("linear_attn.in_proj_z.weight"),
            in_proj_b=projection("linear_attn.in_proj_b.weight"),
            in_proj_a=projection("linear_attn.in_proj_a.weight"),
            conv_weight=take("linear_attn.conv1d.weight").squeeze(1),
            dt_bias=loader.take(prefix + "linear_attn.dt_bias", torch.float32),
            decay_rate=-a_log.exp(),
            norm=take("linear_attn.norm.weight"),
            out_proj=projection("linear_attn.out_proj.weight"),
        )
    if config.is_moe:
        mlp: DenseMLPWeights | MoEWeights = MoEWeights(
            router=take("mlp.gate.weight"),
            gate_up=projection("mlp.experts.gate_up_proj"),
            down=projection("mlp.experts.down_proj"),
            shared_gate=projection("mlp.shared_expert.gate_proj.weight"),
            shared_up=projection("mlp.shared_expert.up_proj.weight"),
            shared_down=projection("mlp.shared_expert.down_proj.weight"),
            shared_expert_gate=take("mlp.shared_expert_gate.weight"),
        )
    else:
        mlp = DenseMLPWeights(
            gate_proj=projection("mlp.gate_proj.weight"),
            up_proj=projection("mlp.up_proj.weight"),
            down_proj=projection("mlp.down_proj.weight"),
        )
    return DecoderLayerWeights(
        input_layernorm=take("input_layernorm.weight"),
        post_attention_layernorm=take("post_attention_layernorm.weight"),
        mixer=mixer,
        mlp=mlp,
    )


@attrs.frozen
class Qwen35Model:
    """The trunk's weights and its traversal."""

    config: Qwen35TextConfig
    dtype: torch.dtype
    device: torch.device
    embed_tokens: torch.Tensor
    layers: tuple[DecoderLayerWeights, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor
    inverse_frequencies: torch.Tensor  # [rotary_dim // 2] fp32
    axis_of_frequency: torch.Tensor  # [rotary_dim // 2]: MRoPE position row of each frequency

    @classmethod
    def load(cls, loader: WeightLoader, config: Qwen35TextConfig) -> "Qwen35Model":
        """Check the text-model tensors (missing / mis-shaped / unexpected) and load them."""
        expected = text_model_weights(config)
        loader.check(expected)
        loader.check_no_extras(expected, allowed_prefixes=COMPANION_PREFIXES)
        prefix = config.text_prefix
        embed = loader.take(f"{prefix}embed_tokens.weight")
        layers = tuple(
            load_decoder_layer(loader, f"{prefix}layers.{index}.", kind, config)
            for index, kind in enumerate(config.layer_types)
        )
        return cls(
            config=config,
            dtype=loader.dtype,
            device=loader.device,
            embed_tokens=embed,
            layers=layers,
            norm=loader.take(f"{prefix}norm.weight"),
            lm_head=embed if config.tie_word_embeddings else loader.take("lm_head.weight"),
            inverse_frequencies=rope_inverse_frequencies(config.rotary_dim, config.rope_theta, loader.device),
            axis_of_frequency=mrope_axis_of_frequency(
                config.rotary_dim // 2, config.mrope_section, interleaved=config.mrope_interleaved, device=loader.device
            ),
        )

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids.to(self.device), self.embed_tokens)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MRoPE ``cos, sin [T, rotary_dim]`` (fp32) shared by every attention layer of one traversal."""
        return rotary_cos_sin(positions.to(self.device), self.inverse_frequencies, self.axis_of_frequency)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final-normed hidden states."""
        return self.activation_logits(hidden).float()

    def activation_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits in the activation dtype (what ``logits`` casts to fp32)."""
        return F.linear(hidden, self.lm_head)

    def run(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        layout: BatchLayout,
        kv: KVCache,
        state: StateCache,
        capture_states: bool,
        layer_outputs: dict[int, torch.Tensor] | None = None,
        *,
        fused: bool = False,
    ) -> tuple[torch.Tensor, CapturedStates | None]:
        """All decoder layers over the flat batch; returns final-normed hidden ``[T, H]`` and captured states.

        Each block's output stays pending and is added to the residual stream by the next norm. ``layer_outputs``:
        for each layer index already a key, the layer's output ``[T, H]`` is stored under it. ``fused`` selects the
        Triton ops (``TRITON_OPS``: CUDA prefill, needs Triton on the model's device) over the reference torch ops.
        """
        ops = TRITON_OPS if fused else REFERENCE_OPS
        config, eps = self.config, self.config.rms_norm_eps
        hidden = self.embed(token_ids)
        rope = ops.rope(self, positions)
        captured = CapturedStates(conv=[], ssm=[]) if capture_states else None
        pending: torch.Tensor | None = None  # the last block's output, not yet added to ``hidden``
        attention_index = recurrent_index = 0
        for layer_index, (weights, kind) in enumerate(zip(self.layers, config.layer_types)):
            hidden, normed = ops.add_norm(pending, hidden, weights.input_layernorm, eps)
            if kind == FULL_ATTENTION:
                pending = ops.full_attention(
                    weights.mixer,  # type: ignore[arg-type]
                    config,
                    normed,
                    rope,
                    layout,
                    kv.key[attention_index],
                    kv.value[attention_index],
                    kv.codec,
                )
                attention_index += 1
            else:
                conv_cache, ssm_cache = state.conv[recurrent_index], state.ssm[recurrent_index]
                capture = _recurrent_capture(captured, conv_cache, ssm_cache, hidden.shape[0])
                pending = ops.gated_deltanet(
                    weights.mixer, config, normed, layout, conv_cache, ssm_cache, capture  # type: ignore[arg-type]
                )
                recurrent_index += 1
            hidden, normed = ops.add_norm(pending, hidden, weights.post_attention_layernorm, eps)
            pending = ops.feed_forward(weights.mlp, config, normed)
            if layer_outputs is not None and layer_index in layer_outputs:
                layer_outputs[layer_index] = hidden + pending
        _, final = ops.add_norm(pending, hidden, self.norm, eps)
        return final, captured


@attrs.frozen
class TraversalOps:
    """The operations one form of the trunk traversal is made of; ``Qwen35Model.run`` is the one layer loop.

    ``add_norm(pending, hidden, weight, eps)`` -> ``(hidden + pending, (1+w) RMSNorm of it)`` (just the norm while
    nothing is pending); ``rope(model, positions)`` -> what ``full_attention`` reads for the positions; the mixers and
    the FFN take the arguments of ``layers.full_attention`` / ``gated_deltanet`` / ``feed_forward``.
    """

    add_norm: Callable[[torch.Tensor | None, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
    rope: Callable[["Qwen35Model", torch.Tensor], Any]
    full_attention: Callable[..., torch.Tensor]
    gated_deltanet: Callable[..., torch.Tensor]
    feed_forward: Callable[..., torch.Tensor]


def _add_norm_torch(
    pending: torch.Tensor | None, hidden: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, then the norm, as torch ops."""
    if pending is not None:
        hidden = hidden + pending
    return hidden, rms_norm(hidden, weight, eps, zero_centered=True)


def _add_norm_triton(
    pending: torch.Tensor | None, hidden: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm in one Triton pass."""
    from ninfer.kernels.triton.norms import add_rms_norm  # imported on use: CPU installs lack triton

    if pending is None:
        return add_rms_norm(hidden, None, weight, eps)
    return add_rms_norm(pending, hidden, weight, eps)


def _rope_inputs(model: "Qwen35Model", positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(positions [3, T] contiguous, inverse_frequencies, axis_of_frequency)``: the fused kernel makes cos/sin."""
    return positions.to(model.device).contiguous(), model.inverse_frequencies, model.axis_of_frequency


# the pure-torch reference (the CPU path and the oracle)
REFERENCE_OPS = TraversalOps(
    add_norm=_add_norm_torch,
    rope=Qwen35Model.rotary,
    full_attention=full_attention,
    gated_deltanet=gated_deltanet,
    feed_forward=feed_forward,
)
# the CUDA prefill: Triton row kernels and one GEMM per layer input where the weights are fused
TRITON_OPS = TraversalOps(
    add_norm=_add_norm_triton,
    rope=_rope_inputs,
    full_attention=full_attention_fused,
    gated_deltanet=functools.partial(gated_deltanet, fused=True),
    feed_forward=functools.partial(feed_forward, fused=True),
)


def _recurrent_capture(
    captured: CapturedStates | None, conv_cache: torch.Tensor, ssm_cache: torch.Tensor, tokens: int
) -> RecurrentCapture | None:
    """Fresh per-token state buffers of one recurrent layer, appended to ``captured`` (None when not capturing)."""
    if captured is None:
        return None
    capture = RecurrentCapture(
        conv=conv_cache.new_empty((tokens, *conv_cache.shape[1:])),
        ssm=ssm_cache.new_empty((tokens, *ssm_cache.shape[1:])),
    )
    captured.conv.append(capture.conv)
    captured.ssm.append(capture.ssm)
    return capture
