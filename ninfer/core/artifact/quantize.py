"""``ninfer convert --quantize fp8|nvfp4``: a dense checkpoint's projection weights encoded as they stream out.

Which weights: the family's ``quantizable_weights(config)`` (the family's one policy); every other tensor is written
as stored. A quantized weight is encoded with ``ninfer.quant`` in ninfer's format (``ninfer.core.artifact.quantized``):
its codes under its own name, its scales right after; a stacked weight ``[E, N, K]`` one matrix at a time. Memory
stays bounded by one weight: its encoding is made when its codes are written and dropped once its scales are.
"""

from __future__ import annotations

from typing import Collection, Mapping

import attrs
import torch

from ninfer.core.artifact.container import Manifest, TensorEntry
from ninfer.core.artifact.quantized import (
    GLOBAL_SCALE,
    NVFP4_GROUP,
    SCALE,
    SCALE_INV,
    Fp8Block,
    Nvfp4,
    QuantFormat,
    quantization_summary,
)
from ninfer.core.errors import ConfigError
from ninfer.quant.fp8 import FP8_WEIGHT_BLOCK, quantize_fp8_blockwise
from ninfer.quant.nvfp4 import quantize_nvfp4

QUANTIZE_FORMATS: Mapping[str, QuantFormat] = {"fp8": Fp8Block(FP8_WEIGHT_BLOCK), "nvfp4": Nvfp4()}


def quantized_manifest(manifest: Manifest, quantize: str, shapes: Mapping[str, tuple[int, ...]],
                       targets: Collection[str]) -> tuple[Manifest, QuantFormat]:
    """The manifest of the artifact with ``targets`` (dense weights of ``shapes``) quantized to ``quantize``.

    A ConfigError for an unknown format, an already quantized source, or a weight the format cannot hold.
    """
    fmt = QUANTIZE_FORMATS.get(quantize)
    if fmt is None:
        raise ConfigError(f"--quantize {quantize!r}: choose one of {', '.join(QUANTIZE_FORMATS)}", param="quantize")
    if manifest.quantized:
        raise ConfigError("--quantize needs a dense checkpoint; this one is already quantized", param="quantize")
    for name in targets:
        if isinstance(fmt, Nvfp4) and shapes[name][-1] % NVFP4_GROUP:
            raise ConfigError(
                f"--quantize nvfp4: {name} has {shapes[name][-1]} input columns, not a multiple of {NVFP4_GROUP}",
                param="quantize",
            )
    quantized = {name: fmt for name in targets}
    return attrs.evolve(
        manifest,
        weight_format={**manifest.weight_format, "quantization": quantization_summary(quantized)},
        quantized={name: fmt.to_json() for name in quantized},
    ), fmt


def quantized_entries(entries: list[TensorEntry], targets: Collection[str], fmt: QuantFormat) -> list[TensorEntry]:
    """``entries`` with each target's dense entry replaced by its codes and scales, in that order."""
    encoder = _Encoder(fmt)
    out = []
    for entry in entries:
        if entry.name not in targets:
            out.append(entry)
            continue
        for name, (dtype, shape) in fmt.expected(entry.name, fmt.stored_shape(entry.shape)).items():
            out.append(TensorEntry(name, dtype, shape, lambda entry=entry, name=name: encoder.part(entry, name)))
    return out


class _Encoder:
    """Encodes one weight when the first of its parts is asked for, and hands each part out once."""

    def __init__(self, fmt: QuantFormat) -> None:
        self._fmt = fmt
        self._parts: dict[str, torch.Tensor] = {}

    def part(self, entry: TensorEntry, name: str) -> torch.Tensor:
        if name == entry.name:
            self._parts = encode(self._fmt, entry.name, entry.load())
        return self._parts.pop(name)


def encode(fmt: QuantFormat, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The codes (under ``name``) and scales of a dense ``[.., N, K]`` weight; leading dimensions stack matrices."""
    matrices = weight.reshape(-1, *weight.shape[-2:])
    if isinstance(fmt, Fp8Block):
        codes, scales = zip(*(quantize_fp8_blockwise(m, fmt.block) for m in matrices))
        parts = {name: codes, name + SCALE_INV: scales}
    else:
        encoded = [quantize_nvfp4(m) for m in matrices]
        parts = {
            name: [e.codes for e in encoded],
            name + SCALE: [e.scales for e in encoded],
            name + GLOBAL_SCALE: [e.global_scale for e in encoded],
        }
    lead = weight.shape[:-2]
    return {key: torch.stack(list(values)).reshape((*lead, *values[0].shape)) for key, values in parts.items()}
