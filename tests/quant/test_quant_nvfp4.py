"""ninfer.quant.nvfp4 (compressed-tensors / ModelOpt NVFP4 weights) against the oracle: packed codes, E4M3 group
scales and the global divisor exactly; ties, zero and tiny groups, nibble order, shapes, dequant formula and its
error bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_oracle import F32, KINDS, e2m1_half_gap, e2m1_value, e4m3_code, e4m3_value, nvfp4_weight_ref, sample

from ninfer.quant.nvfp4 import Nvfp4Weight, dequantize_nvfp4, quantize_nvfp4

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _quantize(w: np.ndarray, device: str) -> tuple[np.ndarray, np.ndarray, float]:
    q = quantize_nvfp4(torch.from_numpy(w).to(device))
    assert q.codes.dtype == torch.uint8 and q.scales.dtype == torch.float8_e4m3fn
    assert q.global_scale.dtype == torch.float32 and q.global_scale.ndim == 0
    return q.codes.cpu().numpy(), q.scales.view(torch.uint8).cpu().numpy(), q.global_scale.item()


def _unpacked(packed: np.ndarray) -> np.ndarray:
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_matches_the_compressed_tensors_oracle(kind: str, device: str) -> None:
    w = sample(np.random.default_rng(20 + KINDS.index(kind)), (24, 96), kind)
    codes, scales, global_scale = _quantize(w, device)
    want_codes, want_scales, want_global = nvfp4_weight_ref(w)
    assert global_scale == want_global
    assert np.array_equal(scales, want_scales)
    assert np.array_equal(codes, want_codes)


@pytest.mark.parametrize("device", DEVICES)
def test_ties_round_to_the_even_code(device: str) -> None:
    rng = np.random.default_rng(21)
    scale = 2.0 ** rng.integers(-6, 6, (16, 4, 1))
    w = scale * rng.choice(np.concatenate([MIDPOINTS, np.negative(MIDPOINTS)]), (16, 4, 16))
    w[..., 0] = 6 * scale[..., 0]  # each group's amax: its E4M3 scale is exactly `scale`
    w[0, 0, 0] = 2688.0  # the tensor amax: global scale 2688 / 2688 = 1, so w / scale is an exact midpoint
    w = w.reshape(16, 64).astype(F32)
    codes, scales, global_scale = _quantize(w, device)
    assert global_scale == 1.0
    assert np.array_equal(codes, nvfp4_weight_ref(w)[0])
    ties = _unpacked(codes).reshape(16, 4, 16)[..., 1:]
    assert (ties & 1 == 0).all()  # every midpoint went to the even code


@pytest.mark.parametrize("device", DEVICES)
def test_zero_and_underflowing_groups_take_the_compressed_tensors_eps_scale(device: str) -> None:
    w = sample(np.random.default_rng(22), (4, 64), "normal")
    w[1, 16:32] = 0  # an all-zero group
    w[2] = 1e-7  # scale = e4m3(1e-7 / 6 * g) underflows to 0
    codes, scales, _ = _quantize(w, device)
    eps = e4m3_code(0.125)
    assert scales[1, 1] == eps and (scales[2] == eps).all()
    assert (_unpacked(codes)[1, 16:32] == 0).all() and (_unpacked(codes)[2] == 0).all()
    assert (dequantize_nvfp4(quantize_nvfp4(torch.from_numpy(w)))[1:3, 16:32] == 0).all()


def test_an_all_zero_tensor_gets_global_scale_one() -> None:
    q = quantize_nvfp4(torch.zeros(2, 32))
    assert q.global_scale.item() == 1.0 and (q.codes == 0).all()
    assert (q.scales.float() == 0.125).all() and (dequantize_nvfp4(q) == 0).all()


def test_layout_lower_k_in_the_low_nibble_and_scale_shapes() -> None:
    w = torch.zeros(3, 48)
    w[0, 0], w[0, 1], w[0, 3], w[1, 17] = 6.0, -6.0, 3.0, -1.5
    q = quantize_nvfp4(w)
    assert q.codes.shape == (3, 24) and q.scales.shape == (3, 3)
    assert q.codes[0, 0].item() == 0xF7  # k=0: +6 (code 7) low, k=1: -6 (code 15) high
    assert q.codes[0, 1].item() == 0x50  # k=2: 0 low, k=3: +3 (code 5) high
    assert q.codes[1, 8].item() == 0xF0  # k=17: -1.5 relative to its group amax 1.5 -> -6 (code 15), high nibble
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.ones(4, 40))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_formula_and_error_bound(kind: str, device: str) -> None:
    w = sample(np.random.default_rng(23 + KINDS.index(kind)), (32, 128), kind)
    q = quantize_nvfp4(torch.from_numpy(w).to(device))
    out = dequantize_nvfp4(q).cpu().numpy()
    codes, scales, global_scale = q.codes.cpu().numpy(), q.scales.view(torch.uint8).cpu().numpy(), q.global_scale
    effective = np.array([[F32(e4m3_value(b)) / F32(global_scale.item()) for b in row] for row in scales], F32)
    effective = np.repeat(effective, 16, axis=1)
    values = np.vectorize(e2m1_value)(_unpacked(codes)).astype(F32)
    assert np.array_equal(out, (values * effective).astype(F32))
    ratio = np.abs(w) / effective
    saturated = np.maximum(np.abs(w) - 6 * effective, 0)
    bound = effective * e2m1_half_gap(np.minimum(ratio, 6)) + saturated + np.abs(w) * 2.0**-22
    assert (np.abs(w.astype(np.float64) - out) <= bound).all()
    normal = np.repeat(q.scales.float().cpu().numpy() >= 2.0**-6, 16, axis=1)
    assert (ratio[normal] <= 6 * (1 + 2.0**-4) * (1 + 2.0**-20)).all()  # saturation only by the scale's rounding


def test_dequantize_checks_its_planes() -> None:
    q = quantize_nvfp4(torch.ones(4, 32))
    with pytest.raises(ValueError, match="do not fit"):
        dequantize_nvfp4(Nvfp4Weight(q.codes, q.scales[:, :1], q.global_scale))
    with pytest.raises(ValueError, match="uint8"):
        dequantize_nvfp4(Nvfp4Weight(q.codes.int(), q.scales, q.global_scale))
