"""DFlash and DFlash2 drafter companions: the z-lab drafter format, carried into a .ninfer artifact next to its target.

A z-lab DFlash drafter directory holds a ``config.json`` (a Qwen3-style decoder config plus ``block_size``,
``num_target_layers``, ``layer_types``, ``sliding_window`` and ``dflash_config: {mask_token_id, target_layer_ids}``)
and safetensors with ``fc``, ``hidden_norm``, ``norm`` and ``layers.{i}.*``; it has no embedding and no lm_head of
its own. A DFlash2 drafter (``DFlash2DraftModel``) adds, per layer, the two-tap grouped dynamic convolutions
``attention_conv`` / ``mlp_conv`` and, once, the ``candidate_selector`` codebooks (``dflash_config`` gains
``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k`` and optionally ``output_multiplier``
and ``final_logit_softcapping``). In the artifact a companion's tensors are named ``<companion>.<name>`` (``dflash.``
or ``dflash2.``) and its ``config.json`` is kept verbatim under ``manifest.config["companion_configs"][companion]``;
``manifest.companions`` lists the companion name.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import attrs

from ninfer.core.artifact.container import Manifest, MappedSafetensors, TensorEntry, TensorInfo
from ninfer.core.errors import ArtifactError, ConfigError, NotYetAvailableError, WeightMismatchError

#: Key of ``manifest.config`` under which companion drafters' own configs are stored, by companion name.
COMPANION_CONFIGS = "companion_configs"
#: The drafter architecture each companion name carries.
COMPANION_ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
#: Third-party spellings of the fusion tensors (e.g. Muse-Glimmer's "assistant") and their z-lab names.
_RENAMED = {"encoder.fc.weight": "fc.weight", "encoder.output_norm_enc.weight": "hidden_norm.weight"}
SLIDING_ATTENTION = "sliding_attention"
FULL_ATTENTION = "full_attention"

Shapes = dict[str, tuple[int, ...]]


@attrs.frozen
class DFlashConfig:
    """The drafter facts ninfer uses, read from its ``config.json``."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    layer_types: tuple[str, ...]
    sliding_window: int | None
    block_size: int
    num_target_layers: int | None
    target_layer_ids: tuple[int, ...]
    mask_token_id: int

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str, companion: str = "dflash") -> "DFlashConfig":
        """Validate the DFlash facts of a drafter ``config.json`` whose architecture is ``companion``'s; every
        problem is an ArtifactError naming ``source``."""

        def integer(key: str, value: Any = None, minimum: int = 1) -> int:
            value = config.get(key) if value is None else value
            return _integer(key, value, minimum, source)

        _check_architecture(config, companion, source)
        dflash = config.get("dflash_config")
        if not isinstance(dflash, Mapping):
            raise ArtifactError(f"{source}: 'dflash_config' (with mask_token_id and target_layer_ids) is missing")
        layers = integer("num_hidden_layers")
        heads = integer("num_attention_heads")
        hidden = integer("hidden_size")
        target_ids = dflash.get("target_layer_ids")
        if target_ids is None and isinstance(config.get("num_target_layers"), int):
            target_ids = default_target_layer_ids(config["num_target_layers"], layers)
        if not isinstance(target_ids, list) or not target_ids or not all(isinstance(i, int) for i in target_ids):
            raise ArtifactError(f"{source}: dflash_config.target_layer_ids must be a non-empty list of layer indices")
        layer_types = tuple(config.get("layer_types") or [FULL_ATTENTION] * layers)
        if len(layer_types) != layers or not set(layer_types) <= {SLIDING_ATTENTION, FULL_ATTENTION}:
            raise ArtifactError(
                f"{source}: layer_types {list(layer_types)} must give {layers} entries of "
                f"{SLIDING_ATTENTION!r}/{FULL_ATTENTION!r}"
            )
        sliding = config.get("sliding_window")
        if SLIDING_ATTENTION in layer_types:
            sliding = integer("sliding_window")
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise NotYetAvailableError(f"{source}: DFlash drafters with attention/MLP biases are not yet available")
        if config.get("causal", config.get("is_causal", False)):
            raise NotYetAvailableError(f"{source}: causal DFlash drafters are not yet available")
        scaling = config.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise NotYetAvailableError(f"{source}: DFlash rope_scaling {scaling!r} is not yet available")
        rope = config.get("rope_parameters") or {}
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=integer("num_key_value_heads", config.get("num_key_value_heads", heads)),
            head_dim=integer("head_dim", config.get("head_dim", hidden // heads)),
            intermediate_size=integer("intermediate_size"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10_000.0))),
            layer_types=layer_types,
            sliding_window=sliding,
            block_size=integer("block_size", dflash.get("block_size"), minimum=2),
            num_target_layers=config.get("num_target_layers"),
            target_layer_ids=tuple(target_ids),
            mask_token_id=integer("mask_token_id", dflash.get("mask_token_id"), minimum=0),
        )

    def check_target(self, hidden_size: int, num_layers: int, vocab_size: int, source: str) -> None:
        """The drafter fits a target of this width, depth and vocabulary."""
        if hidden_size != self.hidden_size:
            raise WeightMismatchError(
                f"{source}: the DFlash drafter's hidden_size {self.hidden_size} differs from the target's {hidden_size}"
            )
        if not all(0 <= index < num_layers for index in self.target_layer_ids):
            raise WeightMismatchError(
                f"{source}: DFlash target_layer_ids {list(self.target_layer_ids)} must lie in [0, {num_layers})"
            )
        if not 0 <= self.mask_token_id < vocab_size:
            raise WeightMismatchError(
                f"{source}: DFlash mask_token_id {self.mask_token_id} is outside the target vocabulary ({vocab_size})"
            )

    def tensor_shapes(self) -> Shapes:
        """Every drafter tensor (z-lab names, no prefix) with its shape."""
        hidden, dim = self.hidden_size, self.head_dim
        q_out, kv_out = self.num_attention_heads * dim, self.num_key_value_heads * dim
        shapes: Shapes = {
            "fc.weight": (hidden, hidden * len(self.target_layer_ids)),
            "hidden_norm.weight": (hidden,),
            "norm.weight": (hidden,),
        }
        for index in range(self.num_hidden_layers):
            prefix = f"layers.{index}."
            shapes.update({
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (q_out, hidden),
                prefix + "self_attn.k_proj.weight": (kv_out, hidden),
                prefix + "self_attn.v_proj.weight": (kv_out, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, q_out),
                prefix + "self_attn.q_norm.weight": (dim,),
                prefix + "self_attn.k_norm.weight": (dim,),
                prefix + "mlp.gate_proj.weight": (self.intermediate_size, hidden),
                prefix + "mlp.up_proj.weight": (self.intermediate_size, hidden),
                prefix + "mlp.down_proj.weight": (hidden, self.intermediate_size),
            })
        return shapes


