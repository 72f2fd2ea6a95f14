"""Opening what ``ninfer serve`` is given: a ``.ninfer`` file or a Hugging Face checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path

from ninfer.core.artifact.container import Artifact, ModelSource
from ninfer.core.artifact.hf_directory import open_hf_directory
from ninfer.core.plugins import Registries


def open_model_source(path: str | os.PathLike[str], registries: Registries | None = None) -> ModelSource:
    """Open a .ninfer file, or a Hugging Face checkpoint directory seen through its family's layout."""
    path = Path(path)
    if path.is_dir():
        return open_hf_directory(path, registries=registries)
    return Artifact.open(path)
