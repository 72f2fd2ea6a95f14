"""A decode step's device-side inputs, each in one launch: two between CUDA graph replays, one inside the graph.

* ``stop_update_mask``: which rows' recurrent state takes the token it is fed (``ForwardBatch.state_update_mask``):
  the row feeds it and the sampled id is none of its stop ids. Twin: ``table[:, 0].bool() & ~(ids[:, None] ==
  table[:, 1:]).any(1)`` (five launches).
* ``stage_inputs``: the step's input buffer from the copy of its host-staged fields, with the sampled ids (still
  on the device) in place of the token ids and the state slots of the rows that must not take the step turned
  into ``-1 - slot``. Twin: ``target.copy_(source)``, ``token_ids.copy_(ids)`` and ``slots.copy_(torch.where(mask,
  slots, -1 - slots))`` (five launches).
* ``decode_prologue``: the first launch of a decode step, from its staged input buffer: each row's embedding, the KV
  slot of its new token and its length with that token. Twin: ``F.embedding(token_ids, embed)``,
  ``page_tables.gather(1, (context // page_size)[:, None]).squeeze(1) * page_size + context % page_size`` and
  ``context + 1`` (seven launches, ~1.5 µs each in a graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton import next_power_of_2
from ninfer.kernels.triton.norm_gemv import pdl_supported, release_dependents


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


@triton.jit
def _decode_prologue_kernel(
    token_ids_ptr, context_ptr, page_tables_ptr, table_stride, embed_ptr, hidden_ptr, slots_ptr, total_ptr,
    page_size, hidden, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    release_dependents(PDL)  # the step's first layer (launched as a dependent) loads its weights while this runs
    row = tl.program_id(0).to(tl.int64)
    context = tl.load(context_ptr + row)
    page = tl.load(page_tables_ptr + row * table_stride + context // page_size)
    tl.store(slots_ptr + row, page * page_size + context % page_size)
    tl.store(total_ptr + row, context + 1)
    token = tl.load(token_ids_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    inside = cols < hidden
    tl.store(hidden_ptr + row * hidden + cols, tl.load(embed_ptr + token * hidden + cols, mask=inside), mask=inside)


def decode_prologue(
    token_ids: torch.Tensor, context_lens: torch.Tensor, page_tables: torch.Tensor, embed: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [R, H], slot_mapping [R], total_lens [R])`` of a decode step feeding token ``token_ids[r]`` to each
    row ``r`` after its ``context_lens[r]`` cached tokens: the token's embedding (a row of ``embed [V, H]``), the
    KV slot it is written to (through ``page_tables [R, W]``, ``page_size`` tokens a page) and the row's length with
    it. Integer inputs on ``embed``'s device; the slots and lengths come out in ``context_lens``'s dtype. One launch,
    which lets a dependent launch (the step's first layer) start at once on sm_90+."""
    rows = token_ids.shape[0]
    if context_lens.shape != (rows,) or page_tables.dim() != 2 or page_tables.shape[0] != rows:
        raise ValueError(
            f"context_lens [R] and page_tables [R, W] must match token_ids [{rows}]; got "
            f"{tuple(context_lens.shape)} and {tuple(page_tables.shape)}"
        )
    if embed.dim() != 2 or not embed.is_contiguous() or page_tables.stride(1) != 1:
        raise ValueError("embed must be a contiguous [V, H] table and page_tables rows contiguous")
    if any(t.device != embed.device for t in (token_ids, context_lens, page_tables)):
        raise ValueError(f"token_ids, context_lens and page_tables must be on the embedding's device ({embed.device})")
    width = embed.shape[1]
    hidden = torch.empty((rows, width), dtype=embed.dtype, device=embed.device)
    slots = torch.empty_like(context_lens)
    total = torch.empty_like(context_lens)
    if rows:
        block = next_power_of_2(width)
        _decode_prologue_kernel[(rows,)](
            token_ids, context_lens, page_tables, page_tables.stride(0), embed, hidden, slots, total, page_size,
            width, BLOCK_H=block, PDL=pdl_supported(embed.device), num_warps=4 if block <= 4096 else 8,
        )
    return hidden, slots, total
