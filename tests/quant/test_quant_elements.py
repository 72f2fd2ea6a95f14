"""ninfer.quant.elements against the scalar oracles: E4M3FN (decode from the bit fields, RNE satfinite encode),
E2M1 (nearest magnitude, ties to even, sign bit), FP16 RNE against numpy, and the nibble packing order."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from quant_oracle import E2M1_TABLE, F32, e2m1_code, e2m1_value, e4m3_code, e4m3_value, pack_ref, sample

from ninfer.quant.elements import (
    e2m1_decode,
    e2m1_rne_satfinite,
    e4m3_rne_satfinite,
    fp16_rne,
    pack_nibbles,
    unpack_nibbles,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
BEYOND = [449.0, 463.9, 464.0, 465.0, 480.0, 1e6, 3e38, math.inf]


def _e4m3_inputs(rng: np.random.Generator) -> np.ndarray:
    finite = np.array([e4m3_value(b) for b in range(0x7F)])
    midpoints = (finite[:-1] + finite[1:]) / 2  # exact ties, all representable in fp32
    random = np.concatenate([sample(rng, (800,), kind) * scale for kind, scale in [("normal", 40), ("wide", 1)]])
    values = np.concatenate([finite, midpoints, random, BEYOND, [0.0]]).astype(F32)
    return np.concatenate([values, -values])


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_codes_decode_like_the_bit_fields(device: str) -> None:
    decoded = torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float().cpu().tolist()
    for byte, value in enumerate(decoded):
        want = e4m3_value(byte)
        same_zero_sign = math.copysign(1, value) == math.copysign(1, want)
        assert (math.isnan(value) and math.isnan(want)) or (value == want and same_zero_sign), byte


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_rne_satfinite_matches_the_nearest_even_oracle(device: str) -> None:
    x = _e4m3_inputs(np.random.default_rng(1))
    got = e4m3_rne_satfinite(torch.from_numpy(x).to(device)).view(torch.uint8).cpu().tolist()
    assert got == [e4m3_code(float(v)) for v in x]
    assert e4m3_rne_satfinite(torch.tensor([math.nan])).view(torch.uint8).item() in (0x7F, 0xFF)


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_encode_matches_the_nearest_even_oracle(device: str) -> None:
    rng = np.random.default_rng(2)
    midpoints = [(a + b) / 2 for a, b in zip(E2M1_TABLE, E2M1_TABLE[1:])]
    random = [sample(rng, (1500,), "normal") * 2.5, sample(rng, (500,), "wide")]
    values = np.concatenate([*random, E2M1_TABLE, midpoints, [7.0, 1e9, math.inf]]).astype(F32)
    x = np.concatenate([values, -values])
    got = e2m1_rne_satfinite(torch.from_numpy(x).to(device)).cpu().tolist()
    assert got == [e2m1_code(float(v)) for v in x]


def test_e2m1_ties_follow_the_compressed_tensors_thresholds() -> None:
    # compressed-tensors cast_to_fp4: <=0.25 -> 0, <0.75 -> 0.5, <=1.25 -> 1, <1.75 -> 1.5, <=2.5 -> 2, <3.5 -> 3,
    # <=5 -> 4, else 6: every midpoint goes to the magnitude with the even code.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert e2m1_decode(e2m1_rne_satfinite(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert e2m1_rne_satfinite(torch.tensor([-0.0, -0.1, 0.0])).tolist() == [8, 8, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_decodes_every_code(device: str) -> None:
    got = e2m1_decode(torch.arange(16, dtype=torch.uint8, device=device)).cpu().tolist()
    assert got == [e2m1_value(c) for c in range(16)]


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_rne_matches_numpy(device: str) -> None:
    rng = np.random.default_rng(3)
    halves = np.arange(0, 0x7BFF, 7, dtype=np.uint16).view(np.float16)
    ties = (halves.astype(F32) + np.nextafter(halves, np.float16(np.inf)).astype(F32)) / 2  # exact fp16 midpoints
    beyond = [65519.0, 65520.0, 1e6]
    x = np.concatenate([sample(rng, (1000,), "wide"), sample(rng, (500,), "normal") * 1e4, ties, beyond])
    x = np.concatenate([x, -x]).astype(F32)
    got = fp16_rne(torch.from_numpy(x).to(device)).cpu().numpy()
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("device", DEVICES)
def test_nibbles_pack_the_lower_index_low_and_unpack_back(device: str) -> None:
    assert pack_nibbles(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8, device=device)).tolist() == [[0x21, 0x43]]
    codes = torch.randint(0, 16, (6, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    packed = pack_nibbles(codes.to(device))
    assert packed.cpu().tolist() == [pack_ref(row) for row in codes.tolist()]
    assert torch.equal(unpack_nibbles(packed).cpu(), codes)
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(codes[:, :3])
