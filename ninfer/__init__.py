"""ninfer: a plugin-driven LLM inference server for hybrid Gated-DeltaNet Qwen models.

``from ninfer import LLM, SamplingParams`` gives the offline API; both are imported lazily so that
``import ninfer`` stays light.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from typing import Any

try:
    __version__ = _version("ninfer")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"

_LAZY = {"LLM": "ninfer.llm", "SamplingParams": "ninfer.core.request"}

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
