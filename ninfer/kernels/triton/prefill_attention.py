"""Causal prefill attention over the paged KV cache, read in place: a chunk's queries attend to every earlier chunk's
keys through the page table, with no gather of the prefix.

Twin: ``ninfer.kernels.reference.attention.paged_attention``. One program per (block of ``BLOCK_M`` queries of one
row, query head); it walks the row's keys ``BLOCK_N`` at a time with an online softmax (exp2, fp32 accumulators).
Keys before the block's first query position are visible to all of its queries and need no mask; only the last
blocks, which overlap the queries, are masked causally. Rows of a batch may have any query and context length: the
host lists each query block's row, first token, first position and query count once per batch shape.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton.attention import _kv_offsets

LOG2E = 1.4426950408889634
BLOCK_M = 128
BLOCK_N = 64


@triton.jit
def _online_block(q, k, v, visible, scale_log2, running_max, running_sum, acc, MASKED: tl.constexpr):
    """One block of keys and values into the running max, sum and unnormalised output (base-2 scores)."""
    scores = tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    alpha = tl.math.exp2(running_max - new_max)
    p = tl.math.exp2(scores - new_max[:, None])
    running_sum = running_sum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return new_max, running_sum, acc


@triton.jit(do_not_specialize=["page_size"])
def _prefill_attention_kernel(
    q_ptr,
    q_token_stride,
    q_head_stride,
    key_cache_ptr,
    value_cache_ptr,
    page_tables_ptr,
    page_tables_stride,
    blocks_ptr,
    num_blocks,
    out_ptr,
    out_token_stride,
    out_head_stride,
    scale_log2,
    page_size,
    GROUP: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    block = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    row = tl.load(blocks_ptr + block).to(tl.int64)
    first_token = tl.load(blocks_ptr + num_blocks + block).to(tl.int64)
    first_position = tl.load(blocks_ptr + 2 * num_blocks + block)
    count = tl.load(blocks_ptr + 3 * num_blocks + block)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    valid_query = m < count
    tokens = first_token + m
    q = tl.load(q_ptr + tokens[:, None] * q_token_stride + head * q_head_stride + d[None, :],
                mask=valid_query[:, None], other=0.0)
    positions = first_position + m
    end = first_position + count  # keys before this are visible to some query of the block
    page_row = page_tables_ptr + row * page_tables_stride
    running_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    running_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    unmasked_end = (first_position // BLOCK_N) * BLOCK_N
    for start in range(0, unmasked_end, BLOCK_N):
        index = start + tl.arange(0, BLOCK_N)
        offsets = _kv_offsets(page_row, index, index < end, page_size, kv_head, KV_HEADS, D)
        k = tl.load(key_cache_ptr + offsets)
        v = tl.load(value_cache_ptr + offsets)
        running_max, running_sum, acc = _online_block(q, k, v, None, scale_log2, running_max, running_sum, acc, False)
    for start in range(unmasked_end, end, BLOCK_N):
        index = start + tl.arange(0, BLOCK_N)
        valid = index < end
        offsets = _kv_offsets(page_row, index, valid, page_size, kv_head, KV_HEADS, D)
        k = tl.load(key_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        v = tl.load(value_cache_ptr + offsets, mask=valid[:, None], other=0.0)
        visible = valid[None, :] & (index[None, :] <= positions[:, None])
        running_max, running_sum, acc = _online_block(q, k, v, visible, scale_log2, running_max, running_sum, acc, True)
    out = acc / running_sum[:, None]
    tl.store(out_ptr + tokens[:, None] * out_token_stride + head * out_head_stride + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=valid_query[:, None])


_BLOCK_TABLES: dict[tuple, torch.Tensor] = {}


def _query_blocks(
    query_lens: Sequence[int], context_lens: Sequence[int], device: torch.device, block_m: int
) -> torch.Tensor:
    """``[4, blocks]`` int32 on ``device``: each query block's row, first token, first position and query count.

    Every layer of one forward asks for the same batch shape, so the last few tables are kept (one host-to-device
    copy per forward, not per layer)."""
    key = (tuple(query_lens), tuple(context_lens), device, block_m)
    table = _BLOCK_TABLES.get(key)
    if table is None:
        rows, tokens, positions, counts = [], [], [], []
        token = 0
        for row, (length, context) in enumerate(zip(query_lens, context_lens)):
            for offset in range(0, length, block_m):
                rows.append(row)
                tokens.append(token + offset)
                positions.append(context + offset)
                counts.append(min(block_m, length - offset))
            token += length
        table = torch.tensor([rows, tokens, positions, counts], dtype=torch.int32).to(device, non_blocking=True)
        if len(_BLOCK_TABLES) >= 8:
            _BLOCK_TABLES.pop(next(iter(_BLOCK_TABLES)))
        _BLOCK_TABLES[key] = table
    return table


def prefill_dims_supported(head_dim: int) -> bool:
    """The kernel tiles whole heads: a power-of-two head dim of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_tables: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    scale: float,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    num_warps: int = 8,
    num_stages: int = 2,
) -> torch.Tensor:
    """``paged_attention``'s contract: ``query [T, Hq, D]`` (the rows' new tokens in order; their KV is already in
    the cache), caches ``[pages, page_size, Hkv, D]`` (contiguous), ``page_tables [B, P]``; returns ``[T, Hq, D]``."""
    tokens, heads, dim = query.shape
    if key_cache.dim() != 4 or not key_cache.is_contiguous() or not value_cache.is_contiguous():
        raise ValueError("the KV caches must be contiguous [pages, page_size, kv_heads, head_dim]")
    kv_heads = key_cache.shape[2]
    if heads % kv_heads or key_cache.shape[3] != dim or not prefill_dims_supported(dim):
        raise ValueError(f"unsupported attention shape: {heads} query heads, {kv_heads} KV heads, head dim {dim}")
    if query.stride(-1) != 1:
        raise ValueError("the query's head dim must be contiguous")
    out = torch.empty((tokens, heads, dim), dtype=query.dtype, device=query.device)
    if tokens == 0:
        return out
    blocks = _query_blocks(query_lens, context_lens, query.device, block_m)
    num_blocks = blocks.shape[1]
    page_tables = page_tables.to(device=query.device, dtype=torch.int32)
    _prefill_attention_kernel[(num_blocks, heads)](
        query, query.stride(0), query.stride(1),
        key_cache, value_cache,
        page_tables, page_tables.stride(0),
        blocks, num_blocks,
        out, out.stride(0), out.stride(1),
        scale * LOG2E, key_cache.shape[1],
        GROUP=heads // kv_heads, KV_HEADS=kv_heads, D=dim, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
