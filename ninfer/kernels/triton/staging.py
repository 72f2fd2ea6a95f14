"""An overlapped decode step's device-side inputs, each in one launch between two CUDA graph replays.

* ``stop_update_mask``: which rows' recurrent state takes the token it is fed (``ForwardBatch.state_update_mask``):
  the row feeds it and the sampled id is none of its stop ids. Twin: ``table[:, 0].bool() & ~(ids[:, None] ==
  table[:, 1:]).any(1)`` (five launches).
* ``stage_rows``: the sampled ids (still on the device) copied into the step's input buffer, and the state slots of
  the rows that must not take the step turned into ``-1 - slot``. Twin: ``token_ids.copy_(ids)`` and
  ``slots.copy_(torch.where(mask, slots, -1 - slots))`` (four launches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton import next_power_of_2


@triton.jit
def _stop_update_mask_kernel(ids_ptr, table_ptr, out_ptr, rows, width, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_W)
    row = r < rows
    ids = tl.load(ids_ptr + r, mask=row, other=-1)
    feeds = tl.load(table_ptr + r * width, mask=row, other=0) != 0
    stop_mask = row[:, None] & (c < width - 1)[None, :]
    stops = tl.load(table_ptr + r[:, None] * width + 1 + c[None, :], mask=stop_mask, other=-1)
    stopped = tl.max((stops == ids[:, None]).to(tl.int32), axis=1) > 0
    tl.store(out_ptr + r, feeds & ~stopped, mask=row)


def stop_update_mask(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Bool ``[R]``: row ``r`` feeds its token (``table[r, 0] != 0``) and ``ids[r]`` is none of its stop ids
    (``table[r, 1:]``, padded with -1). ``ids [R]`` and ``table [R, 1 + W]`` contiguous, of one dtype and device."""
    if table.dim() != 2 or ids.shape != table.shape[:1] or table.shape[1] < 1:
        raise ValueError(f"table must be [R, 1 + W] for ids [R]; got {tuple(table.shape)} and {tuple(ids.shape)}")
    if ids.dtype != table.dtype or ids.device != table.device or not (ids.is_contiguous() and table.is_contiguous()):
        raise ValueError("ids and table must be contiguous, of one dtype and on one device")
    rows, width = table.shape
    out = torch.empty(rows, dtype=torch.bool, device=ids.device)
    if rows:
        _stop_update_mask_kernel[(1,)](
            ids, table, out, rows, width, BLOCK_R=max(2, next_power_of_2(rows)),
            BLOCK_W=max(2, next_power_of_2(width - 1)), num_warps=1,
        )
    return out


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
