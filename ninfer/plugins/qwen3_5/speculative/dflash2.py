"""The DFlash2 drafter (``dflash2.*``): DFlash plus grouped dynamic convolutions and a candidate-selector walk.

Everything DFlash does carries over (context KV injection from the fused target features, the non-causal block
forward with sliding windows); the context K/V never pass through a convolution. Each sublayer of a draft layer is
wrapped in a two-tap grouped dynamic causal convolution over the row's block, whose taps are zero across the block
start::

    n = norm(h);  d = kernel_projection(n).view(L, 2, taps, groups)
    h = h + conv(sublayer(conv(n, base[0], d[:, 0])), base[1], d[:, 1])
    conv(x, base, dyn)[i, c] = sum_t (base[t, c] + dyn[i, t, c // group_size]) * x[i - t, c]

The drafts are then chosen by the candidate selector: per mask slot the top-K tokens of the (scaled, soft-capped)
target logits, walked left to right from the anchor with the pairwise score
``unary[j, k] + <predecessor[prev] * hidden_projection(h_j), successor[cand[j, k]]>``: the argmax at T=0, a sample
from ``softmax(score / T)`` (by Gumbel-max) at T>0, whose probabilities are returned as the proposal.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch
import torch.nn.functional as F

from ninfer.core.runtime import KVCache
from ninfer.kernels.reference.moe import swiglu
from ninfer.plugins.qwen3_5.model.model import Qwen35Model
from ninfer.plugins.qwen3_5.speculative.companion import DFlash2Config
from ninfer.plugins.qwen3_5.speculative.dflash import DFlashLayer, DFlashModel, DraftBlock, TakeTensor, load_layers


@attrs.frozen
class GroupedDynamicConv:
    """One sublayer's pair of causal convolutions: ``base_kernel [2, taps, H]`` (fp32; side 0 before the sublayer,
    side 1 after it) plus per-token, per-group tap deltas from ``kernel_projection [2*taps*groups, H]``."""

    base_kernel: torch.Tensor
    kernel_projection: torch.Tensor
    group_size: int

    @property
    def taps(self) -> int:
        return self.base_kernel.shape[1]

    def prepare(self, normed: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input (side 0 convolved) and the deltas ``[T, taps, groups]`` kept for side 1."""
        dynamic = F.linear(normed, self.kernel_projection).float().view(normed.shape[0], 2, self.taps, -1)
        return self.convolve(normed, 0, dynamic[:, 0], offsets), dynamic[:, 1]

    def convolve(self, x: torch.Tensor, side: int, dynamic: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Causal conv of ``x [T, H]`` within each row's block; ``offsets [T]`` are the tokens' block indices."""
        length, hidden = x.shape
        groups = hidden // self.group_size
        source = x.float().view(length, groups, self.group_size)
        out = torch.zeros_like(source)
        for tap in range(self.taps):
            shifted = source
            if tap:  # x[i - tap], zero where that falls before the row's block start
                shifted = torch.roll(source, tap, dims=0).masked_fill((offsets < tap)[:, None, None], 0.0)
            weight = self.base_kernel[side, tap].view(groups, self.group_size) + dynamic[:, tap, :, None]
            out += weight * shifted
        return out.view(length, hidden).to(x.dtype)


@attrs.frozen
class LayerConvs:
    """A draft layer's convolutions around its attention and its MLP."""

    attention: GroupedDynamicConv
    mlp: GroupedDynamicConv


@attrs.frozen
class Selection:
    """The walk's result for every mask slot (row order): chosen ``tokens [S]``, ``candidates [S, K]`` and, for
    sampled slots, their probabilities ``[S, K]`` (float64; greedy slots' rows are one-hot)."""

    tokens: torch.Tensor
    candidates: torch.Tensor
    probabilities: torch.Tensor


@attrs.frozen
class CandidateSelector:
    """The pairwise path selector over the top-``top_k`` candidates of every mask slot."""

    predecessor_codebook: torch.Tensor  # [V, r]
    successor_codebook: torch.Tensor  # [V, r]
    hidden_projection: torch.Tensor  # [r, H]
    top_k: int
    output_multiplier: float
    softcap: float | None

    def width(self, head: torch.Tensor) -> int:
        """How many candidates each slot has under proposal head ``head``."""
        return min(self.top_k, head.shape[0])

    def unary_logits(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """fp32 ``head`` logits of final-normed ``hidden``, scaled by the output multiplier and soft-capped."""
        logits = F.linear(hidden, head).float().mul_(self.output_multiplier)  # [S, V]: in place, it is large
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits

    def walk(
        self,
        hidden: torch.Tensor,
        head: torch.Tensor,
        anchors: Sequence[int],
        counts: Sequence[int],
        temperatures: Sequence[float],
        noise: torch.Tensor,
    ) -> Selection:
        """Choose ``counts[r]`` tokens after ``anchors[r]`` for each row from the mask slots' final-normed
        ``hidden [S, H]`` (row order). Rows with temperature 0 take the argmax score (ties: the earlier candidate);
        the others take ``argmax(score / T + noise)``, ``noise [S, K]`` being standard Gumbel draws."""
        device = hidden.device
        unary, candidates = self.unary_logits(hidden, head).topk(self.width(head), dim=-1)
        projected = F.linear(hidden, self.hidden_projection).float()
        # <predecessor[prev] * proj_j, successor[c]> = <predecessor[prev], proj_j * successor[c]>
        edges = projected[:, None, :] * self.successor_codebook[candidates].float()  # [S, K, r]
        lengths = torch.tensor(list(counts), device=device)
        steps = torch.arange(max(counts), device=device)
        valid = steps[None, :] < lengths[:, None]  # [R, W]: row r's step j is its slot j
        slots = torch.where(valid, (lengths.cumsum(0) - lengths)[:, None] + steps[None, :], 0)
        sampled = torch.tensor([t > 0 for t in temperatures], device=device)
        scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], dtype=torch.float64, device=device)
        previous = torch.tensor(list(anchors), dtype=torch.int64, device=device)
        step_scores, step_choices = [], []
        for step in range(steps.shape[0]):
            slot = slots[:, step]
            context = self.predecessor_codebook[previous].float()  # [R, r]
            score = unary[slot] + torch.einsum("rd,rkd->rk", context, edges[slot])
            choice = (score.double() / scale[:, None] + noise[slot]).argmax(dim=-1)  # greedy rows: noise 0
            previous = torch.where(valid[:, step], candidates[slot, choice], previous)
            step_scores.append(score)
            step_choices.append(choice)
        scores = torch.stack(step_scores, dim=1)[valid]  # [S, K] in slot order
        choices = torch.stack(step_choices, dim=1)[valid]
        rows = valid.nonzero()[:, 0]
        probabilities = torch.softmax(scores.double() / scale[rows, None], dim=-1)
        one_hot = F.one_hot(choices, candidates.shape[1]).double()
        probabilities = torch.where(sampled[rows, None], probabilities, one_hot)
        tokens = candidates.gather(1, choices[:, None])[:, 0]
        return Selection(tokens, candidates, probabilities)


