"""ninfer: a plugin-driven LLM inference server for hybrid Gated-DeltaNet Qwen models."""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("ninfer")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+source"

__all__ = ["__version__"]
