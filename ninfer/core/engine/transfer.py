"""Host-to-device copies that do not wait for the device."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device's queued work: on CUDA through pinned memory and
    an asynchronous copy (a pageable source may make the copy wait for the stream)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
