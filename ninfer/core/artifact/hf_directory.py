"""A Hugging Face checkpoint directory read in place, with the same API as a .ninfer :class:`Artifact`.

Reads ``config.json``, the safetensors weights (``model.safetensors.index.json`` + shards, or one
``model.safetensors``), the tokenizer files, the chat template and ``generation_config.json``. Shard
headers are validated at open; shards are mapped lazily, on the first tensor read from each.

A model family may store some weights differently from how its runtime reads them (per-expert MoE tensors
where the runtime wants one stacked tensor). Its ``checkpoint_layout`` factory says which target tensors
are built from which stored ones (:class:`FusedTensor`); the view presents the targets and hides their
sources, so the converter and the runtime see one layout whatever the checkpoint stores.

A quantized checkpoint is presented in ninfer's quantized formats (``ninfer.core.artifact.hf_quantization``): its
tensors renamed where its convention names them otherwise, and the manifest's ``quantized`` naming every quantized
weight.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch

from ninfer.core.artifact.container import (
    CHAT_TEMPLATE_RESOURCE,
    TOKENIZER_RESOURCE,
    Identity,
    Manifest,
    MappedSafetensors,
    ModelSource,
    TensorInfo,
    read_safetensors_header,
)
from ninfer.core.artifact.hf_quantization import QuantizationPlan, plan_quantization
from ninfer.core.artifact.quantized import dense_dtype, quantization_summary
from ninfer.core.errors import ArtifactError, WeightMismatchError
from ninfer.core.plugins import Registries, given_or_process

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODELOPT_QUANT_CONFIG_FILE = "hf_quant_config.json"

TOKENIZER_CONFIG_RESOURCE = "tokenizer/tokenizer_config.json"
GENERATION_CONFIG_RESOURCE = "generation_config.json"

#: Bookkeeping keys of generation_config.json that are not generation defaults.
_GENERATION_BOOKKEEPING = frozenset({"transformers_version", "_from_model_config"})
#: How many missing source tensors one error message lists.
_NAMES_SHOWN = 8


@attrs.frozen
class FusedTensor:
    """One tensor built from several stored tensors, e.g. per-expert MoE weights stacked into one.

    ``combine`` receives the ``sources`` (in this order) and returns a new tensor of ``dtype`` and ``shape``.
    """

    sources: tuple[str, ...]
    combine: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = self.dtype.itemsize
        for dim in self.shape:
            count *= dim
        return count

    @property
    def info(self) -> TensorInfo:
        """Its dtype and shape; the offsets span its own buffer (a fused tensor lives in no file)."""
        return TensorInfo(self.dtype, self.shape, 0, self.nbytes)

    def build(self, name: str, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """``combine(parts)``, checked against the declared dtype and shape."""
        tensor = self.combine(parts)
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
            raise ArtifactError(
                f"fused tensor {name!r} came out {tensor.dtype} {list(tensor.shape)}, "
                f"declared {self.dtype} {list(self.shape)}"
            )
        return tensor


@attrs.frozen
class ShardFile:
    """One safetensors file of a checkpoint: its tensors (in data order) and where its data section starts."""

    path: Path
    tensors: Mapping[str, TensorInfo]
    data_start: int

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())

    def map(self) -> MappedSafetensors:
        try:
            return MappedSafetensors(self.path, self.data_start)
        except OSError as exc:
            raise ArtifactError(f"{self.path}: cannot read the shard ({exc.strerror or exc})") from None


class HFDirectoryArtifact(ModelSource):
    """A Hugging Face checkpoint directory served in place.

    Stored tensors are zero-copy views of the mapped shards. The targets of ``layout`` (name -> FusedTensor)
    are built on each read, as a copy; the stored tensors they are built from are hidden.
    """

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        shards: tuple[ShardFile, ...],
        resources: Mapping[str, Path | bytes],
        layout: Mapping[str, FusedTensor] | None = None,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.shards = shards
        self.layout: Mapping[str, FusedTensor] = dict(layout or {})
        self._resources = dict(resources)
        self._shard_of = {name: shard for shard in shards for name in shard.tensors}
        self._names = _presented_names(path, shards, self.layout, self._shard_of)
        self._hidden = frozenset(source for fused in self.layout.values() for source in fused.sources)
        self._mapped: dict[Path, MappedSafetensors] = {}
        self._closed = False

    # -- tensors -----------------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        """Weight tensor names, shard by shard in each shard's data order; a fused tensor where its first source is."""
        return list(self._names)

    def tensor_info(self, name: str) -> TensorInfo:
        fused = self.layout.get(name)
        if fused is not None:
            return fused.info
        return self._stored(name)[1]

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name``: a zero-copy CPU view of its mapped shard, or a fused tensor built anew (a copy)."""
        if self._closed:
            raise ArtifactError(f"{self.path}: read after the checkpoint was closed")
        fused = self.layout.get(name)
        if fused is not None:
            return fused.build(name, [self._view(*self.locate(source)) for source in fused.sources])
        return self._view(*self._stored(name))

    def locate(self, name: str) -> tuple[ShardFile, TensorInfo]:
        """Where the stored tensor ``name`` lies, fused sources included (for readers that map shards themselves)."""
        try:
            shard = self._shard_of[name]
        except KeyError:
            raise ArtifactError(f"{self.path}: no tensor named {name!r}") from None
        return shard, shard.tensors[name]

    def _stored(self, name: str) -> tuple[ShardFile, TensorInfo]:
        if name in self._hidden:
            raise ArtifactError(f"{self.path}: no tensor named {name!r} (it is read as part of a fused tensor)")
        return self.locate(name)

    def _view(self, shard: ShardFile, info: TensorInfo) -> torch.Tensor:
        mapped = self._mapped.get(shard.path)
        if mapped is None:
            mapped = self._mapped[shard.path] = shard.map()
        return mapped.view(info)

    # -- resources ---------------------------------------------------------------------------------

    @property
    def resource_names(self) -> list[str]:
        return list(self._resources)

    def resource(self, name: str) -> bytes:
        try:
            source = self._resources[name]
        except KeyError:
            raise ArtifactError(f"{self.path}: the checkpoint has no resource {name!r}") from None
        if isinstance(source, bytes):
            return source
        try:
            return source.read_bytes()
        except OSError as exc:
            raise ArtifactError(f"{source}: cannot read ({exc.strerror or exc})") from None

    def close(self) -> None:
        self._closed = True
        for mapped in self._mapped.values():
            mapped.close()
        self._mapped.clear()

    def __enter__(self) -> "HFDirectoryArtifact":
        return self


def open_hf_directory(
    path: str | os.PathLike[str], *, model_id: str | None = None, registries: Registries | None = None
) -> HFDirectoryArtifact:
    """Open a Hugging Face checkpoint directory; every problem is an ArtifactError naming the file at fault.
    ``registries`` supply the model family's checkpoint layout."""
    directory = Path(path)
    if not directory.is_dir():
        problem = "not a directory" if directory.exists() else "no such directory"
        raise ArtifactError(f"{directory}: {problem}; expected a Hugging Face checkpoint directory")
    config = _read_json_object(directory / CONFIG_FILE, what="the model config")
    architecture = _architecture(config, directory / CONFIG_FILE)
    shards = read_shards(directory)
    stored = {name: info for shard in shards for name, info in shard.tensors.items()}
    plan = plan_quantization(_quantization_config(directory, config), stored, directory / CONFIG_FILE)
    shards = tuple(attrs.evolve(s, tensors={plan.renames.get(n, n): i for n, i in s.tensors.items()}) for s in shards)
    generation_config = _read_optional_json(directory / GENERATION_CONFIG_FILE)
    resources = _resources(directory)
    manifest = Manifest(
        identity=Identity(model_id or directory.resolve().name.lower()),
        architecture=architecture,
        config=config,
        companions=("mtp",) if any(name.startswith("mtp.") for s in shards for name in s.tensors) else (),
        generation_defaults=_generation_defaults(generation_config, config),
    )
    layout = {**_family_layout(directory, manifest, shards, given_or_process(registries)), **_derived(plan, shards)}
    checkpoint = HFDirectoryArtifact(directory, manifest, shards, resources, layout)
    infos = {name: checkpoint.tensor_info(name) for name in checkpoint.tensor_names}
    formats = plan.formats(infos, str(directory))
    dtype = dense_dtype(infos, formats)
    if dtype is None:
        raise ArtifactError(f"{directory}: the checkpoint has no floating-point weight tensors")
    checkpoint.manifest = attrs.evolve(
        manifest,
        weight_format={"dtype": str(dtype).removeprefix("torch."), "quantization": quantization_summary(formats)},
        quantized={name: fmt.to_json() for name, fmt in formats.items()},
    )
    return checkpoint


