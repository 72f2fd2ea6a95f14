"""ninfer.quant.fp8 (Hugging Face block-wise FP8 weights) against the block oracle: bytes and scales exactly, ties,
zero blocks, partial edge blocks, the dequant formula and its error bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_oracle import F32, KINDS, e4m3_half_ulp, e4m3_value, fp8_block_ref, sample

from ninfer.quant.fp8 import dequantize_fp8_blockwise, fp8_scale_grid, quantize_fp8_blockwise

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
E4M3_VALUES = np.array([e4m3_value(b) for b in range(0x7F)])


def _quantize(w: np.ndarray, device: str) -> tuple[np.ndarray, np.ndarray]:
    codes, scale_inv = quantize_fp8_blockwise(torch.from_numpy(w).to(device))
    assert codes.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
    return codes.view(torch.uint8).cpu().numpy(), scale_inv.cpu().numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_blockwise_fp8_matches_the_oracle(kind: str, device: str) -> None:
    w = sample(np.random.default_rng(10 + KINDS.index(kind)), (130, 260), kind)
    codes, scale_inv = _quantize(w, device)
    want_codes, want_scale = fp8_block_ref(w)
    assert np.array_equal(scale_inv, want_scale)
    assert np.array_equal(codes, want_codes)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_round_to_the_even_code(device: str) -> None:
    rng = np.random.default_rng(11)
    midpoints = (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2
    w = rng.choice(np.concatenate([midpoints, -midpoints]), (128, 128)) * 2.0**-3
    w[5, 7] = 448 * 2.0**-3  # the block amax: scale_inv = 2^-3 exactly, so w / scale_inv is an exact midpoint
    w = w.astype(F32)
    codes, scale_inv = _quantize(w, device)
    assert scale_inv.tolist() == [[2.0**-3]]
    assert np.array_equal(codes, fp8_block_ref(w)[0])
    assert (codes[w != w[5, 7]] % 2 == 0).all()  # every tie landed on an even byte


@pytest.mark.parametrize("device", DEVICES)
def test_zero_blocks_get_scale_one_and_zero_codes(device: str) -> None:
    w = sample(np.random.default_rng(12), (256, 256), "normal")
    w[:128, 128:] = 0
    codes, scale_inv = _quantize(w, device)
    assert scale_inv[0, 1] == 1.0 and (codes[:128, 128:] & 0x7F == 0).all()
    assert (dequantize_fp8_blockwise(*quantize_fp8_blockwise(torch.from_numpy(w)))[:128, 128:] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_partial_edge_blocks_cover_only_their_own_rows_and_columns(device: str) -> None:
    w = sample(np.random.default_rng(13), (130, 260), "normal")
    w[129, 259] = 1000.0  # in the corner block rows 128..129 x columns 256..259
    codes, scale_inv = _quantize(w, device)
    assert scale_inv.shape == fp8_scale_grid(w.shape) == (2, 3)
    assert scale_inv[1, 2] == F32(1000.0) / F32(448)
    assert scale_inv[1, 1] == F32(np.abs(w[128:, 128:256]).max()) / F32(448)
    assert scale_inv[0, 2] == F32(np.abs(w[:128, 256:]).max()) / F32(448)
    assert codes[129, 259] == 0x7E  # the block maximum encodes as 448
    assert fp8_scale_grid((1, 1)) == (1, 1) and fp8_scale_grid((128, 129)) == (1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_is_code_times_block_scale_within_half_an_e4m3_ulp(kind: str, device: str) -> None:
    w = sample(np.random.default_rng(14 + KINDS.index(kind)), (200, 300), kind)
    codes, scale_inv = quantize_fp8_blockwise(torch.from_numpy(w).to(device))
    out = dequantize_fp8_blockwise(codes, scale_inv).cpu().numpy()
    per_element = np.repeat(np.repeat(scale_inv.cpu().numpy(), 128, 0), 128, 1)[:200, :300]
    byte = codes.view(torch.uint8).cpu().numpy()
    values = np.where(byte & 0x80, -1.0, 1.0) * E4M3_VALUES[byte & 0x7F]
    assert np.array_equal(out, (values.astype(F32) * per_element).astype(F32))
    bound = per_element * e4m3_half_ulp(np.abs(w) / per_element) * (1 + 2.0**-20) + np.abs(w) * 2.0**-23
    assert (np.abs(w.astype(np.float64) - out) <= bound).all()


def test_inputs_are_checked() -> None:
    codes, scale_inv = quantize_fp8_blockwise(torch.ones(130, 260))
    with pytest.raises(ValueError, match="does not match"):
        dequantize_fp8_blockwise(codes, scale_inv[:, :2])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_fp8_blockwise(codes.float(), scale_inv)
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_blockwise(torch.ones(128))


def test_bf16_weights_quantize_from_their_exact_fp32_values() -> None:
    w = torch.randn(130, 260, generator=torch.Generator().manual_seed(15)).bfloat16()
    (codes, scale_inv), (want_codes, want_scale) = quantize_fp8_blockwise(w), quantize_fp8_blockwise(w.float())
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scale_inv, want_scale)
