"""``checkpoint_layout``: read MoE checkpoints that store experts one by one as the fused expert layout.

ninfer's MoE weights are ``<block>.gate_up_proj [E, 2I, H]`` (expert ``e``'s gate rows, then its up rows) and
``<block>.down_proj [E, H, I]``, where ``<block>`` is ``...mlp.experts``. transformers' ``save_pretrained`` writes
``<block>.{e}.gate_proj.weight [I, H]``, ``.up_proj.weight [I, H]`` and ``.down_proj.weight [H, I]`` instead.
Every block stored that way (decoder layers and the MTP layer alike) maps to the two fused tensors. Quantized
per-expert tensors are refused for now: stacking their codes and scales into the fused layout is not implemented.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import torch

from ninfer.core.artifact.container import TensorInfo
from ninfer.core.artifact.hf_directory import FusedTensor
from ninfer.core.errors import ArtifactError, NotYetAvailableError, WeightMismatchError
from ninfer.plugins.qwen3_5.model.config import Qwen35TextConfig

_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_PER_EXPERT = re.compile(r"^(?P<block>.+\.mlp\.experts)\.\d+\.(?:gate|up|down)_proj\.weight$")


def checkpoint_layout(config: Mapping[str, Any], stored: Mapping[str, TensorInfo]) -> dict[str, FusedTensor]:
    """The fused expert tensors of every per-expert MoE block in ``stored``; ``{}`` for fused or dense checkpoints."""
    blocks: dict[str, str] = {}  # block -> one of its stored per-expert names
    for name in stored:
        if match := _PER_EXPERT.match(name):
            blocks.setdefault(match["block"], name)
    if not blocks:
        return {}
    text = Qwen35TextConfig.from_hf(config)
    if not text.is_moe:
        raise ArtifactError(f"architecture {text.architecture!r} is not a MoE model; it has no expert layout")
    layout: dict[str, FusedTensor] = {}
    for block, example in blocks.items():
        layout.update(_fused_block(block, text, stored, stored[example].dtype))
    return layout


def _fused_block(
    block: str, config: Qwen35TextConfig, stored: Mapping[str, TensorInfo], fallback: torch.dtype
) -> dict[str, FusedTensor]:
    """The block's two fused tensors; ``fallback`` is their dtype when none of their sources is stored."""
    experts, inner, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
    assert experts is not None and inner is not None  # from_hf always sets them for MoE configs
    gate_up = tuple(f"{block}.{e}.{proj}_proj.weight" for e in range(experts) for proj in ("gate", "up"))
    down = tuple(f"{block}.{e}.down_proj.weight" for e in range(experts))
    shapes = {name: (inner, hidden) for name in gate_up} | {name: (hidden, inner) for name in down}
    dtype = _common_dtype(block, shapes, stored) or fallback
    if dtype in _QUANTIZED_DTYPES:
        raise NotYetAvailableError(
            f"the routed experts of {block} are stored quantized one by one ({str(dtype).removeprefix('torch.')}); "
            "stacking their codes and scales is not available yet: use the unquantized checkpoint "
            "(ninfer convert --quantize quantizes the stacked experts)"
        )
    return {
        f"{block}.gate_up_proj": FusedTensor(gate_up, _stack_gate_up, dtype, (experts, 2 * inner, hidden)),
        f"{block}.down_proj": FusedTensor(down, _stack, dtype, (experts, hidden, inner)),
    }


def _common_dtype(
    block: str, shapes: Mapping[str, tuple[int, ...]], stored: Mapping[str, TensorInfo]
) -> torch.dtype | None:
    """The one dtype of the block's stored expert tensors (None if none is stored), checking each one's shape."""
    dtypes: dict[torch.dtype, str] = {}
    for name, shape in shapes.items():
        info = stored.get(name)
        if info is None:
            continue  # the checkpoint view names every missing source
        if tuple(info.shape) != shape:
            raise WeightMismatchError(
                f"mis-shaped tensor: {name} has shape {list(info.shape)}, expected {list(shape)}", param=name
            )
        dtypes.setdefault(info.dtype, name)
    if len(dtypes) > 1:
        found = ", ".join(f"{name} is {str(dtype).removeprefix('torch.')}" for dtype, name in dtypes.items())
        raise WeightMismatchError(f"the experts of {block} do not share one dtype: {found}", param=block)
    return next(iter(dtypes), None)


def _stack_gate_up(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[gate_0, up_0, gate_1, up_1, ...]`` -> ``[E, 2I, H]``: stacked pairs are exactly per-expert row concats."""
    stacked = torch.stack(list(parts))  # [2E, I, H]
    return stacked.view(stacked.shape[0] // 2, 2 * stacked.shape[1], stacked.shape[2])


def _stack(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(parts))
