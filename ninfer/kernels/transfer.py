"""Copies between host and device that do not wait for the device's queued work.

On CUDA each direction has its own copy stream (``copy_stream``), so a copy neither sits in the compute stream's
queue between two kernels (where every copy-engine hand-over idles the device for microseconds between decode
graph replays) nor waits behind a copy of the other direction: a host-to-device copy runs as
soon as it is issued and the compute stream waits only for its completion; a device-to-host copy waits only for
the work queued before it.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def copy_stream(device: torch.device, to_host: bool) -> torch.cuda.Stream:
    """The side stream of ``device`` (CUDA) for copies to the host (``to_host``) or to the device."""
    return torch.cuda.Stream(device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device's queued work: on CUDA through pinned memory and
    an asynchronous copy on the device's inbound copy stream, which the current stream waits for."""
    if device.type != "cuda":
        return tensor.to(device)
    device = torch.device(device.type, torch.cuda.current_device() if device.index is None else device.index)
    stream, compute = copy_stream(device, to_host=False), torch.cuda.current_stream(device)
    source = tensor.pin_memory()
    with torch.cuda.stream(stream):  # allocated and written in the copy stream's order
        copied = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        copied.copy_(source, non_blocking=True)
    compute.wait_stream(stream)
    copied.record_stream(compute)  # its memory is reused only after the compute stream's work on it
    return copied


class HostCopy:
    """A device tensor copied to pinned host memory behind the work queued so far, without waiting for it; ``wait``
    blocks only until that copy is done (a host tensor is taken as is). On CUDA the copy runs on the outbound copy
    stream, so the work queued after it does not wait for it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":
            self._host = tensor
            return
        stream = copy_stream(tensor.device, to_host=True)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor's producer
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            self._host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # not reused before the copy has read it
        self._done = torch.cuda.Event()
        self._done.record(stream)

    def wait(self) -> torch.Tensor:
        if self._done is not None:
            self._done.synchronize()
        return self._host