# -- weights ---------------------------------------------------------------------------------------


def read_shards(directory: Path) -> tuple[ShardFile, ...]:
    """Every safetensors file of the checkpoint with its validated header, in file-name order."""
    index_path = directory / INDEX_FILE
    if index_path.exists():
        weight_map = _weight_map(index_path)
        file_names = sorted(set(weight_map.values()))
    elif (directory / SINGLE_WEIGHTS_FILE).exists():
        weight_map = None
        file_names = [SINGLE_WEIGHTS_FILE]
    else:
        legacy = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (found {', '.join(legacy)}: PyTorch .bin checkpoints are not supported)" if legacy else ""
        raise ArtifactError(f"{directory}: no {SINGLE_WEIGHTS_FILE} and no {INDEX_FILE}{hint}")
    shards: list[ShardFile] = []
    owner: dict[str, str] = {}
    for file_name in file_names:
        shard_path = directory / file_name
        if not shard_path.is_file():
            raise ArtifactError(f"{shard_path}: weight shard listed in {INDEX_FILE} does not exist")
        infos, _metadata, data_start = read_safetensors_header(shard_path)
        ordered = dict(sorted(infos.items(), key=lambda item: item[1].begin))
        for name in ordered:
            if name in owner:
                raise ArtifactError(f"{directory}: tensor {name!r} is stored twice, in {owner[name]} and {file_name}")
            owner[name] = file_name
        shards.append(ShardFile(shard_path, ordered, data_start))
    if weight_map is not None:
        for name, file_name in weight_map.items():
            if owner.get(name) != file_name:
                raise WeightMismatchError(
                    f"{directory / file_name}: tensor {name!r} is listed for this shard in {INDEX_FILE} "
                    "but the shard does not contain it",
                    param=name,
                )
    return tuple(shards)


