"""Random-weight models of named real configurations (``ninfer serve --synthetic PRESET``), offered by model families.

A family that declares ``synthetic_presets`` / ``synthetic_source`` (:class:`~ninfer.core.descriptors.ModelFamily`)
names its presets and builds a :class:`~ninfer.core.artifact.container.ModelSource` of one: weights drawn on the load
device in the load dtype, the family's real tokenizer and chat template as resources. The source then goes through
the ordinary loader, engine and frontend, so a server measured on it behaves like one serving a checkpoint.
This module only looks presets up; it never imports a family (and stays free of torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ninfer.core.errors import ConfigError, PluginError

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.artifact.container import ModelSource
    from ninfer.core.descriptors import ModelFamily
    from ninfer.core.plugins import Registries
    from ninfer.core.runtime import LoadOptions

#: The pseudo-registry that names the ``--synthetic`` choices (read lazily, like the real registry tables).
SYNTHETIC_PRESETS = "synthetic_presets"
#: The model id a synthetic preset is served under: ``synthetic-<preset>``.
MODEL_ID_PREFIX = "synthetic-"


def synthetic_presets(registries: Registries) -> dict[str, ModelFamily]:
    """Every preset any registered family offers, in registration order: preset name -> its family.

    A preset offered by two families is a :class:`PluginError` naming both.
    """
    presets: dict[str, ModelFamily] = {}
    for family in registries.model_families.values():
        if family.synthetic_presets is None:
            continue
        for name in family.synthetic_presets():
            if name in presets:
                raise PluginError(
                    f"synthetic preset {name!r} is offered twice: by model family {presets[name].name!r} and by "
                    f"model family {family.name!r}"
                )
            presets[name] = family
    return presets


def synthetic_family(preset: str, registries: Registries) -> ModelFamily:
    """The family offering ``preset``; an unknown name is a :class:`ConfigError` listing the choices."""
    presets = synthetic_presets(registries)
    family = presets.get(preset)
    if family is None:
        choices = ", ".join(presets) or "(no registered model family offers one)"
        raise ConfigError(f"--synthetic {preset!r} is not a synthetic preset; choose one of: {choices}",
                          param="synthetic")
    return family


def synthetic_model_id(preset: str) -> str:
    return MODEL_ID_PREFIX + preset


def open_synthetic_source(preset: str, registries: Registries, options: LoadOptions, *, seed: int = 0) -> ModelSource:
    """The random-weight model source of ``preset``, built by its family for ``options`` (device, dtype) from
    ``seed``. Its manifest names it ``synthetic-<preset>``."""
    family = synthetic_family(preset, registries)
    return family.require("synthetic_source")(preset, options, seed)
