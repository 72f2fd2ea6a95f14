"""One launch that copies row ``i`` of many source tensors to row ``j`` of their destinations.

A speculative round rolls a row's recurrent state back by copying, for every Gated-DeltaNet layer, the conv window and
SSM state captured after its last accepted token into the row's state slot: two tensors per layer, so 96 small copies
at 27B. :class:`RowCopy` reads the tensors' base addresses and row strides from one device table (built once per set
of tensors) and copies every pair's row in a single kernel launch, in 4-, 2- or 1-byte words (the widest that divides
every address, stride and row size).

Twin: ``dst[j].copy_(src[i])`` for each pair.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 4096  # words per program


@triton.jit(do_not_specialize=["src_row", "dst_row"])  # one compiled kernel for every row and slot
def _copy_rows_kernel(table_ptr, count, src_row, dst_row, WORD: tl.constexpr, BLOCK: tl.constexpr):
    pair = tl.program_id(0)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    # table rows: source address, destination address, source row stride, destination row stride, row size (words)
    src_address = tl.load(table_ptr + pair)
    dst_address = tl.load(table_ptr + count + pair)
    src_stride = tl.load(table_ptr + 2 * count + pair)
    dst_stride = tl.load(table_ptr + 3 * count + pair)
    words = tl.load(table_ptr + 4 * count + pair)
    if WORD == 4:
        src = src_address.to(tl.pointer_type(tl.int32))
        dst = dst_address.to(tl.pointer_type(tl.int32))
    elif WORD == 2:
        src = src_address.to(tl.pointer_type(tl.int16))
        dst = dst_address.to(tl.pointer_type(tl.int16))
    else:
        src = src_address.to(tl.pointer_type(tl.int8))
        dst = dst_address.to(tl.pointer_type(tl.int8))
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < words
    values = tl.load(src + src_row * src_stride + offsets, mask=mask)
    tl.store(dst + dst_row * dst_stride + offsets, values, mask=mask)


class RowCopy:
    """Copies row ``i`` of each ``sources[n]`` to row ``j`` of ``destinations[n]`` in one launch (:meth:`__call__`).

    Each pair has the same dtype and row shape (``shape[1:]``), and the rows (``t[i]``) are contiguous. The tensors
    are referenced by address: use this object only while they are alive, and only with rows inside them.
    """

    def __init__(self, sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor]) -> None:
        if len(sources) != len(destinations) or not sources:
            raise ValueError(
                f"need as many sources as destinations (and some); got {len(sources)}, {len(destinations)}"
            )
        device = destinations[0].device
        for src, dst in zip(sources, destinations):
            if src.dtype != dst.dtype or src.shape[1:] != dst.shape[1:] or src.device != device or dst.device != device:
                raise ValueError(
                    f"source {src.dtype} {tuple(src.shape)} on {src.device} does not match destination {dst.dtype} "
                    f"{tuple(dst.shape)} on {dst.device}"
                )
            if not (src[0].is_contiguous() and dst[0].is_contiguous()):
                raise ValueError("every source and destination row must be contiguous")
        tensors = (*sources, *destinations)
        row_bytes = [src[0].numel() * src.element_size() for src in sources]
        addresses = [t.data_ptr() for t in tensors]
        stride_bytes = [t.stride(0) * t.element_size() for t in tensors]
        self.word = next(w for w in (4, 2, 1) if all(v % w == 0 for v in (*row_bytes, *addresses, *stride_bytes)))
        self.count = len(sources)
        table = torch.tensor(
            [*addresses, *(v // self.word for v in stride_bytes), *(v // self.word for v in row_bytes)],
            dtype=torch.int64,
        )  # rows: source addresses, destination addresses, source strides, destination strides, row sizes
        self.chunks = triton.cdiv(max(row_bytes) // self.word, BLOCK)
        self.table = table.to(device) if device.type != "cuda" else table.pin_memory().to(device, non_blocking=True)

    def __call__(self, src_row: int, dst_row: int) -> None:
        """``destinations[n][dst_row] = sources[n][src_row]`` for every n, one launch, no host sync."""
        if src_row < 0 or dst_row < 0:
            raise IndexError(f"rows must be non-negative; got {src_row} -> {dst_row}")
        _copy_rows_kernel[(self.count, self.chunks)](
            self.table, self.count, src_row, dst_row, WORD=self.word, BLOCK=BLOCK, num_warps=4
        )