def _family_layout(
    directory: Path, manifest: Manifest, shards: tuple[ShardFile, ...], registries: Registries
) -> dict[str, FusedTensor]:
    """The model family's ``checkpoint_layout`` for these tensors; none without a family that declares one.

    An unrecognized architecture is not an error here: whoever needs the family (convert, load) reports it.
    """
    try:
        family = registries.family_for(manifest)
    except ArtifactError:
        return {}
    if family.checkpoint_layout is None:
        return {}
    stored = {name: info for shard in shards for name, info in shard.tensors.items()}
    try:
        return dict(family.checkpoint_layout(manifest.config, stored))
    except WeightMismatchError as exc:
        raise WeightMismatchError(f"{directory}: {exc.message}", param=exc.param) from None
    except ArtifactError as exc:
        raise ArtifactError(f"{directory / CONFIG_FILE}: {exc.message}") from None


def _presented_names(
    directory: Path,
    shards: tuple[ShardFile, ...],
    layout: Mapping[str, FusedTensor],
    shard_of: Mapping[str, ShardFile],
) -> tuple[str, ...]:
    """Stored names in data order with each fused tensor in place of its sources; checks the layout is coherent."""
    target_of: dict[str, str] = {}
    for target, fused in layout.items():
        if target in shard_of:
            raise WeightMismatchError(
                f"{directory}: {target!r} is stored and also built from {len(fused.sources)} other tensors; "
                "the checkpoint holds both layouts",
                param=target,
            )
        if not fused.sources:
            raise ArtifactError(f"{directory}: the family's checkpoint layout builds {target!r} from no tensors")
        missing = [source for source in fused.sources if source not in shard_of]
        if missing:
            shown = ", ".join(missing[:_NAMES_SHOWN])
            more = f" and {len(missing) - _NAMES_SHOWN} more" if len(missing) > _NAMES_SHOWN else ""
            raise WeightMismatchError(
                f"{directory}: {target} is built from tensors the checkpoint lacks: "
                f"{len(missing)} missing tensor{'s' if len(missing) > 1 else ''}: {shown}{more}",
                param=missing[0],
            )
        for source in fused.sources:
            if source in target_of:
                raise ArtifactError(
                    f"{directory}: tensor {source!r} is claimed by both {target_of[source]} and {target}"
                )
            target_of[source] = target
    names: list[str] = []
    placed: set[str] = set()
    for shard in shards:
        for name in shard.tensors:
            target = target_of.get(name)
            if target is None:
                names.append(name)
            elif target not in placed:
                placed.add(target)
                names.append(target)
    return tuple(names)


