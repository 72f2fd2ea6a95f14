"""The element conversions every format shares, each defined once: FP8 E4M3FN and FP16 with round-to-nearest-even
(RNE), and the 4-bit E2M1 code (OCP MX spec: 1 sign, 2 exponent, 1 mantissa bit; magnitudes 0, 0.5, 1, 1.5, 2, 3,
4, 6; no Inf or NaN) with its two-codes-per-byte packing. Inputs are converted to fp32 first (exact from bf16/fp16),
so every rounding below is a single rounding of an fp32 value."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0  # largest finite float8_e4m3fn magnitude (S.1111.110); S.1111.111 is NaN
E2M1_MAX = 6.0  # largest E2M1 magnitude

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # code & 0x7 -> magnitude; bit 3 (0x8) is the sign
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive magnitudes
_E2M1_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose even-code neighbour is the upper magnitude


def div_rn(x: torch.Tensor, divisor: float | torch.Tensor) -> torch.Tensor:
    """``x / divisor`` with one IEEE rounding on every device. A Python-scalar divisor becomes a tensor on x's device
    first: CUDA computes ``tensor / python_scalar`` as a multiply by the scalar's reciprocal, and torch evaluates
    ``python_scalar / tensor`` as ``reciprocal(tensor) * python_scalar`` -- both round twice."""
    return torch.div(x, torch.as_tensor(divisor, dtype=x.dtype, device=x.device))


def e4m3_rne_satfinite(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of ``x``: fp32 value clamped to [-448, 448], then RNE (subnormals included, step 2^-9).
    Clamping first makes the conversion saturating on every torch build and device (a bare cast may give NaN for
    |x| > 448); NaN stays NaN (0x7F/0xFF); the sign of zero is kept."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp16_rne(x: torch.Tensor) -> torch.Tensor:
    """float16 of the fp32 value of ``x``, RNE (subnormals down to 2^-24); no clamping: beyond 65504 rounds to
    +-inf as IEEE does, so callers clamp where their format says so."""
    return x.float().to(torch.float16)


def e2m1_rne_satfinite(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 in [0, 15], one per element) of the fp32 value of ``x``: the nearest magnitude of
    |x| clamped to 6, ties to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
    5 -> 4); bit 3 is ``signbit(x)``, so -0 and negatives that round to zero give code 8 (-0), as compressed-tensors'
    ``pack_fp4_to_uint8`` does. ``x`` must not be NaN (E2M1 has none); +-inf saturates to +-6."""
    x = x.float()
    magnitude = x.abs()
    midpoints = torch.tensor(_E2M1_MIDPOINTS, device=x.device)
    index = torch.bucketize(magnitude, midpoints, out_int32=True)  # midpoints strictly below |x|; >= 7 -> 7 (6.0)
    index = index + torch.isin(magnitude, torch.tensor(_E2M1_TIES_UP, device=x.device)).int()
    return (index | (torch.signbit(x).int() << 3)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (uint8, low 4 bits used): ``(-1)^bit3 * E2M1_MAGNITUDES[code & 7]``."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=codes.device)
    values = torch.cat((magnitudes, -magnitudes))
    return values[(codes & 0xF).long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last axis (even length), ``[..., L] -> [..., L/2]``: element 2i in the
    low nibble, 2i+1 in the high one (as compressed-tensors ``pack_fp4_to_uint8`` and ModelOpt pack them)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing two codes per byte needs an even last axis, got {tuple(codes.shape)}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``pack_nibbles``: ``[..., L/2] uint8 -> [..., L]`` codes, low nibble first."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
