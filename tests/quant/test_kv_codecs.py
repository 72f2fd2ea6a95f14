"""ninfer.quant.kv_codecs against the oracles: each plane codec's codes and scales exactly (ties, zeros, values
past the saturation bounds), round-trip error bounds, layouts and bytes per token-head, the Hadamard rotation and
which KV dtypes rotate which planes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from quant_oracle import (
    F32,
    KINDS,
    e2m1_half_gap,
    e4m3_half_ulp,
    e4m3_value,
    fp8_row_ref,
    int8_g64_ref,
    nvfp4_g16_ref,
    sample,
    sylvester_entry,
)

from ninfer.quant.kv_codecs import FP8_ROW, INT8_G64, KV_CODECS, NVFP4_G16, hadamard, hadamard_rotate

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
E4M3_VALUES = np.array([e4m3_value(b) for b in range(0x7F)])
E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _extremes(rng: np.random.Generator, dim: int) -> np.ndarray:
    """Rows past each codec's scale clamps: huge (fp8 scale > 65504, nvfp4 scale > 448), tiny (fp8 scale < 2^-24,
    nvfp4 scale < 2^-9, int8 scale subnormal in fp16 so codes clamp at 127), and all-zero."""
    rows = [rng.standard_normal(dim) * s for s in (1e8, 1e4, 1e-6, 1e-9, 3e-5, 1e-3)]
    return np.stack(rows + [np.zeros(dim)]).astype(F32)


def _inputs(kind: str, seed: int, dim: int = 128) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([sample(rng, (16, dim), kind), _extremes(rng, dim)])


def _encode(codec, x: np.ndarray, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return codec.encode(torch.from_numpy(x).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_int8_g64_matches_the_oracle(kind: str, device: str) -> None:
    x = _inputs(kind, 30 + KINDS.index(kind))
    x = x[np.abs(x).max(axis=1) < 65504 * 127]  # inside the fp16 scale's range
    codes, scales = _encode(INT8_G64, x, device)
    want_codes, want_scales = int8_g64_ref(x)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    assert np.array_equal(scales.cpu().numpy().view(np.uint16), want_scales.view(np.uint16))
    assert np.array_equal(codes.cpu().numpy(), want_codes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_fp8_row_matches_the_oracle(kind: str, device: str) -> None:
    x = _inputs(kind, 40 + KINDS.index(kind))
    codes, scales = _encode(FP8_ROW, x, device)
    want_codes, want_scales = fp8_row_ref(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float16
    assert np.array_equal(scales.cpu().numpy().view(np.uint16), want_scales.view(np.uint16))
    assert np.array_equal(codes.view(torch.uint8).cpu().numpy(), want_codes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_g16_matches_the_oracle(kind: str, device: str) -> None:
    x = _inputs(kind, 50 + KINDS.index(kind))
    codes, scales = _encode(NVFP4_G16, x, device)
    want_codes, want_scales = nvfp4_g16_ref(x)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
    assert np.array_equal(scales.view(torch.uint8).cpu().numpy(), want_scales)
    assert np.array_equal(codes.cpu().numpy(), want_codes)


@pytest.mark.parametrize("device", DEVICES)
def test_exact_ties_round_to_even_in_every_codec(device: str) -> None:
    rng = np.random.default_rng(60)
    half_integers = rng.integers(-127, 127, (8, 128)) + 0.5
    x = half_integers * 2.0**-4
    x[:, ::64] = 127 * 2.0**-4  # each group's amax: scale 2^-4 exactly, inverse 2^4 exactly
    x = x.astype(F32)
    codes, _ = _encode(INT8_G64, x, device)
    assert np.array_equal(codes.cpu().numpy(), int8_g64_ref(x)[0])
    assert (codes.cpu().numpy()[:, 1:64] % 2 == 0).all()

    midpoints = (E4M3_VALUES[:-1] + E4M3_VALUES[1:]) / 2
    x = (rng.choice(np.concatenate([midpoints, -midpoints]), (8, 128)) * 2.0**-2).astype(F32)
    x[:, 0] = 448 * 2.0**-2  # row amax: fp8 scale 2^-2 exactly
    codes, _ = _encode(FP8_ROW, x, device)
    assert np.array_equal(codes.view(torch.uint8).cpu().numpy(), fp8_row_ref(x)[0])
    assert (codes.view(torch.uint8).cpu().numpy()[:, 1:] % 2 == 0).all()

    x = (rng.choice(np.concatenate([E2M1_MIDPOINTS, -E2M1_MIDPOINTS]), (8, 128)) * 2.0**-3).astype(F32)
    x[:, ::16] = 6 * 2.0**-3  # group amax: nvfp4 scale 2^-3 exactly
    codes, _ = _encode(NVFP4_G16, x, device)
    assert np.array_equal(codes.cpu().numpy(), nvfp4_g16_ref(x)[0])
    nibbles = np.stack([codes.cpu().numpy() & 0xF, codes.cpu().numpy() >> 4], -1).reshape(8, 128)
    assert (nibbles[:, np.arange(128) % 16 != 0] % 2 == 0).all()


def test_int8_multiplies_by_the_fp32_reciprocal_rather_than_dividing() -> None:
    # (scale, x, code): x * fp32(1 / scale) and x / scale round to different integers, the reference note's
    # reason for calling the reciprocal-multiply order normative.
    cases = [
        (0.0133056640625, -1.64324951171875, -123),
        (0.09808349609375, -2.991546630859375, -31),
        (0.014373779296875, -0.3952789008617401, -28),
        (0.059844970703125, 0.0897674486041069, 2),
    ]
    x = np.zeros((len(cases), 64), F32)
    for row, (scale, value, _) in enumerate(cases):
        x[row, :2] = F32(127) * F32(scale), value  # the first element sets the group's scale to `scale`
    codes, scales = INT8_G64.encode(torch.from_numpy(x))
    assert scales[:, 0].tolist() == [scale for scale, _, _ in cases]
    assert codes[:, 1].tolist() == [code for _, _, code in cases]


def test_zero_vectors() -> None:
    zero = torch.zeros(2, 256)
    codes, scales = INT8_G64.encode(zero)
    assert (codes == 0).all() and (scales == 0).all()
    codes, scales = FP8_ROW.encode(zero)
    assert (codes.view(torch.uint8) == 0).all() and (scales == 0).all()
    codes, scales = NVFP4_G16.encode(zero)
    assert (codes == 0).all() and (scales.float() == 2.0**-9).all()  # the scale clamp's floor, never zero
    for codec in (INT8_G64, FP8_ROW, NVFP4_G16):
        assert (codec.decode(*codec.encode(zero)) == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_error_bounds(kind: str, device: str) -> None:
    x = sample(np.random.default_rng(70 + KINDS.index(kind)), (32, 256), kind)
    x64, slack = x.astype(np.float64), np.abs(x) * 2.0**-22

    codes, scales = _encode(INT8_G64, x, device)
    scale = np.repeat(scales.cpu().numpy().astype(np.float64), 64, axis=1)
    error = np.abs(x64 - INT8_G64.decode(codes, scales).cpu().numpy())
    assert (error <= scale / 2 * (1 + 2.0**-20) + slack).all()
    assert (np.abs(codes.cpu().numpy()) <= 127).all()

    codes, scales = _encode(FP8_ROW, x, device)
    scale = scales.cpu().numpy().astype(np.float64)
    error = np.abs(x64 - FP8_ROW.decode(codes, scales).cpu().numpy())
    divisor = np.where(scale > 0, scale, 1)  # a zero row has scale 0 and decodes exactly
    assert (error <= scale * e4m3_half_ulp(np.abs(x) / divisor) + slack).all()

    codes, scales = _encode(NVFP4_G16, x, device)
    scale = np.repeat(scales.float().cpu().numpy().astype(np.float64), 16, axis=1)
    ratio = np.abs(x) / scale
    error = np.abs(x64 - NVFP4_G16.decode(codes, scales).cpu().numpy())
    saturated = np.maximum(np.abs(x64) - 6 * scale, 0)
    assert (error <= scale * e2m1_half_gap(np.minimum(ratio, 6)) + saturated + slack).all()


def test_layouts_and_bytes_per_token_head() -> None:
    table = {"bf16": 1024, "int8": 528, "fp8": 516, "nvfp4": 288, "k8v4": 402}
    assert {name: codec.bytes_per_token_head(256) for name, codec in KV_CODECS.items()} == table
    x = torch.randn(3, 4, 256, generator=torch.Generator().manual_seed(80))
    shapes = {
        "bf16": ((256, torch.bfloat16, 0, torch.float16), (256, torch.float16, 0, torch.float16)),
        "int8": ((256, torch.int8, 4, torch.float16),) * 2,
        "fp8": ((256, torch.float8_e4m3fn, 1, torch.float16),) * 2,
        "nvfp4": ((128, torch.uint8, 16, torch.float8_e4m3fn),) * 2,
        "k8v4": ((256, torch.float8_e4m3fn, 1, torch.float16), (128, torch.uint8, 16, torch.float8_e4m3fn)),
    }
    for name, codec in KV_CODECS.items():
        planes = (codec.encode_keys(x), codec.encode_values(x))
        stored = 0
        for (codes, scales), (n_codes, code_dtype, n_scales, scale_dtype) in zip(planes, shapes[name]):
            assert codes.shape == (3, 4, n_codes) and codes.dtype == code_dtype, name
            assert scales.shape == (3, 4, n_scales) and scales.dtype == scale_dtype, name
            stored += (codes.numel() * codes.element_size() + scales.numel() * scales.element_size()) // 12
        assert stored == table[name], name


def test_nvfp4_kv_codes_put_the_lower_index_in_the_low_nibble() -> None:
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, -3.0  # scale e4m3(6 / 6) = 1: codes 7 (+6) and 13 (-3)
    codes, scales = NVFP4_G16.encode(x)
    assert codes[0, 0].item() == 0xD7 and scales.float().item() == 1.0


def test_bf16_codec_keeps_bf16_keys_and_rounds_values_to_fp16() -> None:
    x = sample(np.random.default_rng(81), (4, 256), "wide")
    codec = KV_CODECS["bf16"]
    keys, key_scales = codec.encode_keys(torch.from_numpy(x))
    values, value_scales = codec.encode_values(torch.from_numpy(x))
    assert torch.equal(keys, torch.from_numpy(x).bfloat16())
    with np.errstate(over="ignore"):
        assert np.array_equal(values.numpy().view(np.uint16), x.astype(np.float16).view(np.uint16))
    assert torch.equal(codec.key.decode(keys, key_scales), keys.float())
    assert torch.equal(codec.value.decode(values, value_scales), values.float())


def test_group_size_must_divide_the_head_dim() -> None:
    for codec in (INT8_G64, NVFP4_G16):
        with pytest.raises(ValueError, match="multiple"):
            codec.encode(torch.ones(2, 40))


@pytest.mark.parametrize("dim", [1, 2, 16, 256])
def test_hadamard_is_the_normalised_sylvester_matrix(dim: int) -> None:
    h = hadamard(dim)
    want = torch.tensor([[sylvester_entry(i, j) for j in range(dim)] for i in range(dim)], dtype=torch.float64)
    assert h.dtype == torch.float32
    assert torch.allclose(h.double(), want / math.sqrt(dim), rtol=2.0**-23, atol=0)
    assert torch.allclose(h.double() @ h.double().T, torch.eye(dim, dtype=torch.float64), atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(dim * 3)


def test_hadamard_256_entries_are_exactly_plus_minus_one_sixteenth() -> None:
    assert set(hadamard(256).unique().tolist()) == {-1 / 16, 1 / 16}


def test_rotation_round_trips_and_keeps_attention_scores() -> None:
    gen = torch.Generator().manual_seed(82)
    q, k = torch.randn(5, 256, generator=gen).bfloat16(), torch.randn(7, 256, generator=gen).bfloat16()
    assert torch.allclose(hadamard_rotate(hadamard_rotate(k)), k.float(), atol=1e-5)
    assert torch.allclose(hadamard_rotate(q) @ hadamard_rotate(k).T, q.float() @ k.float().T, atol=1e-4)


def test_which_kv_dtypes_rotate_which_planes() -> None:
    rules = {name: (codec.rotate_keys, codec.rotate_values) for name, codec in KV_CODECS.items()}
    assert rules == {
        "bf16": (False, False),
        "int8": (True, False),
        "fp8": (True, False),
        "nvfp4": (True, True),
        "k8v4": (True, True),
    }
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(83))
    h = torch.tensor([[sylvester_entry(i, j) / 16 for j in range(256)] for i in range(256)])
    for codec in KV_CODECS.values():
        keys = codec.encode_keys, codec.key, codec.rotate_keys
        for encode, plane, rotated in (keys, (codec.encode_values, codec.value, codec.rotate_values)):
            for got, want in zip(encode(x), plane.encode(x @ h if rotated else x)):
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), codec.name