@attrs.frozen
class DFlash2Config:
    """A DFlash2 drafter: the DFlash facts plus its convolutions' and candidate selector's facts."""

    dflash: DFlashConfig
    vocab_size: int
    conv_kernel_size: int  # taps of each grouped dynamic causal convolution
    conv_group_size: int  # channels sharing one dynamic tap weight
    selector_rank: int
    selector_top_k: int
    output_multiplier: float
    final_logit_softcapping: float | None

    @property
    def conv_groups(self) -> int:
        return self.dflash.hidden_size // self.conv_group_size

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source: str) -> "DFlash2Config":
        """Validate a DFlash2 drafter ``config.json`` (``dflash_config`` values win over top-level ones)."""
        dflash = DFlashConfig.from_dict(config, source, "dflash2")
        extra: Mapping[str, Any] = config["dflash_config"]

        def value(key: str, default: Any = None) -> Any:
            return extra.get(key, config.get(key, default))

        def number(key: str, default: float | None) -> float | None:
            found = value(key, default)
            if found is None:
                return None
            if isinstance(found, bool) or not isinstance(found, (int, float)) or not math.isfinite(found):
                raise ArtifactError(f"{source}: {key!r} must be a finite number, got {found!r}")
            return float(found)

        for key, default, supported in _UNSUPPORTED_DFLASH2:
            if value(key, default) not in supported:
                raise NotYetAvailableError(
                    f"{source}: DFlash2 drafters with {key}={value(key)!r} are not yet available"
                )
        vocab = _integer("vocab_size", config.get("vocab_size"), 1, source)
        kernel = _integer("conv_kernel_size", value("conv_kernel_size"), 1, source)
        group = _integer("conv_group_size", value("conv_group_size"), 1, source)
        top_k = _integer("selector_top_k", value("selector_top_k"), 1, source)
        if dflash.hidden_size % group:
            raise ArtifactError(
                f"{source}: hidden_size {dflash.hidden_size} is not a multiple of conv_group_size {group}"
            )
        if kernel > dflash.block_size:
            raise ArtifactError(f"{source}: conv_kernel_size {kernel} exceeds block_size {dflash.block_size}")
        if top_k > vocab:
            raise ArtifactError(f"{source}: selector_top_k {top_k} exceeds vocab_size {vocab}")
        softcap = number("final_logit_softcapping", None)
        if softcap is not None and softcap <= 0:
            raise ArtifactError(f"{source}: 'final_logit_softcapping' must be positive, got {softcap}")
        multiplier = number("output_multiplier", 1.0)
        assert multiplier is not None
        return cls(
            dflash=dflash,
            vocab_size=vocab,
            conv_kernel_size=kernel,
            conv_group_size=group,
            selector_rank=_integer("selector_rank", value("selector_rank"), 1, source),
            selector_top_k=top_k,
            output_multiplier=multiplier,
            final_logit_softcapping=softcap,
        )

    def check_target(self, hidden_size: int, num_layers: int, vocab_size: int, source: str) -> None:
        """The drafter fits a target of this width, depth and vocabulary (its codebooks cover the vocabulary)."""
        self.dflash.check_target(hidden_size, num_layers, vocab_size, source)
        if vocab_size != self.vocab_size:
            raise WeightMismatchError(
                f"{source}: the DFlash2 drafter's vocab_size {self.vocab_size} differs from the target's {vocab_size}"
            )

    def tensor_shapes(self) -> Shapes:
        """Every drafter tensor (z-lab names, no prefix) with its shape: DFlash's, the convs and the selector."""
        hidden, taps, rank = self.dflash.hidden_size, self.conv_kernel_size, self.selector_rank
        shapes = self.dflash.tensor_shapes()
        for index in range(self.dflash.num_hidden_layers):
            for conv in ("attention_conv", "mlp_conv"):
                prefix = f"layers.{index}.{conv}."
                shapes[prefix + "base_kernel"] = (2, taps, hidden)
                shapes[prefix + "kernel_projection.weight"] = (2 * taps * self.conv_groups, hidden)
        shapes.update({
            "candidate_selector.predecessor_codebook": (self.vocab_size, rank),
            "candidate_selector.successor_codebook": (self.vocab_size, rank),
            "candidate_selector.hidden_projection.weight": (rank, hidden),
        })
        return shapes


