"""Quantized weights in a model source: ninfer's two formats, their companion tensors and their checks.

A quantized weight keeps the name its family expects (``W``: ``...q_proj.weight``, ``...experts.gate_up_proj``) for
its codes; its scales are companion tensors named ``W + suffix``. Leading dimensions (stacked experts) hold one
matrix each.

* ``fp8_block`` (Hugging Face fine-grained FP8, ``ninfer.quant.fp8``): ``W`` float8_e4m3fn ``[.., N, K]``;
  ``W_scale_inv`` fp32 ``[.., ceil(N/bn), ceil(K/bk)]``, the dequant multiplier of each ``bn x bk`` block.
* ``nvfp4`` (the compressed-tensors layout, ``ninfer.quant.nvfp4``): ``W`` uint8 ``[.., N, K/2]``, two E2M1 codes a
  byte; ``W_scale`` float8_e4m3fn ``[.., N, K/16]``; ``W_global_scale`` fp32, one per matrix, the per-tensor
  divisor. For ``<module>.weight`` the W4A4 activation divisor ``<module>.input_global_scale`` may come along: it is
  kept for the fused GPU path; the reference path (weight-only, A16) does not read it.

``Manifest.quantized`` maps every quantized ``W`` to its format's JSON: it is the one record of which tensors are
quantized, read by the weight checks, the loaders and ``artifact inspect``. Every other tensor is dense.
"""

from __future__ import annotations

from typing import Any, ClassVar, Collection, Mapping

import attrs
import torch

from ninfer.core.artifact.container import Manifest, TensorInfo
from ninfer.core.errors import ArtifactError, WeightMismatchError

SCALE_INV = "_scale_inv"
SCALE = "_scale"
GLOBAL_SCALE = "_global_scale"
INPUT_GLOBAL_SCALE = "input_global_scale"
NVFP4_GROUP = 16


