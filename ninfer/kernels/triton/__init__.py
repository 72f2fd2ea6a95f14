"""Triton kernels for the CUDA decode path; each has a pure-torch twin in ``ninfer.kernels.reference`` as its oracle.

Nothing here imports triton at package import time: CPU-only installs import ``ninfer.kernels.triton`` freely and
ask ``triton_available()`` before touching a submodule (each submodule imports triton itself).
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_importable() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, used by tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether the Triton kernels can run on ``device`` (default: the current CUDA device)."""
    if not triton_importable():
        return False
    device_type = torch.device(device).type if device is not None else "cuda"
    if device_type == "cuda":
        return torch.cuda.is_available()
    return device_type == "cpu" and interpreting()


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
