"""Built-in KV-cache storage formats: bf16 keeps the model dtype; the quantized ones store the exact codecs of
``ninfer.quant.kv_codecs`` (the CPU reference path; on CUDA they await the quantized attention kernels)."""

from __future__ import annotations

from ninfer.core.descriptors import KVDtype
from ninfer.core.hookspecs import hookimpl
from ninfer.quant.kv_codecs import KV_CODECS, VectorCodec, pool_codec

#: The head dim the bits per element are quoted at (the real models'): the per-vector fp8 scale makes the
#: figure depend on D, and at 256 it gives the codecs' exact bytes (int8 528, fp8 516, nvfp4 288, k8v4 402).
QUOTED_HEAD_DIM = 256

_DESCRIPTIONS = {
    "bf16": "model-dtype KV, no quantization",
    "int8": "int8 KV with an fp16 scale per 64 elements, Hadamard-rotated keys",
    "fp8": "fp8 e4m3 KV with an fp16 scale per vector, Hadamard-rotated keys",
    "nvfp4": "NVFP4 KV: e2m1 values with an e4m3 scale per 16 elements, Hadamard-rotated K and V",
    "k8v4": "fp8 keys, NVFP4 values, Hadamard-rotated K and V",
}


def _bits(vector: VectorCodec) -> float:
    return 8 * vector.bytes_per_vector(QUOTED_HEAD_DIM) / QUOTED_HEAD_DIM


def _kv_dtype(name: str) -> KVDtype:
    """Bits per element from the codec's exact stored bytes (bf16's codec is 16 + 16); ``make_storage`` returns
    the pool's codec (None: the model dtype)."""
    codec = KV_CODECS[name]
    return KVDtype(
        name, _bits(codec.key), _bits(codec.value), _DESCRIPTIONS[name], make_storage=lambda: pool_codec(name)
    )


@hookimpl
def ninfer_kv_dtypes() -> list[KVDtype]:
    return [_kv_dtype(name) for name in ("bf16", "int8", "fp8", "nvfp4", "k8v4")]
