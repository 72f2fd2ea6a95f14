"""Plain reference definitions the ``ninfer.quant`` tests hold the library to, written from the format definitions
and independent of it: scalar encoders as Python loops over element tables (nearest value, ties to the even
code), an E4M3FN decoder from the bit fields, FP16 RNE through numpy, and whole-format encoders that do their fp32
arithmetic in numpy (IEEE single-precision, one rounding per operation) and their element rounding in these loops.
Run them on a few thousand scalars, not on model-sized tensors."""

from __future__ import annotations

import bisect
import math

import numpy as np

F32 = np.float32
E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
KINDS = ("normal", "heavy", "zeros", "wide")


def signbit(v: float) -> bool:
    return math.copysign(1.0, v) < 0


def e2m1_code(v: float) -> int:
    """Nearest E2M1 magnitude to min(|v|, 6) (ties: the even index), sign bit 3 = signbit(v)."""
    a, best = min(abs(v), 6.0), 0
    for i, m in enumerate(E2M1_TABLE):
        d, d_best = abs(a - m), abs(a - E2M1_TABLE[best])
        if d < d_best or (d == d_best and i % 2 == 0):
            best = i
    return best | (8 if signbit(v) else 0)


def e2m1_value(code: int) -> float:
    return (-1.0 if code & 8 else 1.0) * E2M1_TABLE[code & 7]


def e4m3_value(byte: int) -> float:
    """E4M3FN from its fields: sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0; exponent 0 is
    subnormal (man/8 * 2^-6); S.1111.111 (0x7F, 0xFF) is NaN; no infinities."""
    byte = int(byte)
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


_E4M3_MAGNITUDES = [e4m3_value(b) for b in range(0x7F)]  # byte b (0..126) -> its magnitude, increasing


def e4m3_code(v: float) -> int:
    """E4M3FN byte of v: nearest finite value to min(|v|, 448) (saturating), ties to the even byte; NaN -> 0x7F."""
    if math.isnan(v):
        return 0x7F
    a = min(abs(v), 448.0)
    i = bisect.bisect_left(_E4M3_MAGNITUDES, a)
    if _E4M3_MAGNITUDES[i] != a:
        d_low, d_high = a - _E4M3_MAGNITUDES[i - 1], _E4M3_MAGNITUDES[i] - a
        i = i - 1 if d_low < d_high or (d_low == d_high and (i - 1) % 2 == 0) else i
    return i | (0x80 if signbit(v) else 0)


def e4m3_round(v: float) -> float:
    return e4m3_value(e4m3_code(v))


def fp16_round(v: float) -> float:
    return float(np.float16(F32(v)))


def e4m3_half_ulp(magnitude: np.ndarray) -> np.ndarray:
    """Half the E4M3 spacing at each |v| <= 448: 2^(max(floor(log2 |v|), -6) - 4) (subnormal step 2^-9)."""
    exponent = np.floor(np.log2(np.maximum(magnitude, 2.0**-20)))
    return 2.0 ** (np.maximum(exponent, -6) - 4)


def e2m1_half_gap(magnitude: np.ndarray) -> np.ndarray:
    """Half the E2M1 spacing at each |v| <= 6: 0.25 below 2, 0.5 in [2, 4), 1 in [4, 6]."""
    return np.where(magnitude < 2, 0.25, np.where(magnitude < 4, 0.5, 1.0))


