"""Hugging Face fine-grained (block-wise) FP8 weights: ``quantization_config = {quant_method: "fp8", fmt: "e4m3",
weight_block_size: [128, 128]}``. A Linear stores ``weight`` as float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` as
fp32 ``[ceil(N/128), ceil(K/128)]``; despite its name ``weight_scale_inv`` is the dequant multiplier:
``W[n, k] = e4m3(weight[n, k]) * weight_scale_inv[n // 128, k // 128]`` (transformers
``integrations/finegrained_fp8.py``: ``Fp8Quantize`` / ``Fp8Dequantize``). Edge blocks of N or K not a multiple of
128 are partial: they cover only the rows and columns that exist."""

from __future__ import annotations

import torch

from ninfer.quant.elements import E4M3_MAX, div_rn, e4m3_rne_satfinite

FP8_WEIGHT_BLOCK = (128, 128)


def fp8_scale_grid(shape: tuple[int, int], block: tuple[int, int] = FP8_WEIGHT_BLOCK) -> tuple[int, int]:
    """The scale tensor's shape for a weight of ``shape``: ``(ceil(N / block_n), ceil(K / block_k))``."""
    (n, k), (block_n, block_k) = shape, block
    return -(-n // block_n), -(-k // block_k)


def quantize_fp8_blockwise(
    w: torch.Tensor, block: tuple[int, int] = FP8_WEIGHT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes float8_e4m3fn [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)])`` of a finite 2-D ``w``.

    Per block (partial at the edges): ``scale_inv = fp32(amax|w| / 448)``; an all-zero block gets ``scale_inv = 1``
    (transformers ``Fp8Quantize``: "keep zeros stable"; its codes are +-0). ``codes = e4m3_rne_satfinite(fp32(w /
    scale_inv))`` -- a division by the stored multiplier, so the block maximum maps to +-448 up to one fp32 rounding.
    (transformers multiplies by ``448 / amax`` instead, which can pick the neighbouring code at a rounding tie.)"""
    if w.ndim != 2:
        raise ValueError(f"block-wise FP8 quantizes a 2-D weight, got shape {tuple(w.shape)}")
    x = w.float()
    grid = fp8_scale_grid(x.shape, block)
    padded = torch.nn.functional.pad(x, (0, grid[1] * block[1] - x.shape[1], 0, grid[0] * block[0] - x.shape[0]))
    amax = padded.abs().view(grid[0], block[0], grid[1], block[1]).amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, div_rn(amax, E4M3_MAX), 1.0)
    return e4m3_rne_satfinite(x / _per_element(scale_inv, block, x.shape)), scale_inv


def dequantize_fp8_blockwise(
    codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = FP8_WEIGHT_BLOCK
) -> torch.Tensor:
    """fp32 ``[N, K]``: ``fp32(e4m3(codes[n, k])) * scale_inv[n // bn, k // bk]`` (one fp32 rounding)."""
    if codes.dtype != torch.float8_e4m3fn or codes.ndim != 2:
        raise ValueError(f"expected 2-D float8_e4m3fn codes, got {codes.dtype} {tuple(codes.shape)}")
    grid = fp8_scale_grid(codes.shape, block)
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not match {grid} for {tuple(codes.shape)}")
    return codes.float() * _per_element(scale_inv.float(), block, codes.shape)


def _per_element(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    """Each block's scale repeated over its elements and cropped to ``shape`` (partial edge blocks)."""
    return scale.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[: shape[0], : shape[1]]
