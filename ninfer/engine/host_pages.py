"""Host copies of KV pages, shared by the host checkpoints whose tokens they cover: blocks and segments.

A block holds the pages one store copied from the device, per cache per layer (keys and values, each
``[pages, ...]``); a segment references a run of a block's pages. A host checkpoint's KV is its segments in page
order, so checkpoints sharing a token prefix reference one copy of its pages. A block is counted, whole, from its
first reference to its last release: its bytes are freed only when no checkpoint references any of its pages.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import attrs
import torch

from ninfer.core.runtime import KVCache

Allocate = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@attrs.define(eq=False)
class HostBlock:
    """``kv[c]`` is cache c's ``(keys, values)`` per layer, each ``[num_pages, ...]``; ``refs``: checkpoints
    referencing any of its pages."""

    kv: list[tuple[list[torch.Tensor], list[torch.Tensor]]]
    num_pages: int
    nbytes: int
    refs: int = 0


@attrs.frozen
class Segment:
    """Pages ``start .. start + count - 1`` of ``block``."""

    block: HostBlock
    start: int
    count: int


def leading(segments: Sequence[Segment], pages: int) -> tuple[Segment, ...]:
    """The segments covering the first ``pages`` pages of ``segments`` (the last one cut to fit)."""
    kept: list[Segment] = []
    for segment in segments:
        if pages <= 0:
            break
        kept.append(attrs.evolve(segment, count=min(segment.count, pages)))
        pages -= segment.count
    return tuple(kept)


def _indices(pages: Sequence[int], caches: Sequence[KVCache]) -> dict[torch.device, torch.Tensor]:
    """``pages`` as an index tensor on each device the caches live on."""
    devices = {tensor.device for cache in caches for tensor in (*cache.key, *cache.value)}
    return {device: torch.tensor(list(pages), dtype=torch.long, device=device) for device in devices}


def copy_block(caches: Sequence[KVCache], pages: Sequence[int], extent: int, allocate: Allocate) -> HostBlock:
    """A new block holding device ``pages`` of every cache (``extent``: bytes of one page across them)."""
    index = _indices(pages, caches)

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        host = allocate((len(pages), *tensor.shape[1:]), tensor.dtype)
        host.copy_(tensor.index_select(0, index[tensor.device]))
        return host

    kv = [([copy(key) for key in cache.key], [copy(value) for value in cache.value]) for cache in caches]
    return HostBlock(kv, len(pages), len(pages) * extent)


def restore_pages(
    segments: Sequence[Segment], caches: Sequence[KVCache], pages: Sequence[int], non_blocking: bool
) -> None:
    """Copy the pages of ``segments``, in order, into device ``pages`` of ``caches``: one copy per segment per
    layer tensor."""
    index = _indices(pages, caches)
    offset = 0
    for segment in segments:
        end = segment.start + segment.count
        for cache, (keys, values) in zip(caches, segment.block.kv):
            for device, host in zip((*cache.key, *cache.value), (*keys, *values)):
                target = index[device.device][offset : offset + segment.count]
                device.index_copy_(0, target, host[segment.start : end].to(device.device, non_blocking=non_blocking))
        offset += segment.count


def blocks(segments: Iterable[Segment]) -> list[HostBlock]:
    """The distinct blocks ``segments`` reference."""
    return list(dict.fromkeys(segment.block for segment in segments))


class HostPages:
    """The bytes of the live blocks: a block's first reference counts it, its last release frees it."""

    def __init__(self) -> None:
        self.used_bytes = 0

    def acquire(self, segments: Iterable[Segment]) -> None:
        for block in blocks(segments):
            if block.refs == 0:
                self.used_bytes += block.nbytes
            block.refs += 1

    def release(self, segments: Iterable[Segment]) -> None:
        for block in blocks(segments):
            block.refs -= 1
            if block.refs == 0:
                self.used_bytes -= block.nbytes