class DFlash2Model(DFlashModel):
    """DFlash's context KV and block attention, with convolution-wrapped sublayers and the candidate selector."""

    companion = "dflash2"
    label = "DFlash2"

    def __init__(
        self,
        target: Qwen35Model,
        config: DFlash2Config,
        fc: torch.Tensor,
        hidden_norm: torch.Tensor,
        norm: torch.Tensor,
        layers: tuple[DFlashLayer, ...],
        convs: tuple[LayerConvs, ...],
        selector: CandidateSelector,
    ) -> None:
        super().__init__(target, config.dflash, fc, hidden_norm, norm, layers)
        self.dflash2_config = config
        self.convs = convs
        self.selector = selector

    @classmethod
    def _from_weights(cls, target: Qwen35Model, config: DFlash2Config, take: TakeTensor) -> "DFlash2Model":
        def conv(prefix: str) -> GroupedDynamicConv:
            return GroupedDynamicConv(
                take(prefix + "base_kernel", torch.float32), take(prefix + "kernel_projection.weight"),
                config.conv_group_size,
            )

        convs = tuple(
            LayerConvs(conv(f"layers.{index}.attention_conv."), conv(f"layers.{index}.mlp_conv."))
            for index in range(config.dflash.num_hidden_layers)
        )
        selector = CandidateSelector(
            predecessor_codebook=take("candidate_selector.predecessor_codebook"),
            successor_codebook=take("candidate_selector.successor_codebook"),
            hidden_projection=take("candidate_selector.hidden_projection.weight"),
            top_k=config.selector_top_k,
            output_multiplier=config.output_multiplier,
            softcap=config.final_logit_softcapping,
        )
        return cls(
            target, config, take("fc.weight"), take("hidden_norm.weight"), take("norm.weight"),
            load_layers(config.dflash, take), convs, selector,
        )

    def _layer_forward(
        self, index: int, layer: DFlashLayer, x: torch.Tensor, block: DraftBlock, kv: KVCache
    ) -> torch.Tensor:
        convs, offsets = self.convs[index], block.offsets
        attention_in, after = convs.attention.prepare(self._norm(x, layer.input_layernorm), offsets)
        attended = self._attention(index, layer, attention_in, block, kv)
        x = x + convs.attention.convolve(attended, 1, after, offsets)
        mlp_in, after = convs.mlp.prepare(self._norm(x, layer.post_attention_layernorm), offsets)
        fed_forward = swiglu(mlp_in, layer.gate_proj, layer.up_proj, layer.down_proj)
        return x + convs.mlp.convolve(fed_forward, 1, after, offsets)
