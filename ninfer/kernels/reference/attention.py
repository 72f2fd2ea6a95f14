"""Paged causal attention (GQA) over a KV pool: the reference for the fast attention kernels.

KV of token ``j`` of a row lives in page ``page_tables[row, j // page_size]`` at offset ``j % page_size`` of
``key_cache``/``value_cache [num_pages, page_size, Hkv, D]``. A row continues ``context_lens[row]`` cached tokens with
``query_lens[row]`` new ones; new token ``i`` attends to cached tokens and new tokens ``<= i``.

With a ``codec`` (a quantized ``--kv-dtype``) the caches hold the codec's packed bytes per token-head
(``[num_pages, page_size, Hkv, bytes]`` uint8): writes encode, reads decode the gathered pages back to un-rotated
fp32 K/V, and the attention math is the same.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ninfer.quant.kv_codecs import KVCodec

_QUERY_BLOCK = 256  # bounds the score matrix of long prefill chunks on the CPU path


def token_rows_and_positions(
    query_lens: Sequence[int], context_lens: Sequence[int], device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the concatenated new tokens: the row of each (int64 ``[T]``) and its position in its row's sequence."""
    lens = torch.as_tensor(list(query_lens), dtype=torch.int64, device=device)
    contexts = torch.as_tensor(list(context_lens), dtype=torch.int64, device=device)
    rows = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens)
    starts = torch.cumsum(lens, 0) - lens
    offsets = torch.arange(int(lens.sum()), device=device) - starts[rows]
    return rows, contexts[rows] + offsets


def paged_slot_mapping(
    page_tables: torch.Tensor, query_lens: Sequence[int], context_lens: Sequence[int], page_size: int
) -> torch.Tensor:
    """Flat slot (``page * page_size + offset``) of every new token, int64 ``[T]``."""
    rows, positions = token_rows_and_positions(query_lens, context_lens, page_tables.device)
    pages = page_tables.long()[rows, positions // page_size]
    return pages * page_size + positions % page_size


def write_paged_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    codec: KVCodec | None = None,
) -> None:
    """Store ``key/value [T,Hkv,D]`` at the flat slots ``slot_mapping [T]`` of the paged caches (in the cache dtype,
    or as ``codec``'s packed bytes)."""
    num_pages, page_size, heads = key_cache.shape[:3]
    dim = key.shape[-1] if codec is not None else key_cache.shape[3]
    if tuple(key.shape[1:]) != (heads, dim) or key.shape != value.shape:
        raise ValueError(f"key/value must be [T, {heads}, {dim}]; got {tuple(key.shape)} and {tuple(value.shape)}")
    if codec is not None:
        key, value = codec.pack_keys(key), codec.pack_values(value)
    flat_keys = key_cache.view(num_pages * page_size, heads, key_cache.shape[3])
    flat_values = value_cache.view(num_pages * page_size, heads, value_cache.shape[3])
    slots = slot_mapping.long()
    flat_keys.index_copy_(0, slots, key.to(key_cache.dtype))
    flat_values.index_copy_(0, slots, value.to(value_cache.dtype))


def gather_pages(cache: torch.Tensor, page_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` entries ``[length, ...]`` of one row's paged cache ``[pages, page_size, ...]``."""
    page_size = cache.shape[1]
    pages = page_row[: (length + page_size - 1) // page_size].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_row: torch.Tensor,
    length: int,
    dim: int,
    codec: KVCodec | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 keys and values ``[length, Hkv, dim]`` of one row: its gathered pages, decoded when ``codec`` is set."""
    keys, values = gather_pages(key_cache, page_row, length), gather_pages(value_cache, page_row, length)
    if codec is None:
        return keys.float(), values.float()
    return codec.unpack_keys(keys, dim), codec.unpack_values(values, dim)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_tables: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    scale: float | None = None,
    codec: KVCodec | None = None,
) -> torch.Tensor:
    """Causal softmax attention of ``query [T,Hq,D]`` over each row's cached + new KV (already written, through
    ``codec`` when set); fp32 math.

    Query head h reads KV head ``h // (Hq // Hkv)``; ``scale`` defaults to ``D ** -0.5``. Returns ``[T,Hq,D]``.
    """
    total_tokens, query_heads, dim = query.shape
    kv_heads = key_cache.shape[2]
    if query_heads % kv_heads:
        raise ValueError(f"query heads ({query_heads}) must be a multiple of KV heads ({kv_heads})")
    if sum(query_lens) != total_tokens:
        raise ValueError(f"query_lens sum to {sum(query_lens)} but query has {total_tokens} tokens")
    group = query_heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    output = torch.empty_like(query)
    start = 0
    for row, (length, context) in enumerate(zip(query_lens, context_lens)):
        total = context + length
        keys, values = gather_kv(key_cache, value_cache, page_tables[row], total, dim, codec)  # [L, Hkv, D]
        key_index = torch.arange(total, device=query.device)
        for block in range(0, length, _QUERY_BLOCK):
            stop = min(block + _QUERY_BLOCK, length)
            q = query[start + block : start + stop].float().view(stop - block, kv_heads, group, dim)
            scores = torch.einsum("qhgd,khd->hgqk", q, keys) * scale
            query_pos = context + torch.arange(block, stop, device=query.device)
            scores = scores.masked_fill(key_index[None, :] > query_pos[:, None], float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            attended = torch.einsum("hgqk,khd->qhgd", weights, values)
            output[start + block : start + stop] = attended.reshape(stop - block, query_heads, dim).to(query.dtype)
        start += length
    return output
