"""Copies between host and device that do not wait for the device's queued work."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device's queued work: on CUDA through pinned memory and
    an asynchronous copy (a pageable source may make the copy wait for the stream)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A device tensor copied to pinned host memory behind the work queued so far, without waiting for it; ``wait``
    blocks only until that copy is done (a host tensor is taken as is)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def wait(self) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._host