#: DFlash2 config variants other ports know and ninfer does not run: (key, default, supported values).
_UNSUPPORTED_DFLASH2 = (
    ("sample_from_anchor", False, (False, None)),
    ("attention_mode", "gqa", ("gqa",)),
    ("shift_label", False, (False, None)),
    ("pure_draft_prefix_len", 0, (0, None)),
    ("projector_type", None, (None,)),
    ("input_embedding_scale", 1.0, (1, 1.0)),
)

DrafterConfig = DFlashConfig | DFlash2Config
_CONFIG_READERS = {"dflash": DFlashConfig.from_dict, "dflash2": DFlash2Config.from_dict}


def read_drafter_config(raw: Mapping[str, Any], companion: str, source: str) -> DrafterConfig:
    """The validated config of companion ``companion`` (``"dflash"`` or ``"dflash2"``)."""
    reader = _CONFIG_READERS.get(companion)
    if reader is None:
        raise ConfigError(f"unknown drafter companion {companion!r}; expected one of {sorted(_CONFIG_READERS)}")
    return reader(raw, source)


def _integer(key: str, value: Any, minimum: int, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ArtifactError(f"{source}: {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_architecture(config: Mapping[str, Any], companion: str, source: str) -> None:
    """``config`` declares ``companion``'s drafter architecture; a sibling's is named with its flag."""
    architectures = config.get("architectures") or []
    expected = COMPANION_ARCHITECTURES[companion]
    if expected in architectures:
        return
    other = next((name for name, arch in COMPANION_ARCHITECTURES.items() if arch in architectures), None)
    hint = f"; it is a {COMPANION_ARCHITECTURES[other]} drafter: carry it with --{other}" if other else ""
    raise ArtifactError(f"{source}: architectures {architectures!r} is not [{expected!r}]{hint}")


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """z-lab's default taps when a config gives none: ``count`` layers spread from 1 to ``num_target_layers - 3``."""
    if count < 2:
        return [1]
    return [round(1 + index * (num_target_layers - 4) / (count - 1)) for index in range(count)]


def companion_config(manifest: Manifest, name: str) -> Mapping[str, Any] | None:
    """The stored ``config.json`` of companion ``name``, or None when the artifact carries none."""
    configs = manifest.config.get(COMPANION_CONFIGS) or {}
    return configs.get(name)


def check_tensors(expected: Shapes, found: Mapping[str, TensorInfo], source: str) -> None:
    """Exactly the expected drafter tensors with their shapes, or a WeightMismatchError listing what differs."""
    problems = [f"missing {name}" for name in expected if name not in found]
    problems += [
        f"{name} has shape {list(found[name].shape)}, expected {list(shape)}"
        for name, shape in expected.items()
        if name in found and tuple(found[name].shape) != tuple(shape)
    ]
    problems += [f"unexpected {name}" for name in found if name not in expected]
    if problems:
        raise WeightMismatchError(
            f"{source}: the DFlash drafter's tensors do not match its config: " + "; ".join(problems[:8])
        )


class DrafterDirectory:
    """A z-lab DFlash or DFlash2 drafter directory opened for conversion (companion ``name``): its config and
    zero-copy tensor entries."""

    def __init__(self, path: str | os.PathLike[str], name: str = "dflash") -> None:
        from ninfer.core.artifact.hf_directory import CONFIG_FILE, read_shards

        if name not in COMPANION_ARCHITECTURES:
            raise ConfigError(f"unknown drafter companion {name!r}; expected one of {sorted(COMPANION_ARCHITECTURES)}")
        self.name = name
        self.path = Path(path)
        if not self.path.is_dir():
            raise ArtifactError(f"{self.path}: no such directory; expected a {COMPANION_ARCHITECTURES[name]} directory")
        config_path = self.path / CONFIG_FILE
        try:
            self.raw_config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"{config_path}: cannot read the drafter config ({exc})") from None
        if not isinstance(self.raw_config, dict):
            raise ArtifactError(f"{config_path}: the drafter config must be a JSON object")
        self.config = read_drafter_config(self.raw_config, name, str(config_path))
        self.shards = read_shards(self.path)
        self._located = {
            _RENAMED.get(tensor, tensor): (shard, info)
            for shard in self.shards
            for tensor, info in shard.tensors.items()
        }
        check_tensors(self.config.tensor_shapes(), {n: info for n, (_, info) in self._located.items()}, str(self.path))
        self._mapped: dict[Path, MappedSafetensors] = {}

    def check_target(self, manifest: Manifest) -> None:
        text = manifest.text_config
        self.config.check_target(
            int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"]), str(self.path)
        )

    def manifest_with_companion(self, manifest: Manifest) -> Manifest:
        """``manifest`` with this drafter's config stored and its name among the companions."""
        config = dict(manifest.config)
        config[COMPANION_CONFIGS] = {**(config.get(COMPANION_CONFIGS) or {}), self.name: self.raw_config}
        companions = tuple(dict.fromkeys([*manifest.companions, self.name]))
        return attrs.evolve(manifest, config=config, companions=companions)

    def entries(self) -> list[TensorEntry]:
        """One entry per drafter tensor, named ``<companion>.<name>``, reading a view of its mapped shard."""
        return [
            TensorEntry(f"{self.name}.{name}", info.dtype, info.shape, lambda s=shard, i=info: self._view(s, i))
            for name, (shard, info) in self._located.items()
        ]

    def _view(self, shard: Any, info: TensorInfo) -> Any:
        mapped = self._mapped.get(shard.path)
        if mapped is None:
            mapped = self._mapped[shard.path] = shard.map()
        return mapped.view(info)

    def close(self) -> None:
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()
