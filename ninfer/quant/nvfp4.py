"""NVFP4 weights in the compressed-tensors ``nvfp4-pack-quantized`` layout (the layout ModelOpt exports too):
``weight_packed`` uint8 ``[N, K/2]`` (two E2M1 codes per byte, the lower k in the low nibble), ``weight_scale``
float8_e4m3fn ``[N, K/16]`` (one non-negative scale per 16 consecutive k), and one fp32 per-tensor
``weight_global_scale``, a DIVISOR: ``W[n, k] = e2m1(code[n, k]) * (e4m3(scale[n, k // 16]) / global_scale)``
(compressed-tensors ``quantization/lifecycle/forward_helpers.py``: ``scale = scale / global_scale``; upstream
NInfer's ``d_w``). ModelOpt checkpoints store the reciprocal as a multiplier, ``weight_scale_2 = amax / (6 * 448)``
(``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``); importing one takes ``global_scale = 1 /
weight_scale_2``, which is what compressed-tensors' own ``ModelOptNvfp4Converter`` does."""

from __future__ import annotations

import attrs
import torch

from ninfer.quant.elements import (
    E2M1_MAX,
    E4M3_MAX,
    div_rn,
    e2m1_decode,
    e2m1_rne_satfinite,
    e4m3_rne_satfinite,
    pack_nibbles,
    unpack_nibbles,
)

NVFP4_GROUP = 16
_ZERO_SCALE_EPS = 0.125  # compressed-tensors ``calculate_qparams``: a zero E4M3 scale is replaced by 0.125


@attrs.frozen
class Nvfp4Weight:
    """An NVFP4 matrix: ``codes`` uint8 ``[N, K/2]`` (low nibble = even k), ``scales`` float8_e4m3fn ``[N, K/16]``,
    ``global_scale`` fp32 0-d, the per-tensor divisor (compressed-tensors ``weight_global_scale``)."""

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor


def quantize_nvfp4(w: torch.Tensor) -> Nvfp4Weight:
    """The compressed-tensors NVFP4 weight quantizer (``generate_gparam``, ``calculate_qparams``, ``_quantize``)
    for a finite 2-D ``w`` with K % 16 == 0, all in fp32:

    - ``global_scale = 2688 / amax|w|`` (448 * 6; 1 for an all-zero tensor, where compressed-tensors divides by 0);
    - per 16-group ``scale = e4m3_rne_satfinite((amax_g / 6) * global_scale)``, a zero scale replaced by 0.125;
    - ``code = e2m1_rne_satfinite(w / (scale / global_scale))``, sign from ``signbit(w)``.

    Every division is one IEEE rounding (``div_rn``). compressed-tensors' own arithmetic can differ by an ulp or a
    code at a tie: torch evaluates its ``448 * 6 / amax`` as ``reciprocal(amax) * 2688``, and it rounds
    ``w / (scale / global_scale)`` to bf16 before the E2M1 rounding."""
    if w.ndim != 2 or w.shape[1] % NVFP4_GROUP:
        raise ValueError(f"NVFP4 quantizes a 2-D weight with K a multiple of {NVFP4_GROUP}, got {tuple(w.shape)}")
    x = w.float()
    amax = x.abs().amax()
    global_scale = torch.where(amax > 0, div_rn(torch.full_like(amax, E4M3_MAX * E2M1_MAX), amax), 1.0)
    groups = x.view(x.shape[0], -1, NVFP4_GROUP)
    scale = e4m3_rne_satfinite(div_rn(groups.abs().amax(dim=-1), E2M1_MAX) * global_scale).float()
    scale = torch.where(scale == 0, _ZERO_SCALE_EPS, scale)
    codes = e2m1_rne_satfinite(groups / div_rn(scale, global_scale).unsqueeze(-1))
    return Nvfp4Weight(
        codes=pack_nibbles(codes.flatten(-2)), scales=scale.to(torch.float8_e4m3fn), global_scale=global_scale
    )


def dequantize_nvfp4(weight: Nvfp4Weight) -> torch.Tensor:
    """fp32 ``[N, K]``: ``e2m1(code) * fp32(fp32(e4m3(scale)) / global_scale)`` (compressed-tensors
    ``_dequantize`` order: the effective group scale first, then one multiply)."""
    codes, scales = weight.codes, weight.scales
    if codes.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn:
        raise ValueError(f"expected uint8 codes and float8_e4m3fn scales, got {codes.dtype} and {scales.dtype}")
    n, k = codes.shape[0], codes.shape[1] * 2
    if tuple(scales.shape) != (n, k // NVFP4_GROUP) or weight.global_scale.numel() != 1:
        raise ValueError(
            f"scales {tuple(scales.shape)} / global_scale {tuple(weight.global_scale.shape)} do not fit codes"
            f" {tuple(codes.shape)}: want ({n}, {k // NVFP4_GROUP}) and one element"
        )
    values = e2m1_decode(unpack_nibbles(codes)).view(n, -1, NVFP4_GROUP)
    group_scale = div_rn(scales.float(), weight.global_scale.reshape(()))
    return (values * group_scale.unsqueeze(-1)).view(n, k)