def _weight_map(index_path: Path) -> dict[str, str]:
    index = _read_json_object(index_path, what="the weight index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ArtifactError(f"{index_path}: 'weight_map' must be an object mapping tensor names to shard files")
    for file_name in set(weight_map.values()):
        if Path(file_name).name != file_name:
            raise ArtifactError(f"{index_path}: shard {file_name!r} is not a file name inside the checkpoint directory")
    return weight_map


# -- config, generation defaults, resources ----------------------------------------------------------


def _architecture(config: Mapping[str, Any], config_path: Path) -> str:
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise ArtifactError(f"{config_path}: 'architectures' must be a non-empty list of class names")
    return architectures[0]


def _quantization_config(directory: Path, config: Mapping[str, Any]) -> Any:
    """``config.json``'s ``quantization_config``, else a ModelOpt ``hf_quant_config.json`` (None: not quantized)."""
    if "quantization_config" in config:
        return config["quantization_config"]
    modelopt = _read_optional_json(directory / MODELOPT_QUANT_CONFIG_FILE)
    return None if modelopt is None else {"quant_method": "modelopt", **modelopt}


def _derived(plan: QuantizationPlan, shards: tuple[ShardFile, ...]) -> dict[str, FusedTensor]:
    """The plan's computed tensors, each fp32 of its one stored source's shape."""
    stored = {name: info for shard in shards for name, info in shard.tensors.items()}
    return {
        target: FusedTensor((source,), lambda parts, f=transform: f(parts[0]), torch.float32, stored[source].shape)
        for target, (source, transform) in plan.derived.items()
    }


def _generation_defaults(generation_config: Mapping[str, Any] | None, config: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json's values, with ``eos_token_id`` turned into the list ``eos_token_ids``."""
    defaults = {k: v for k, v in (generation_config or {}).items() if k not in _GENERATION_BOOKKEEPING}
    eos = defaults.pop("eos_token_id", None)
    if eos is None:
        text_config = config.get("text_config")
        eos = (text_config if isinstance(text_config, dict) else {}).get("eos_token_id", config.get("eos_token_id"))
    if eos is not None:
        defaults["eos_token_ids"] = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    return defaults


def _resources(directory: Path) -> dict[str, Path | bytes]:
    tokenizer_path = directory / TOKENIZER_FILE
    if not tokenizer_path.is_file():
        raise ArtifactError(f"{tokenizer_path}: missing; the checkpoint needs a Hugging Face tokenizer.json")
    tokenizer_config_path = directory / TOKENIZER_CONFIG_FILE
    tokenizer_config = _read_optional_json(tokenizer_config_path)
    resources: dict[str, Path | bytes] = {CHAT_TEMPLATE_RESOURCE: _chat_template(directory, tokenizer_config)}
    resources[TOKENIZER_RESOURCE] = tokenizer_path
    if tokenizer_config is not None:
        resources[TOKENIZER_CONFIG_RESOURCE] = tokenizer_config_path
    if (directory / GENERATION_CONFIG_FILE).is_file():
        resources[GENERATION_CONFIG_RESOURCE] = directory / GENERATION_CONFIG_FILE
    return resources


def _chat_template(directory: Path, tokenizer_config: Mapping[str, Any] | None) -> Path | bytes:
    """chat_template.jinja, else tokenizer_config.json's ``chat_template``, else chat_template.json's."""
    jinja_path = directory / CHAT_TEMPLATE_FILE
    if jinja_path.is_file():
        return jinja_path
    if tokenizer_config is not None and tokenizer_config.get("chat_template") is not None:
        return _template_text(tokenizer_config["chat_template"], directory / TOKENIZER_CONFIG_FILE).encode("utf-8")
    legacy_path = directory / LEGACY_CHAT_TEMPLATE_FILE
    legacy = _read_optional_json(legacy_path)
    if legacy is not None and legacy.get("chat_template") is not None:
        return _template_text(legacy["chat_template"], legacy_path).encode("utf-8")
    raise ArtifactError(
        f"{directory}: no chat template: neither {CHAT_TEMPLATE_FILE} nor a 'chat_template' in {TOKENIZER_CONFIG_FILE}"
    )


def _template_text(value: Any, source_path: Path) -> str:
    """A chat template given as a string, or as the list of {name, template} whose "default" is taken."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(item, dict) for item in value):
        named = {item.get("name"): item.get("template") for item in value}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ArtifactError(
            f"{source_path}: 'chat_template' lists templates {sorted(map(str, named))} but none named 'default'"
        )
    raise ArtifactError(f"{source_path}: 'chat_template' must be a string or a list of {{name, template}} objects")


def _read_json_object(path: Path, *, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise ArtifactError(f"{path}: missing; a Hugging Face checkpoint directory needs {what} here")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: cannot read {what} as JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{path}: {what} must be a JSON object")
    return data


def _read_optional_json(path: Path) -> dict[str, Any] | None:
    return _read_json_object(path, what=path.name) if path.is_file() else None
