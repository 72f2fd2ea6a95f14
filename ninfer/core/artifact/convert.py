"""Convert a Hugging Face checkpoint directory into one .ninfer artifact (``ninfer convert``).

The checkpoint is validated completely before anything is written: its files, its architecture (a
registered model family must recognize it) and every tensor against the family's
``expected_weights(config)``. Tensors are those of the checkpoint view, so a family's ``checkpoint_layout``
applies (per-expert MoE tensors arrive fused). They then stream shard by shard, one at a time, into the
artifact with their Hugging Face names: a stored tensor is written straight from its mapped shard (no copy)
with one shard mapped at a time, and a fused tensor is built (a copy) from its sources, so memory stays
bounded by one (fused) tensor.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ninfer.core.artifact.container import MappedSafetensors, TensorEntry, TensorInfo, write_artifact
from ninfer.core.artifact.hf_directory import (
    CONFIG_FILE,
    FusedTensor,
    HFDirectoryArtifact,
    ShardFile,
    open_hf_directory,
)
from ninfer.core.artifact.quantize import quantized_entries, quantized_manifest
from ninfer.core.artifact.quantized import logical_shapes, quantized_formats
from ninfer.core.errors import ArtifactError, ConfigError, WeightMismatchError
from ninfer.core.plugins import Registries, given_or_process

#: Tensors a family need not expect that are carried into the artifact as they are.
CARRIED_PREFIXES = ("model.visual.", "mtp.")
#: How many offending tensor names one error message lists per kind of problem.
_NAMES_SHOWN = 8

Progress = Callable[[int, int], None]


def convert_checkpoint(
    hf_dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    model_id: str | None = None,
    progress: Progress | None = None,
    drafters: Mapping[str, str | os.PathLike[str]] | None = None,
    quantize: str | None = None,
    registries: Registries | None = None,
) -> Path:
    """Validate the checkpoint in ``hf_dir``, then write it to ``out_path`` as a .ninfer file; returns the path.

    ``progress(done_bytes, total_bytes)`` is called as tensor data is written. ``drafters`` maps a speculative
    backend name (``"dflash"``, ``"dflash2"``) to a published drafter directory that the backend's
    ``open_companion`` reads; its tensors and config are carried along (``dflash.*`` / ``dflash2.*``).
    ``quantize`` (``"fp8"``, ``"nvfp4"``) encodes the family's ``quantizable_weights`` of a dense checkpoint on the
    way (``ninfer.core.artifact.quantize``); a quantized checkpoint's tensors are written as they are stored.
    """
    registries = given_or_process(registries)
    out = Path(out_path)
    opened: list[Any] = []
    with open_hf_directory(hf_dir, model_id=model_id, registries=registries) as checkpoint:
        try:
            _check_output_path(out, checkpoint)
            check_weights(checkpoint, registries)
            manifest = checkpoint.manifest
            if quantize is not None:
                targets = registries.family_for(manifest).require("quantizable_weights")(manifest.config)
                shapes = {name: checkpoint.tensor_info(name).shape for name in targets}
                manifest, fmt = quantized_manifest(manifest, quantize, shapes, targets)
            for name, path in (drafters or {}).items():
                drafter = registries.speculative_backend(name).require_companion()(path)
                opened.append(drafter)
                drafter.check_target(manifest)
                manifest = drafter.manifest_with_companion(manifest)
            resources = {name: checkpoint.resource(name) for name in checkpoint.resource_names}
            stream = _ShardStream(checkpoint, progress)
            entries = stream.entries()
            if quantize is not None:
                entries = quantized_entries(entries, targets, fmt)
            entries += [entry for drafter in opened for entry in drafter.entries()]
            try:
                write_artifact(out, manifest, entries, resources)
            except OSError as exc:
                raise ArtifactError(f"{out}: cannot write the artifact ({exc.strerror or exc})") from None
            finally:
                stream.close()
            stream.finish()
        finally:
            for drafter in opened:
                drafter.close()
    return out


def check_weights(checkpoint: HFDirectoryArtifact, registries: Registries | None = None) -> None:
    """Fail with WeightMismatchError unless the checkpoint holds exactly the tensors its family expects.

    Tensors under :data:`CARRIED_PREFIXES` may be present without being expected; a quantized weight counts with its
    dense shape and its scales as part of it.
    """
    manifest = checkpoint.manifest
    family = given_or_process(registries).family_for(manifest)
    try:
        expected = family.require("expected_weights")(manifest.config)
    except WeightMismatchError:
        raise
    except ArtifactError as exc:
        raise ArtifactError(f"{checkpoint.path / CONFIG_FILE}: {exc.message}") from None
    infos = {name: checkpoint.tensor_info(name) for name in checkpoint.tensor_names}
    problems = _weight_problems(expected, logical_shapes(infos, quantized_formats(manifest)))
    if problems:
        raise WeightMismatchError(
            f"{checkpoint.path}: the checkpoint does not match {manifest.architecture} "
            f"(model family {family.name!r}): " + "; ".join(problems)
        )


def _weight_problems(expected: Mapping[str, tuple[int, ...]], found: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Missing, mis-shaped and unexpected tensors; ``found`` holds the shapes as the model sees them (a quantized
    weight's dense shape, its scales left out)."""
    missing = [name for name in expected if name not in found]
    misshaped = [
        f"{name} has shape {list(found[name])}, expected {list(expected[name])}"
        for name in expected
        if name in found and tuple(found[name]) != tuple(expected[name])
    ]
    unexpected = [name for name in found if name not in expected and not name.startswith(CARRIED_PREFIXES)]
    problems = []
    for label, items in (
        ("missing tensor", missing),
        ("mis-shaped tensor", misshaped),
        ("unexpected tensor", unexpected),
    ):
        if items:
            shown = ", ".join(items[:_NAMES_SHOWN])
            more = f" and {len(items) - _NAMES_SHOWN} more" if len(items) > _NAMES_SHOWN else ""
            problems.append(f"{len(items)} {label}{'s' if len(items) > 1 else ''}: {shown}{more}")
    return problems


