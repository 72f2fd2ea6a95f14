"""Quantized projection weights at run time, and the one ``linear`` every Qwen3.5 projection goes through.

A projection weight is a plain tensor or a record of its stored tensors, as the source holds them (zero-copy views
on the CPU): :class:`Fp8BlockWeight` (``fp8_block``) or ``ninfer.quant.nvfp4.Nvfp4Weight`` (``nvfp4``); leading
dimensions stack matrices (MoE experts). The reference path dequantizes a record to the activation dtype on every
use and runs ``F.linear``: the weights stay at their stored size, the arithmetic is the reference's, weight-only
(A16). The CUDA path reads fused weights directly and has no kernels for codes yet, so ``load_runtime`` refuses
quantized weights on CUDA (:func:`refuse_on_cuda`).

What stays dense: whatever the source stores dense (norms, GDN a/b/conv/A_log/dt_bias, router, a checkpoint's
``modules_to_not_convert``), and every weight the model reads other than through ``linear``: the embedding (a
lookup) and lm_head (the logits, and the speculative drafters' vocabulary head) are dequantized once at load to the
compute dtype if a checkpoint stores them quantized.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from ninfer.core.artifact.container import ModelSource
from ninfer.core.artifact.quantized import GLOBAL_SCALE, SCALE, SCALE_INV, Fp8Block, QuantFormat
from ninfer.core.errors import ConfigError
from ninfer.quant.fp8 import dequantize_fp8_blockwise
from ninfer.quant.nvfp4 import Nvfp4Weight, dequantize_nvfp4


@attrs.frozen
class Fp8BlockWeight:
    """Block FP8: ``codes`` float8_e4m3fn ``[.., N, K]``, ``scale_inv`` fp32 ``[.., ceil(N/bn), ceil(K/bk)]``, the
    multiplier of each ``block = (bn, bk)`` tile."""

    codes: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]


QuantizedWeight = Fp8BlockWeight | Nvfp4Weight
Weight = torch.Tensor | QuantizedWeight


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """``x @ weight.T``; a quantized weight is dequantized to ``x.dtype`` first."""
    return F.linear(x, dense(weight, x.dtype))


def dense(weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A plain weight as it is; a quantized one dequantized (fp32 arithmetic, one rounding) and cast to ``dtype``."""
    if isinstance(weight, torch.Tensor):
        return weight
    return _dequantize(weight).to(dtype)


def _dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """fp32 values of a record, matrix by matrix over its leading dimensions."""
    if weight.codes.dim() > 2:
        return torch.stack([_dequantize(_matrix(weight, index)) for index in range(weight.codes.shape[0])])
    if isinstance(weight, Fp8BlockWeight):
        return dequantize_fp8_blockwise(weight.codes, weight.scale_inv, weight.block)
    return dequantize_nvfp4(weight)


def _matrix(weight: QuantizedWeight, index: int) -> QuantizedWeight:
    if isinstance(weight, Fp8BlockWeight):
        return attrs.evolve(weight, codes=weight.codes[index], scale_inv=weight.scale_inv[index])
    return Nvfp4Weight(weight.codes[index], weight.scales[index], weight.global_scale.reshape(-1)[index])


def load_quantized(source: ModelSource, name: str, fmt: QuantFormat, device: torch.device) -> QuantizedWeight:
    """The record of the quantized weight ``name`` from its codes and companions, moved to ``device`` unchanged."""
    take = lambda suffix: source.tensor(name + suffix).to(device)  # noqa: E731
    if isinstance(fmt, Fp8Block):
        return Fp8BlockWeight(take(""), take(SCALE_INV), fmt.block)
    return Nvfp4Weight(take(""), take(SCALE), take(GLOBAL_SCALE))


def refuse_on_cuda(source: ModelSource, device: torch.device) -> None:
    """A ConfigError for quantized weights on CUDA: its decode graphs and fused GEMVs read plain weights."""
    if source.manifest.quantized and device.type == "cuda":
        raise ConfigError(
            f"{source.path}: FP8/NVFP4 weights on CUDA need the fused kernels, not available yet; this artifact runs "
            "on the CPU reference path (or convert the unquantized checkpoint)"
        )
