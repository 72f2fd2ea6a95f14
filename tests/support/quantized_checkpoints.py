"""Tiny quantized Hugging Face checkpoints in the published layouts, written by the tests themselves from a tiny bf16
model: the codes come from ``ninfer.quant``, the tensor names, dtypes and ``quantization_config`` are the conventions'
(transformers fine-grained FP8, compressed-tensors NVFP4 / block FP8, ModelOpt NVFP4), and the dequantization
formulas below are the tests' own, written from those conventions (not ninfer's code).
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from ninfer.core.artifact.container import CHAT_TEMPLATE_RESOURCE, TOKENIZER_RESOURCE
from ninfer.plugins.qwen3_5.model.tiny import make_tiny
from ninfer.quant.fp8 import quantize_fp8_blockwise
from ninfer.quant.nvfp4 import quantize_nvfp4

#: A short chat-like prompt of real Qwen token ids.
PROMPT = [248045, 872, 198, 9707, 11, 1879, 0, 35, 2000, 5000, 123, 44, 55, 66, 77, 88]
KINDS = ("fp8", "nvfp4", "mixed", "modelopt")

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", "model.language_model.embed_tokens", "model.visual"],
}
_NVFP4_GROUP = {
    "targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                "dynamic": False},
    "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                          "symmetric": True, "dynamic": "local"},
}
_FP8_BLOCK_GROUP = {
    "targets": ["re:.*(self_attn|linear_attn).*"],
    "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                "symmetric": True, "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128,
                          "symmetric": True, "dynamic": True},
}
NVFP4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": _NVFP4_GROUP},
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
}
MIXED_CONFIG = {
    **NVFP4_CONFIG,
    "format": "mixed-precision",
    "config_groups": {
        "group_0": {**_NVFP4_GROUP, "targets": ["re:.*mlp.*"], "format": "nvfp4-pack-quantized"},
        "group_1": {**_FP8_BLOCK_GROUP, "format": "float-quantized"},
    },
}
MODELOPT_QUANT_CONFIG = {  # hf_quant_config.json
    "producer": {"name": "modelopt", "version": "0.29.0"},
    "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                     "exclude_modules": ["lm_head"]},
}


def tiny_dense(family: str = "qwen3_5"):
    """The tiny bf16 model every quantized checkpoint is made from (make-tiny's, seed 0)."""
    return make_tiny(types.SimpleNamespace(family=family, mtp=False, seed=0))


def write_checkpoint(directory: Path, tiny, tensors: dict[str, torch.Tensor], quantization: dict | None = None,
                     extra_files: dict[str, dict] | None = None) -> Path:
    """A one-file checkpoint directory: config.json (with ``quantization_config``), tokenizer, chat template."""
    directory.mkdir(parents=True)
    config = dict(tiny.config)
    if quantization is not None:
        config["quantization_config"] = quantization
    (directory / "config.json").write_text(json.dumps(config))
    for name, content in (extra_files or {}).items():
        (directory / name).write_text(json.dumps(content))
    save_file({k: v.contiguous() for k, v in tensors.items()}, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "tokenizer.json").write_bytes(tiny.resources[TOKENIZER_RESOURCE])
    (directory / "chat_template.jinja").write_bytes(tiny.resources[CHAT_TEMPLATE_RESOURCE])
    return directory


def projections(tensors: dict[str, torch.Tensor]) -> list[str]:
    """What these checkpoints quantize: every 2-D projection matrix of the decoder layers (GDN a/b included, as a
    checkpoint may); embeddings, lm_head, norms, conv and vision stay bf16."""
    return [n for n, t in tensors.items() if n.startswith("model.language_model.layers.") and t.dim() == 2
            and "proj" in n]


def fp8_official(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    codes, scale_inv = quantize_fp8_blockwise(weight)
    return {name: codes, name + "_scale_inv": scale_inv}


def fp8_compressed_tensors(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    codes, scale = quantize_fp8_blockwise(weight)
    return {name: codes, name + "_scale": scale}


def nvfp4_compressed_tensors(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    encoded, module = quantize_nvfp4(weight), name.removesuffix("weight")
    return {module + "weight_packed": encoded.codes, module + "weight_scale": encoded.scales,
            module + "weight_global_scale": encoded.global_scale.reshape(1),
            module + "input_global_scale": torch.tensor([1234.5])}


def nvfp4_modelopt(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    encoded, module = quantize_nvfp4(weight), name.removesuffix("weight")
    return {name: encoded.codes, module + "weight_scale": encoded.scales,
            module + "weight_scale_2": (1.0 / encoded.global_scale).reshape(()),
            module + "input_scale": torch.tensor(1 / 1234.5)}


def _encoder(kind: str, name: str) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]]:
    """How a ``kind`` checkpoint stores the projection ``name`` (mixed: NVFP4 MLP, block FP8 elsewhere)."""
    if kind == "fp8":
        return fp8_official
    if kind == "modelopt":
        return nvfp4_modelopt
    return fp8_compressed_tensors if kind == "mixed" and ".mlp." not in name else nvfp4_compressed_tensors


def quantized_checkpoint(directory: Path, tiny, kind: str) -> Path:
    """The tiny model as a ``kind`` checkpoint (one of :data:`KINDS`) in its published layout."""
    targets = set(projections(tiny.tensors))
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in tiny.tensors.items():
        tensors.update(_encoder(kind, name)(name, tensor) if name in targets else {name: tensor})
    if kind == "modelopt":
        return write_checkpoint(directory, tiny, tensors, extra_files={"hf_quant_config.json": MODELOPT_QUANT_CONFIG})
    quantization = {"fp8": FP8_CONFIG, "nvfp4": NVFP4_CONFIG, "mixed": MIXED_CONFIG}[kind]
    return write_checkpoint(directory, tiny, tensors, quantization)


# -- the tests' own dequantization formulas -------------------------------------------------------------------------

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def fp8_formula(codes: torch.Tensor, multiplier: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """``W[n, k] = e4m3(codes[n, k]) * multiplier[n // 128, k // 128]`` (matrix by matrix over leading dims)."""
    if codes.dim() > 2:
        return torch.stack([fp8_formula(c, m, block) for c, m in zip(codes, multiplier)])
    rows, columns = codes.shape
    tiles = multiplier.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return codes.float() * tiles[:rows, :columns]


def nvfp4_formula(packed: torch.Tensor, scale: torch.Tensor, divisor: torch.Tensor) -> torch.Tensor:
    """``W[n, k] = e2m1(nibble k of row n, low nibble first) * (e4m3(scale[n, k // 16]) / divisor)``."""
    if packed.dim() > 2:
        return torch.stack([nvfp4_formula(p, s, d) for p, s, d in zip(packed, scale, divisor.reshape(-1))])
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return _E2M1[codes.long()] * (scale.float() / divisor.float().reshape(())).repeat_interleave(16, dim=-1)


def nvfp4_modelopt_formula(packed: torch.Tensor, scale: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
    """ModelOpt's form: ``e2m1 * e4m3(scale) * weight_scale_2``."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return _E2M1[codes.long()] * (scale.float() * multiplier.float().reshape(())).repeat_interleave(16, dim=-1)


def stored_formula(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The dense weight ``name`` from the tensors a checkpoint or artifact stores, whichever convention they follow."""
    module = name.removesuffix("weight")
    if name + "_scale_inv" in tensors:
        return fp8_formula(tensors[name], tensors[name + "_scale_inv"])
    if module + "weight_packed" in tensors:
        return nvfp4_formula(tensors[module + "weight_packed"], tensors[name + "_scale"], tensors[name + "_global_scale"])
    if name + "_global_scale" in tensors:
        return nvfp4_formula(tensors[name], tensors[name + "_scale"], tensors[name + "_global_scale"])
    if name + "_scale_2" in tensors:
        return nvfp4_modelopt_formula(tensors[name], tensors[name + "_scale"], tensors[name + "_scale_2"])
    return fp8_formula(tensors[name], tensors[name + "_scale"])  # compressed-tensors block FP8
