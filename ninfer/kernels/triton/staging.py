"""An overlapped decode step's device-side inputs, each in one launch between two CUDA graph replays.

* ``stop_update_mask``: which rows' recurrent state takes the token it is fed (``ForwardBatch.state_update_mask``):
  the row feeds it and the sampled id is none of its stop ids. Twin: ``table[:, 0].bool() & ~(ids[:, None] ==
  table[:, 1:]).any(1)`` (five launches).
* ``stage_inputs``: the step's input buffer from the copy of its host-staged fields, with the sampled ids (still
  on the device) in place of the token ids and the state slots of the rows that must not take the step turned
  into ``-1 - slot``. Twin: ``target.copy_(source)``, ``token_ids.copy_(ids)`` and ``slots.copy_(torch.where(mask,
  slots, -1 - slots))`` (five launches).
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
def _stage_inputs_kernel(
    source_ptr, target_ptr, ids_ptr, mask_ptr, size, tokens, slots_at, rows,
    HAS_IDS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < size
    value = tl.load(source_ptr + i, mask=inside, other=0)
    if HAS_IDS:
        is_token = i < tokens
        value = tl.where(is_token, tl.load(ids_ptr + i, mask=is_token & inside, other=0).to(tl.int64), value)
    if HAS_MASK:
        row = i - slots_at
        is_slot = (row >= 0) & (row < rows)
        keep = tl.load(mask_ptr + row, mask=is_slot & inside, other=1) != 0
        value = tl.where(keep, value, -1 - value)
    tl.store(target_ptr + i, value, mask=inside)


def stage_inputs(
    source: torch.Tensor, target: torch.Tensor, ids: torch.Tensor | None, mask: torch.Tensor | None, slots_at: int
) -> None:
    """``target = source`` (int64 buffers of one size) with its first ``len(ids)`` elements taken from ``ids``
    (the sampled token ids) and, where ``mask [R]`` (bool) is false, the slot ``source[slots_at + r]`` stored as
    ``-1 - slot``; either part may be left out. All on one device, contiguous."""
    tensors = [t for t in (source, target, ids, mask) if t is not None]
    if any(t.device != target.device or not t.is_contiguous() for t in tensors):
        raise ValueError("source, target, ids and mask must be contiguous tensors on one device")
    if source.dtype != torch.int64 or target.dtype != torch.int64 or source.shape != target.shape:
        raise ValueError(
            f"source and target must be int64 of one shape; got {tuple(source.shape)}, {tuple(target.shape)}"
        )
    if ids is not None and ids.numel() > target.numel():
        raise ValueError(f"ids ({ids.numel()}) do not fit the buffer ({target.numel()})")
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 1 or slots_at + mask.numel() > target.numel()):
        raise ValueError(f"mask must be a bool [R] of slots within the buffer; got {mask.dtype} {tuple(mask.shape)}")
    size = target.numel()
    block = min(1024, max(16, next_power_of_2(size)))
    _stage_inputs_kernel[(triton.cdiv(size, block),)](
        source, target, target if ids is None else ids, target if mask is None else mask, size,
        0 if ids is None else ids.numel(), slots_at, 0 if mask is None else mask.numel(),
        HAS_IDS=ids is not None, HAS_MASK=mask is not None, BLOCK=block, num_warps=1 if block <= 128 else 4,
    )
