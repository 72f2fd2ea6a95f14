"""Built-in KV-cache storage formats. bf16 is the native path; the quantized formats land with the GPU work."""

from __future__ import annotations

from ninfer.core.descriptors import KVDtype
from ninfer.core.hookspecs import hookimpl


def _native_storage(**_: object) -> None:
    """bf16 needs no quantize-on-write step: the KV pool stores the model dtype directly."""
    return None


@hookimpl
def ninfer_kv_dtypes() -> list[KVDtype]:
    return [
        KVDtype("bf16", 16, 16, "model-dtype KV, no quantization", make_storage=_native_storage),
        KVDtype("int8", 8.125, 8.125, "int8 KV with a bf16 scale per 128 elements"),
        KVDtype("fp8", 8, 8, "fp8 e4m3 KV with per-layer scales"),
        KVDtype("nvfp4", 4.5, 4.5, "NVFP4 KV: e2m1 values with an fp8 scale per 16 elements"),
        KVDtype("k8v4", 8, 4.5, "fp8 keys, NVFP4 values"),
    ]