@attrs.frozen
class Fp8Block:
    """Block-wise FP8 E4M3 codes with one fp32 multiplier per ``block = (rows, columns)`` tile."""

    block: tuple[int, int]
    name: ClassVar[str] = "fp8_block"

    def companions(self, weight: str) -> tuple[str, ...]:
        return (weight + SCALE_INV,)

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return stored

    def stored_shape(self, logical: tuple[int, ...]) -> tuple[int, ...]:
        return logical

    def expected(self, weight: str, stored: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """dtype and shape of the codes and of each companion, given the stored codes' shape."""
        *lead, rows, columns = stored
        grid = (-(-rows // self.block[0]), -(-columns // self.block[1]))
        return {weight: (torch.float8_e4m3fn, stored), weight + SCALE_INV: (torch.float32, (*lead, *grid))}

    def to_json(self) -> dict[str, Any]:
        return {"format": self.name, "block": list(self.block)}

    @property
    def label(self) -> str:
        return f"{self.name} {self.block[0]}x{self.block[1]}"


@attrs.frozen
class Nvfp4:
    """NVFP4: E2M1 codes, one E4M3 scale per 16 consecutive k, one fp32 divisor per matrix."""

    name: ClassVar[str] = "nvfp4"

    def companions(self, weight: str) -> tuple[str, ...]:
        return (weight + SCALE, weight + GLOBAL_SCALE)

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        return (*stored[:-1], 2 * stored[-1])

    def stored_shape(self, logical: tuple[int, ...]) -> tuple[int, ...]:
        return (*logical[:-1], logical[-1] // 2)

    def expected(self, weight: str, stored: tuple[int, ...]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        *lead, rows, packed = stored
        return {
            weight: (torch.uint8, stored),
            weight + SCALE: (torch.float8_e4m3fn, (*lead, rows, 2 * packed // NVFP4_GROUP)),
            weight + GLOBAL_SCALE: (torch.float32, tuple(lead)),  # one element per matrix; [] and [1] both fit
        }

    def to_json(self) -> dict[str, Any]:
        return {"format": self.name, "group": NVFP4_GROUP}

    @property
    def label(self) -> str:
        return f"{self.name} g{NVFP4_GROUP}"


QuantFormat = Fp8Block | Nvfp4


def format_from_json(data: Any, *, where: str) -> QuantFormat:
    """The format a ``Manifest.quantized`` entry describes; an ArtifactError naming ``where`` if it is not one."""
    if isinstance(data, Mapping) and data.get("format") == Fp8Block.name:
        block = data.get("block")
        if isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block):
            return Fp8Block((block[0], block[1]))
    elif isinstance(data, Mapping) and data.get("format") == Nvfp4.name and data.get("group") == NVFP4_GROUP:
        return Nvfp4()
    raise ArtifactError(
        f"{where}: unknown quantized format {data!r}; expected {{'format': 'fp8_block', 'block': [rows, columns]}} "
        f"or {{'format': 'nvfp4', 'group': {NVFP4_GROUP}}}"
    )


def quantized_formats(manifest: Manifest) -> dict[str, QuantFormat]:
    """Each quantized weight of the manifest with its format."""
    return {name: format_from_json(data, where=f"quantized weight {name!r}") for name, data in manifest.quantized.items()}


def companion_names(weight: str, fmt: QuantFormat, present: Collection[str]) -> list[str]:
    """The companions of ``weight`` that ``present`` holds: the format's scales and an optional activation divisor."""
    names = list(fmt.companions(weight))
    if isinstance(fmt, Nvfp4) and weight.endswith("weight"):
        names.append(weight.removesuffix("weight") + INPUT_GLOBAL_SCALE)
    return [name for name in names if name in present]


def logical_shapes(infos: Mapping[str, TensorInfo], formats: Mapping[str, QuantFormat]) -> dict[str, tuple[int, ...]]:
    """Every weight's shape as the model sees it: a quantized one its dense shape, companions left out."""
    hidden = {name for weight, fmt in formats.items() for name in companion_names(weight, fmt, infos)}
    return {
        name: formats[name].logical_shape(info.shape) if name in formats else tuple(info.shape)
        for name, info in infos.items()
        if name not in hidden
    }


def check_quantized(infos: Mapping[str, TensorInfo], formats: Mapping[str, QuantFormat], where: str) -> None:
    """Every quantized weight has its codes and scales with the format's dtypes and shapes (WeightMismatchError)."""
    for weight, fmt in formats.items():
        if weight not in infos:
            raise WeightMismatchError(f"{where}: quantized weight {weight!r} is missing", param=weight)
        for name, (dtype, shape) in fmt.expected(weight, tuple(infos[weight].shape)).items():
            info = infos.get(name)
            if info is None:
                raise WeightMismatchError(f"{where}: {fmt.name} weight {weight!r} lacks its tensor {name!r}", param=name)
            fits = tuple(info.shape) == shape or (name.endswith(GLOBAL_SCALE) and _numel(info.shape) == _numel(shape))
            if info.dtype != dtype or not fits:
                raise WeightMismatchError(
                    f"{where}: {name!r} of the {fmt.label} weight {weight!r} is {_dtype(info.dtype)} "
                    f"{list(info.shape)}, expected {_dtype(dtype)} {list(shape)}",
                    param=name,
                )


def quantization_summary(formats: Mapping[str, QuantFormat]) -> dict[str, int] | None:
    """``weight_format["quantization"]``: how many weights each format holds (None for a dense source)."""
    counts: dict[str, int] = {}
    for fmt in formats.values():
        counts[fmt.label] = counts.get(fmt.label, 0) + 1
    return counts or None


def dense_dtype(infos: Mapping[str, TensorInfo], formats: Mapping[str, QuantFormat]) -> torch.dtype | None:
    """The floating dtype holding most bytes of the dense tensors (codes and scales left out); None if there are none."""
    quantized = {name for weight, fmt in formats.items() for name in (weight, *companion_names(weight, fmt, infos))}
    totals: dict[torch.dtype, int] = {}
    for name, info in infos.items():
        if name not in quantized and info.dtype.is_floating_point:
            totals[info.dtype] = totals.get(info.dtype, 0) + info.nbytes
    return max(totals, key=lambda dtype: totals[dtype]) if totals else None


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