def _check_output_path(out: Path, checkpoint: HFDirectoryArtifact) -> None:
    if out.is_dir():
        raise ConfigError(f"{out}: is a directory; give the path of the .ninfer file to write")
    if not out.parent.is_dir():
        raise ConfigError(f"{out}: the output directory {out.parent} does not exist")
    inputs = {shard.path.resolve() for shard in checkpoint.shards}
    if out.resolve() in inputs:
        raise ConfigError(f"{out}: would overwrite a shard of the checkpoint being converted")


class _ShardStream:
    """Tensor entries that read from one mapped shard at a time; moving on lets go of the previous mapping.

    A fused tensor reads its sources in storage order (shard by shard), so each shard is mapped once for it.
    """

    def __init__(self, checkpoint: HFDirectoryArtifact, progress: Progress | None) -> None:
        self._checkpoint = checkpoint
        self._progress = progress
        self._total = sum(checkpoint.tensor_info(name).nbytes for name in checkpoint.tensor_names)
        self._done = 0
        self._shard_position = {shard.path: index for index, shard in enumerate(checkpoint.shards)}
        self._shard: ShardFile | None = None
        self._mapped: MappedSafetensors | None = None

    def entries(self) -> list[TensorEntry]:
        entries = []
        for name in self._checkpoint.tensor_names:
            fused = self._checkpoint.layout.get(name)
            if fused is None:
                shard, info = self._checkpoint.locate(name)
                entries.append(
                    TensorEntry(name, info.dtype, info.shape, lambda shard=shard, info=info: self._load(shard, info))
                )
            else:
                entries.append(
                    TensorEntry(name, fused.dtype, fused.shape, lambda n=name, f=fused: self._load_fused(n, f))
                )
        return entries

    def _load(self, shard: ShardFile, info: TensorInfo) -> torch.Tensor:
        self._advance(info.nbytes)
        return self._view(shard, info)

    def _load_fused(self, name: str, fused: FusedTensor) -> torch.Tensor:
        self._advance(fused.nbytes)
        located = {source: self._checkpoint.locate(source) for source in fused.sources}
        in_storage_order = sorted(
            fused.sources, key=lambda source: (self._shard_position[located[source][0].path], located[source][1].begin)
        )
        parts = {source: self._view(*located[source]) for source in in_storage_order}
        return fused.build(name, [parts[source] for source in fused.sources])

    def _view(self, shard: ShardFile, info: TensorInfo) -> torch.Tensor:
        mapped = self._mapped
        if shard is not self._shard or mapped is None:
            self.close()
            mapped = shard.map()
            self._shard, self._mapped = shard, mapped
        return mapped.view(info)

    def _advance(self, nbytes: int) -> None:
        if self._progress is not None:
            self._progress(self._done, self._total)
        self._done += nbytes

    def finish(self) -> None:
        if self._progress is not None:
            self._progress(self._total, self._total)

    def close(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
        self._shard, self._mapped = None, None
