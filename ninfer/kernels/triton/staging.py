"""A decode step's device-side inputs in two launches: one between CUDA graph replays, one inside the graph.

* ``stage_inputs``: the step's input buffer from the copy of its host-staged fields, with the sampled ids (still
  on the device) in place of the token ids and the state slots of the rows whose state must not take the token
  they are fed (``ForwardBatch.state_update_stops``: the row does not feed it, or it is one of the row's stop ids)
  turned into ``-1 - slot``. Twin: ``target.copy_(source)``, ``token_ids.copy_(ids)`` and
  ``slots.copy_(torch.where(state_update_mask(token_ids, stops), slots, -1 - slots))`` (ten launches).
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
def _stage_inputs_kernel(
    source_ptr, target_ptr, ids_ptr, stops_ptr, size, tokens, slots_at, rows, stop_width,
    HAS_IDS: tl.constexpr, HAS_STOPS: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < size
    value = tl.load(source_ptr + i, mask=inside, other=0)
    if HAS_IDS:
        is_token = i < tokens
        value = tl.where(is_token, tl.load(ids_ptr + i, mask=is_token & inside, other=0).to(tl.int64), value)
    if HAS_STOPS:  # one token per row: row r's token is element r
        row = i - slots_at
        is_slot = (row >= 0) & (row < rows) & inside
        if HAS_IDS:
            token = tl.load(ids_ptr + row, mask=is_slot, other=0).to(tl.int64)
        else:
            token = tl.load(source_ptr + row, mask=is_slot, other=0)
        stops = stops_ptr + row * stop_width
        keep = tl.load(stops, mask=is_slot, other=1) != 0
        for column in range(1, stop_width):
            keep = keep & (tl.load(stops + column, mask=is_slot, other=-1) != token)
        value = tl.where(keep, value, -1 - value)
    tl.store(target_ptr + i, value, mask=inside)


def stage_inputs(
    source: torch.Tensor, target: torch.Tensor, ids: torch.Tensor | None, stops: torch.Tensor | None, slots_at: int
) -> None:
    """``target = source`` (int64 buffers of one size) with its first ``len(ids)`` elements taken from ``ids``
    (the sampled token ids) and the slot ``source[slots_at + r]`` of each row ``r`` of ``stops [R, 1 + W]`` (int64,
    ``ForwardBatch.state_update_stops``: row ``r`` feeds token ``r``) whose state must not take its token stored as
    ``-1 - slot``; either part may be left out. All on one device, contiguous."""
    tensors = [t for t in (source, target, ids, stops) if t is not None]
    if any(t.device != target.device or not t.is_contiguous() for t in tensors):
        raise ValueError("source, target, ids and stops must be contiguous tensors on one device")
    if source.dtype != torch.int64 or target.dtype != torch.int64 or source.shape != target.shape:
        raise ValueError(
            f"source and target must be int64 of one shape; got {tuple(source.shape)}, {tuple(target.shape)}"
        )
    if ids is not None and ids.numel() > target.numel():
        raise ValueError(f"ids ({ids.numel()}) do not fit the buffer ({target.numel()})")
    if stops is not None and (
        stops.dtype != torch.int64 or stops.dim() != 2 or stops.shape[1] < 1
        or slots_at + stops.shape[0] > target.numel() or (ids is not None and ids.numel() < stops.shape[0])
    ):
        raise ValueError(
            f"stops must be an int64 [R, 1 + W] of slots within the buffer and ids for every row; got {stops.dtype} "
            f"{tuple(stops.shape)}"
        )
    size = target.numel()
    block = min(1024, max(16, next_power_of_2(size)))
    _stage_inputs_kernel[(triton.cdiv(size, block),)](
        source, target, target if ids is None else ids, target if stops is None else stops, size,
        0 if ids is None else ids.numel(), slots_at, 0 if stops is None else stops.shape[0],
        1 if stops is None else stops.shape[1],
        HAS_IDS=ids is not None, HAS_STOPS=stops is not None, BLOCK=block, num_warps=1 if block <= 128 else 4,
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
