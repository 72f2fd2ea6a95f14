"""A decode step's device-resident inputs staged in one launch: the token ids the previous step sampled (still on
the device) copied into the step's input buffer, and the state slots of the rows whose recurrent state must not
take this step turned into ``-1 - slot`` (``ForwardBatch.state_update_mask``), instead of a copy and three
elementwise launches between two CUDA graph replays.

Twin: ``token_ids.copy_(ids)`` and ``slots.copy_(torch.where(mask, slots, -1 - slots))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton import next_power_of_2


@triton.jit
def _stage_rows_kernel(
    ids_ptr, mask_ptr, token_ids_ptr, slots_ptr, tokens, rows,
    HAS_IDS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.arange(0, BLOCK)
    if HAS_IDS:
        tl.store(token_ids_ptr + i, tl.load(ids_ptr + i, mask=i < tokens).to(tl.int64), mask=i < tokens)
    if HAS_MASK:
        row = i < rows
        slot = tl.load(slots_ptr + i, mask=row, other=0)
        keep = tl.load(mask_ptr + i, mask=row, other=0) != 0
        tl.store(slots_ptr + i, tl.where(keep, slot, -1 - slot), mask=row)


def stage_rows(
    ids: torch.Tensor | None, mask: torch.Tensor | None, token_ids: torch.Tensor, slots: torch.Tensor
) -> None:
    """Copy ``ids [T]`` into ``token_ids`` (int64) and, where ``mask [R]`` (bool) is false, set ``slots [R]``
    (int64, in place) to ``-1 - slot``; either part may be left out. All on one device, contiguous."""
    tensors = [t for t in (ids, mask, token_ids, slots) if t is not None]
    if any(t.device != token_ids.device or not t.is_contiguous() for t in tensors):
        raise ValueError("ids, mask, token_ids and slots must be contiguous tensors on one device")
    if token_ids.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError("token_ids and slots must be int64")
    if ids is not None and ids.shape != token_ids.shape:
        raise ValueError(f"ids must be {tuple(token_ids.shape)}; got {tuple(ids.shape)}")
    if mask is not None and (mask.dtype != torch.bool or mask.shape != slots.shape):
        raise ValueError(f"mask must be a bool {tuple(slots.shape)}; got {mask.dtype} {tuple(mask.shape)}")
    if ids is None and mask is None:
        return
    _stage_rows_kernel[(1,)](
        token_ids if ids is None else ids, slots if mask is None else mask, token_ids, slots,
        token_ids.numel(), slots.numel(), HAS_IDS=ids is not None, HAS_MASK=mask is not None,
        BLOCK=max(16, next_power_of_2(max(token_ids.numel(), slots.numel()))), num_warps=1,
    )