def sample(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """fp32 test inputs: ``normal``; ``heavy`` (Student t, 1.5 degrees of freedom); ``zeros`` (normal, a third of
    the elements and the first row zeroed); ``wide`` (log-uniform magnitudes 2^-24..2^12, random signs)."""
    if kind == "normal":
        x = rng.standard_normal(shape)
    elif kind == "heavy":
        x = rng.standard_t(1.5, shape)
    elif kind == "zeros":
        x = rng.standard_normal(shape) * (rng.random(shape) > 1 / 3)
        x[0] = 0
    else:
        x = 2.0 ** rng.uniform(-24, 12, shape) * rng.choice([-1.0, 1.0], shape)
    return x.astype(F32)


def pack_ref(codes: list[int]) -> list[int]:
    """Bytes of 4-bit codes, code 2i in the low nibble and 2i+1 in the high one."""
    return [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]


def fp8_block_ref(w: np.ndarray, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """HF block FP8: per (partial) block scale_inv = amax / 448 (1 for an all-zero block), byte =
    e4m3_code(w / scale_inv)."""
    n, k = w.shape
    scale = np.ones(((n + block - 1) // block, (k + block - 1) // block), F32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            amax = F32(np.abs(w[i * block : (i + 1) * block, j * block : (j + 1) * block]).max())
            if amax > 0:
                scale[i, j] = amax / F32(448)
    quotient = w / np.repeat(np.repeat(scale, block, 0), block, 1)[:n, :k]
    return np.array([e4m3_code(float(v)) for v in quotient.flat], np.uint8).reshape(n, k), scale


def nvfp4_weight_ref(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, F32]:
    """compressed-tensors NVFP4: g = 2688 / amax (1 if zero); per 16: s = e4m3((amax_g / 6) * g), 0 -> 0.125;
    code = e2m1_code(w / (s / g)); returns (packed bytes [N, K/2], scale bytes [N, K/16], g)."""
    amax = F32(np.abs(w).max())
    g = F32(2688) / amax if amax > 0 else F32(1)
    n, k = w.shape
    scale_bytes = np.zeros((n, k // 16), np.uint8)
    packed = np.zeros((n, k // 2), np.uint8)
    for r in range(n):
        codes = []
        for c in range(k // 16):
            group = w[r, c * 16 : (c + 1) * 16]
            byte = e4m3_code(float(F32(np.abs(group).max()) / F32(6) * g))
            byte = byte if e4m3_value(byte) != 0 else e4m3_code(0.125)
            scale_bytes[r, c] = byte
            effective = F32(e4m3_value(byte)) / g
            codes += [e2m1_code(float(v / effective)) for v in group]
        packed[r] = pack_ref(codes)
    return packed, scale_bytes, g


def int8_g64_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """INT8 G64 of a [rows, D] array: scale = fp16(amax / 127), code = clamp(round_half_even(x * fp32(1 / scale)),
    +-127), codes 0 where the scale is 0."""
    rows, dim = x.shape
    codes = np.zeros((rows, dim), np.int8)
    scales = np.zeros((rows, dim // 64), np.float16)
    for r in range(rows):
        for g in range(dim // 64):
            group = x[r, g * 64 : (g + 1) * 64]
            scale = fp16_round(F32(np.abs(group).max()) / F32(127))
            scales[r, g] = scale
            if scale != 0:
                inverse = F32(1) / F32(scale)
                codes[r, g * 64 : (g + 1) * 64] = [max(-127, min(127, round(float(v * inverse)))) for v in group]
    return codes, scales


def fp8_row_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """FP8 row of a [rows, D] array: scale = fp16(clamp(amax / 448, 2^-24, 65504)), byte = e4m3_code(x / scale);
    an all-zero row has scale 0 and bytes 0."""
    rows, dim = x.shape
    codes = np.zeros((rows, dim), np.uint8)
    scales = np.zeros((rows, 1), np.float16)
    for r in range(rows):
        amax = F32(np.abs(x[r]).max())
        if amax == 0:
            continue
        scale = fp16_round(min(max(float(amax / F32(448)), 2.0**-24), 65504.0))
        scales[r, 0] = scale
        codes[r] = [e4m3_code(float(v / F32(scale))) for v in x[r]]
    return codes, scales


def nvfp4_g16_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NVFP4 G16 of a [rows, D] array: scale = e4m3(clamp(amax / 6, 2^-9, 448)), code = e2m1_code(x / scale);
    returns (packed bytes [rows, D/2], scale bytes [rows, D/16])."""
    rows, dim = x.shape
    packed = np.zeros((rows, dim // 2), np.uint8)
    scale_bytes = np.zeros((rows, dim // 16), np.uint8)
    for r in range(rows):
        codes = []
        for g in range(dim // 16):
            group = x[r, g * 16 : (g + 1) * 16]
            byte = e4m3_code(min(max(float(F32(np.abs(group).max()) / F32(6)), 2.0**-9), 448.0))
            scale_bytes[r, g] = byte
            codes += [e2m1_code(float(v / F32(e4m3_value(byte)))) for v in group]
        packed[r] = pack_ref(codes)
    return packed, scale_bytes


def sylvester_entry(i: int, j: int) -> int:
    """H[i, j] of the unnormalised Sylvester Hadamard matrix: (-1)^popcount(i & j)."""
    return -1 if bin(i & j).count("1") % 2 else 1
