"""The embedded demo model: a tiny random-weight Qwen artifact generated deterministically on first use."""

from __future__ import annotations

import os
from pathlib import Path

from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact
from ninfer.core.plugins import Registries

DEMO_OPTIONS = TinyOptions(family="qwen3_5", mtp=True, template="qwen3_6", seed=0)


def cache_dir() -> Path:
    """``$NINFER_CACHE_DIR`` or ``~/.cache/ninfer``."""
    return Path(os.environ.get("NINFER_CACHE_DIR") or Path.home() / ".cache" / "ninfer")


def demo_artifact_path(registries: Registries) -> Path:
    """Path of the demo artifact, generating it into the cache directory the first time."""
    from ninfer import __version__

    path = cache_dir() / f"demo-{DEMO_OPTIONS.model_id}-{__version__}.ninfer"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tiny_artifact(path, DEMO_OPTIONS, registries)
    return path
