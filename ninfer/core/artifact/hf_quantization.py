"""Which quantized Hugging Face checkpoints ninfer reads, and how their tensors become ninfer's formats.

Accepted ``quantization_config``s (anything else quantized is refused with an error naming its method):

* ``quant_method: "fp8"`` (transformers ``FineGrainedFP8Config``): ``fmt: "e4m3"``, ``activation_scheme: "dynamic"``,
  ``weight_block_size: [bn, bk]``, ``scale_fmt: "float"``. A Linear stores ``weight`` (E4M3) and ``weight_scale_inv``
  (the fp32 block multiplier): ninfer's ``fp8_block`` as is. ``modules_to_not_convert`` need not be read: those
  modules store a dense ``weight`` and no scales.
* ``quant_method: "compressed-tensors"`` (``quantization_status: "compressed"``), one or more ``config_groups`` whose
  format is ``nvfp4-pack-quantized`` (weights 4-bit float, ``tensor_group`` strategy, group 16) or
  ``float-quantized`` with the ``block`` strategy (8-bit float, ``block_structure``); a "mixed-precision" checkpoint
  holds both. ``weight_packed`` is presented as ``weight`` (``weight_scale``, ``weight_global_scale`` and
  ``input_global_scale`` keep their names: ninfer's nvfp4 is this layout); a block-FP8 ``weight_scale`` is
  presented as ``weight_scale_inv`` (both are the block multiplier). Sources: compressed-tensors
  ``compressors/quantized_compressors/fp4_quantized.py``, vLLM ``compressed_tensors_w4a4_nvfp4.py``.
* ``quant_method: "modelopt"`` with ``quant_algo: "NVFP4"`` (in ``config.json`` or ``hf_quant_config.json``):
  ``weight`` (packed uint8) and ``weight_scale`` (E4M3) as compressed-tensors; ``weight_scale_2`` and
  ``input_scale`` are per-tensor multipliers, presented as their reciprocals ``weight_global_scale`` and
  ``input_global_scale`` (as compressed-tensors' own ModelOpt converter does; vLLM ``modelopt.py``).

Renames are zero-copy (the bytes stay where the shard has them); the ModelOpt reciprocals are the only values
computed. Which weights are quantized is then read off the presented tensors (:meth:`QuantizationPlan.formats`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import attrs
import torch

from ninfer.core.artifact.container import TensorInfo
from ninfer.core.artifact.quantized import (
    GLOBAL_SCALE,
    INPUT_GLOBAL_SCALE,
    NVFP4_GROUP,
    SCALE_INV,
    Fp8Block,
    Nvfp4,
    QuantFormat,
    check_quantized,
    companion_names,
)
from ninfer.core.errors import ArtifactError, NotYetAvailableError

#: Quantized element dtypes: a tensor of one of these that is neither codes nor a scale has lost its scales.
_CODE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_SUPPORTED = (
    "ninfer reads block-wise fp8, compressed-tensors nvfp4-pack-quantized / block float-quantized and modelopt "
    "NVFP4 checkpoints; use the unquantized checkpoint (ninfer convert --quantize fp8|nvfp4 makes either from it)"
)


@attrs.frozen
class QuantizationPlan:
    """How a checkpoint's stored tensors become ninfer's quantized weights.

    ``renames``: stored name -> presented name. ``derived``: presented name -> (stored source, transform) for
    values computed on read. ``fp8`` / ``nvfp4``: the formats the checkpoint's config allows.
    """

    method: str | None = None
    fp8: Fp8Block | None = None
    nvfp4: bool = False
    renames: Mapping[str, str] = attrs.field(factory=dict)
    derived: Mapping[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = attrs.field(factory=dict)

    def formats(self, infos: Mapping[str, TensorInfo], where: str) -> dict[str, QuantFormat]:
        """Every quantized weight of the presented tensors ``infos``: codes beside ``_scale_inv`` (block FP8) or
        ``_global_scale`` (NVFP4), checked against its format; codes without scales are an ArtifactError."""
        if self.method is None:
            return {}
        found: dict[str, QuantFormat] = {}
        for name in infos:
            for suffix, fmt in ((SCALE_INV, self.fp8), (GLOBAL_SCALE, Nvfp4() if self.nvfp4 else None)):
                weight = name.removesuffix(suffix)
                if weight != name and weight in infos:
                    if fmt is None:
                        raise ArtifactError(
                            f"{where}: {name!r} is a {'block-FP8' if suffix == SCALE_INV else 'NVFP4'} scale but the "
                            f"{self.method} quantization_config declares no such format"
                        )
                    found[weight] = fmt
        check_quantized(infos, found, where)
        owned = {name for weight, fmt in found.items() for name in (weight, *companion_names(weight, fmt, infos))}
        orphans = [name for name, info in infos.items() if info.dtype in _CODE_DTYPES and name not in owned]
        if orphans:
            raise ArtifactError(f"{where}: {orphans[0]!r} holds quantized codes ({infos[orphans[0]].dtype}) but no scales")
        return found


def plan_quantization(
    quantization: Any, stored: Mapping[str, TensorInfo], config_path: Path
) -> QuantizationPlan:
    """The plan for a checkpoint whose ``quantization_config`` is ``quantization`` (None: not quantized).

    An unsupported method, format or scheme is a NotYetAvailableError naming it; a malformed one an ArtifactError.
    """
    if quantization is None:
        return QuantizationPlan()
    if not isinstance(quantization, Mapping):
        raise ArtifactError(f"{config_path}: 'quantization_config' must be a JSON object")
    method = str(quantization.get("quant_method", "")).lower()
    where = f"{config_path}: quantization_config"
    if method == "fp8":
        return QuantizationPlan("fp8", fp8=_fine_grained_fp8(quantization, where))
    if method == "compressed-tensors":
        return _compressed_tensors(quantization, stored, where)
    if method == "modelopt":
        return _modelopt(quantization, stored, where)
    raise NotYetAvailableError(f"{where}: quantization method {method!r} is not supported; {_SUPPORTED}")


def _fine_grained_fp8(config: Mapping[str, Any], where: str) -> Fp8Block:
    for key, default, wanted in (("fmt", "e4m3", "e4m3"), ("activation_scheme", "dynamic", "dynamic"),
                                 ("scale_fmt", "float", "float"), ("expert_dtype", "fp8", "fp8")):
        value = config.get(key, default)
        if value != wanted:
            raise NotYetAvailableError(f"{where}: fp8 with {key} {value!r} is not supported (only {wanted!r})")
    block = config.get("weight_block_size", [128, 128])
    if block is None:
        raise NotYetAvailableError(f"{where}: per-tensor fp8 (weight_block_size null) is not supported; {_SUPPORTED}")
    return Fp8Block(_block(block, f"{where}: weight_block_size"))


def _compressed_tensors(config: Mapping[str, Any], stored: Mapping[str, TensorInfo], where: str) -> QuantizationPlan:
    status = config.get("quantization_status", "compressed")
    if status != "compressed":
        raise NotYetAvailableError(f"{where}: compressed-tensors status {status!r} is not supported (only 'compressed')")
    for key in ("sparsity_config", "kv_cache_scheme"):
        if config.get(key):
            raise NotYetAvailableError(f"{where}: compressed-tensors {key} is not supported")
    groups = config.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ArtifactError(f"{where}: compressed-tensors needs a non-empty 'config_groups' object")
    fp8: Fp8Block | None = None
    nvfp4 = False
    for name, group in groups.items():
        if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
            raise ArtifactError(f"{where}: config group {name!r} needs a 'weights' object")
        fmt, weights = group.get("format") or config.get("format"), group["weights"]
        scheme = {key: weights.get(key) for key in ("num_bits", "type", "strategy")}
        if fmt == "nvfp4-pack-quantized" and scheme == {"num_bits": 4, "type": "float", "strategy": "tensor_group"}:
            if weights.get("group_size") != NVFP4_GROUP:
                raise NotYetAvailableError(f"{where}: NVFP4 group_size {weights.get('group_size')!r} (only 16)")
            nvfp4 = True
        elif fmt == "float-quantized" and scheme == {"num_bits": 8, "type": "float", "strategy": "block"}:
            block = Fp8Block(_block(weights.get("block_structure"), f"{where}: group {name!r} block_structure"))
            if fp8 not in (None, block):
                raise NotYetAvailableError(f"{where}: block-FP8 groups with different blocks are not supported")
            fp8 = block
        else:
            raise NotYetAvailableError(
                f"{where}: compressed-tensors group {name!r} (format {fmt!r}, weights {scheme}) is not supported; "
                f"{_SUPPORTED}"
            )
    renames = {}
    for name in stored:
        codes = stored.get(name.removesuffix("_scale"))
        if name.endswith(".weight_packed"):
            renames[name] = name.removesuffix("_packed")
        elif name.endswith(".weight_scale") and codes is not None and codes.dtype == torch.float8_e4m3fn:
            renames[name] = name + "_inv"
    clashes = sorted(set(renames.values()) & (set(stored) - set(renames)))
    if clashes:
        raise ArtifactError(f"{where}: {clashes[0]!r} is stored beside the tensor that would be presented under it")
    return QuantizationPlan("compressed-tensors", fp8=fp8, nvfp4=nvfp4, renames=renames)


def _modelopt(config: Mapping[str, Any], stored: Mapping[str, TensorInfo], where: str) -> QuantizationPlan:
    inner = config.get("quantization", config)
    algo = str(inner.get("quant_algo", "")).upper() if isinstance(inner, Mapping) else ""
    if algo != "NVFP4":
        raise NotYetAvailableError(f"{where}: modelopt quant_algo {algo or None!r} is not supported; {_SUPPORTED}")
    if inner.get("group_size", NVFP4_GROUP) != NVFP4_GROUP:
        raise NotYetAvailableError(f"{where}: NVFP4 group_size {inner.get('group_size')!r} (only 16)")
    if inner.get("kv_cache_quant_algo") or inner.get("kv_cache_scheme"):
        raise NotYetAvailableError(
            f"{where}: KV-cache scales from the checkpoint are not supported; ninfer picks the KV format with --kv-dtype"
        )
    derived: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {}
    for name in stored:
        if name.endswith(".weight_scale_2"):
            weight = name.removesuffix("_scale_2")
            derived[weight + GLOBAL_SCALE] = (name, _reciprocal)
            activation = weight.removesuffix("weight") + "input_scale"
            if activation in stored:
                derived[weight.removesuffix("weight") + INPUT_GLOBAL_SCALE] = (activation, _reciprocal)
    return QuantizationPlan("modelopt", nvfp4=True, derived=derived)


def _reciprocal(multiplier: torch.Tensor) -> torch.Tensor:
    """A ModelOpt per-tensor multiplier as compressed-tensors' divisor (fp32)."""
    return torch.reciprocal(multiplier.float())


def _block(value: Any, where: str) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise ArtifactError(f"{where} must be two positive integers, got {value!r}")
    return value[0], value[1]
