"""The KV-cache codecs of upstream NInfer (``kv_cache_append`` op contract; reference note section 2), per
token-head vector of head dim D (256 in the real models; any multiple of the group in tests), and the fixed
normalised Hadamard rotation applied before some of them.

Quantization happens on write from the BF16 K/V; every step below is in fp32. Bytes per token per head (K + V, at
D = 256): bf16 1024, int8 528, fp8 516, nvfp4 288, k8v4 402."""

from __future__ import annotations

from typing import Callable

import attrs
import torch

from ninfer.quant.elements import (
    E2M1_MAX,
    E4M3_MAX,
    div_rn,
    e2m1_decode,
    e2m1_rne_satfinite,
    e4m3_rne_satfinite,
    fp16_rne,
    pack_nibbles,
    unpack_nibbles,
)

Encoded = tuple[torch.Tensor, torch.Tensor]

INT8_GROUP = 64
NVFP4_KV_GROUP = 16
_FP16_MIN_SUBNORMAL = 2.0**-24
_FP16_MAX = 65504.0
_E4M3_MIN_SUBNORMAL = 2.0**-9


@attrs.frozen
class VectorCodec:
    """How one plane (K or V) stores a ``[..., D]`` vector: ``encode(x) -> (codes, scales)`` and
    ``decode(codes, scales) -> fp32 [..., D]``; ``code_bits`` per element plus one ``scale_bytes`` scale per
    ``group`` elements (``None``: one per vector; ``scale_bytes == 0``: no scale plane). ``code_dtype`` /
    ``scale_dtype`` are the dtypes ``encode`` returns, so :meth:`pack` / :meth:`unpack` can bit-cast a stored row."""

    name: str
    code_bits: int
    group: int | None
    scale_bytes: int
    encode: Callable[[torch.Tensor], Encoded]
    decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    code_dtype: torch.dtype
    scale_dtype: torch.dtype = torch.float16

    def bytes_per_vector(self, dim: int) -> int:
        scales = 0 if self.scale_bytes == 0 else 1 if self.group is None else dim // self.group
        return dim * self.code_bits // 8 + scales * self.scale_bytes

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` encoded as one uint8 row ``[..., bytes_per_vector(D)]``: the codes' bytes, then the
        scales' (bit-cast, so a stored row holds exactly what ``encode`` gave)."""
        codes, scales = self.encode(x)
        return torch.cat((codes.contiguous().view(torch.uint8), scales.contiguous().view(torch.uint8)), dim=-1)

    def unpack(self, stored: torch.Tensor, dim: int) -> torch.Tensor:
        """fp32 ``[..., dim]`` decoded from :meth:`pack`'s uint8 rows ``[..., bytes_per_vector(dim)]``."""
        split = dim * self.code_bits // 8
        codes = stored[..., :split].contiguous().view(self.code_dtype)
        return self.decode(codes, stored[..., split:].contiguous().view(self.scale_dtype))


def _groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 ``[..., D] -> [..., D / group, group]``; D must be a positive multiple of ``group``."""
    if x.shape[-1] == 0 or x.shape[-1] % group:
        raise ValueError(f"head dim {x.shape[-1]} is not a positive multiple of the codec's group {group}")
    return x.float().unflatten(-1, (-1, group))


def _no_scales(x: torch.Tensor) -> torch.Tensor:
    return x.new_zeros((*x.shape[:-1], 0), dtype=torch.float16)


def encode_bf16(x: torch.Tensor) -> Encoded:
    """BF16 codes (RNE from fp32), no scales."""
    return x.to(torch.bfloat16), _no_scales(x)


def encode_fp16(x: torch.Tensor) -> Encoded:
    """FP16 codes, ``fp16_rne`` (the BF16 pool's V plane: the writer converts BF16 -> FP16 with RNE), no scales."""
    return fp16_rne(x), _no_scales(x)


def decode_plain(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 of BF16 or FP16 codes (exact); ``scales`` is empty."""
    return codes.float()


def encode_int8_g64(x: torch.Tensor) -> Encoded:
    """INT8 G64: per 64 elements ``scale = fp16_rne(amax / 127)``; ``code = clamp(rne(x * fp32(1 / scale)), -127,
    127)`` (reciprocal multiply, normative); a zero scale (all-zero group, or amax/127 under 2^-25) gives codes 0.
    Codes int8 ``[..., D]``, scales fp16 ``[..., D / 64]``; |x| must stay below 65504 * 127 (fp16 scale range)."""
    groups = _groups(x, INT8_GROUP)
    scale = fp16_rne(div_rn(groups.abs().amax(dim=-1), 127.0))
    inverse = torch.reciprocal(scale.float()).unsqueeze(-1)
    codes = torch.where(scale.unsqueeze(-1) == 0, 0.0, torch.round(groups * inverse).clamp(-127, 127))
    return codes.to(torch.int8).flatten(-2), scale


def decode_int8_g64(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``code * scale`` per group of 64."""
    return (codes.float().unflatten(-1, (-1, INT8_GROUP)) * scales.float().unsqueeze(-1)).flatten(-2)


def encode_fp8_row(x: torch.Tensor) -> Encoded:
    """FP8 E4M3 row: one scale per whole vector, ``scale = fp16_rne(clamp(amax / 448, 2^-24, 65504))``;
    ``code = e4m3_rne_satfinite(x / scale)``; an all-zero vector gets scale 0 and codes 0.
    Codes float8_e4m3fn ``[..., D]``, scales fp16 ``[..., 1]``."""
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    zero = amax == 0
    scale = fp16_rne(div_rn(amax, E4M3_MAX).clamp(_FP16_MIN_SUBNORMAL, _FP16_MAX)).masked_fill(zero, 0)
    return e4m3_rne_satfinite(torch.where(zero, 0.0, x / scale.float())), scale


def decode_fp8_row(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``e4m3(code) * scale``."""
    return codes.float() * scales.float()


def encode_nvfp4_g16(x: torch.Tensor) -> Encoded:
    """NVFP4 G16 (no tensor-level scale): per 16 elements ``scale = e4m3_rne_satfinite(clamp(amax / 6, 2^-9, 448))``
    (UE4M3: never negative or zero); ``code = e2m1_rne_satfinite(x / scale)``. Codes uint8 ``[..., D / 2]``
    (element 2i in the low nibble), scales float8_e4m3fn ``[..., D / 16]``."""
    groups = _groups(x, NVFP4_KV_GROUP)
    scale = e4m3_rne_satfinite(div_rn(groups.abs().amax(dim=-1), E2M1_MAX).clamp(_E4M3_MIN_SUBNORMAL, E4M3_MAX))
    codes = e2m1_rne_satfinite(groups / scale.float().unsqueeze(-1))
    return pack_nibbles(codes.flatten(-2)), scale


def decode_nvfp4_g16(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``e2m1(code) * e4m3(scale)`` per group of 16."""
    values = e2m1_decode(unpack_nibbles(codes)).unflatten(-1, (-1, NVFP4_KV_GROUP))
    return (values * scales.float().unsqueeze(-1)).flatten(-2)


BF16 = VectorCodec("bf16", 16, None, 0, encode_bf16, decode_plain, torch.bfloat16)
FP16 = VectorCodec("fp16", 16, None, 0, encode_fp16, decode_plain, torch.float16)
INT8_G64 = VectorCodec("int8_g64", 8, INT8_GROUP, 2, encode_int8_g64, decode_int8_g64, torch.int8)
FP8_ROW = VectorCodec("fp8_e4m3_row", 8, None, 2, encode_fp8_row, decode_fp8_row, torch.float8_e4m3fn)
NVFP4_G16 = VectorCodec(
    "nvfp4_g16", 4, NVFP4_KV_GROUP, 1, encode_nvfp4_g16, decode_nvfp4_g16, torch.uint8, torch.float8_e4m3fn
)


def hadamard(dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix, fp32 ``[dim, dim]`` (dim a power of two):
    ``H_1 = [1]``, ``H_2n = [[H_n, H_n], [H_n, -H_n]]``, times ``fp32(dim^-1/2)`` (exact when dim is a power of 4).
    Symmetric and orthonormal, so it is its own inverse."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"the Sylvester Hadamard matrix needs a power-of-two size, got {dim}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h * dim**-0.5


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x @ H`` over the last axis (computed in fp32 from the input, e.g. BF16). Applying it twice gives
    ``x`` back up to fp32 rounding, so the same call un-rotates; ``(qH) . (kH) = q . k``."""
    return x.float() @ hadamard(x.shape[-1], x.device)


@attrs.frozen
class KVCodec:
    """One ``--kv-dtype``: the K and V plane codecs and which planes are Hadamard-rotated before encoding. The
    decoded planes stay rotated: the attention op rotates q to match and un-rotates its output when V is rotated."""

    name: str
    key: VectorCodec
    value: VectorCodec
    rotate_keys: bool
    rotate_values: bool

    def bytes_per_token_head(self, dim: int) -> int:
        return self.key.bytes_per_vector(dim) + self.value.bytes_per_vector(dim)

    def head_dim_problem(self, dim: int) -> str | None:
        """Why this codec cannot store ``dim``-element heads (a scale group that does not divide it, a rotation
        that needs a power of two), or None."""
        for plane in (self.key, self.value):
            if plane.group is not None and dim % plane.group:
                return f"its {plane.name} plane scales groups of {plane.group}, which do not divide head dim {dim}"
        if (self.rotate_keys or self.rotate_values) and dim & (dim - 1):
            return f"its Hadamard rotation needs a power-of-two head dim, not {dim}"
        return None

    def encode_keys(self, k: torch.Tensor) -> Encoded:
        return self.key.encode(hadamard_rotate(k) if self.rotate_keys else k)

    def encode_values(self, v: torch.Tensor) -> Encoded:
        return self.value.encode(hadamard_rotate(v) if self.rotate_values else v)

    def pack_keys(self, k: torch.Tensor) -> torch.Tensor:
        """``k [..., D]`` as stored KV-pool bytes ``[..., key.bytes_per_vector(D)]``, rotated first by the rule."""
        return self.key.pack(hadamard_rotate(k) if self.rotate_keys else k)

    def pack_values(self, v: torch.Tensor) -> torch.Tensor:
        return self.value.pack(hadamard_rotate(v) if self.rotate_values else v)

    def unpack_keys(self, stored: torch.Tensor, dim: int) -> torch.Tensor:
        """fp32 keys ``[..., dim]`` from stored bytes, un-rotated (the normalised Hadamard is its own inverse), so
        the ordinary attention math reads them as it reads unquantized keys."""
        keys = self.key.unpack(stored, dim)
        return hadamard_rotate(keys) if self.rotate_keys else keys

    def unpack_values(self, stored: torch.Tensor, dim: int) -> torch.Tensor:
        values = self.value.unpack(stored, dim)
        return hadamard_rotate(values) if self.rotate_values else values


KV_CODECS = {
    codec.name: codec
    for codec in (
        KVCodec("bf16", BF16, FP16, rotate_keys=False, rotate_values=False),
        KVCodec("int8", INT8_G64, INT8_G64, rotate_keys=True, rotate_values=False),
        KVCodec("fp8", FP8_ROW, FP8_ROW, rotate_keys=True, rotate_values=False),
        KVCodec("nvfp4", NVFP4_G16, NVFP4_G16, rotate_keys=True, rotate_values=True),
        KVCodec("k8v4", FP8_ROW, NVFP4_G16, rotate_keys=True, rotate_values=True),
    )
}


def pool_codec(kv_dtype: str) -> KVCodec | None:
    """The codec a KV pool of ``--kv-dtype kv_dtype`` stores through; None for ``bf16``, which keeps the model's
    dtype as it is (no quantize-on-write step, the only format the CUDA kernels read)."""
    if kv_dtype not in KV_CODECS:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; known: {', '.join(KV_CODECS)}")
    return None if kv_dtype == "bf16" else KV_CODECS[kv_dtype]
