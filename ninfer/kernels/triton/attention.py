"""Decode-side gated attention: q/k RMSNorm + partial MRoPE + paged KV write, and split-K paged attention for one
query token per row (decode) or a few causal ones (speculative verify).

Twins: ``rms_norm(zero_centered)`` + ``apply_rotary`` + ``write_paged_kv`` for the first kernel and
``paged_attention`` followed by ``* sigmoid(gate)`` for the others. The fused projection row of a token is
``[q0 | gate0 | q1 | gate1 | ... | k (Hkv*D) | v (Hkv*D)]`` as the checkpoint's interleaved q_proj plus k/v.
Every launch has a fixed grid and reads lengths from device memory, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton import next_power_of_2
from ninfer.kernels.triton.norm_gemv import after_predecessor, launch_options, release_dependents, resolve_pdl


@triton.jit
def _qk_norm_rope_kernel(
    proj_ptr,
    proj_stride,
    q_norm_ptr,
    k_norm_ptr,
    positions_ptr,
    positions_stride,
    inverse_frequencies_ptr,
    axis_ptr,
    q_out_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    eps,
    QUERY_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    D: tl.constexpr,
    ROTARY: tl.constexpr,
    PDL: tl.constexpr,
):
    release_dependents(PDL)  # the attention splits load cached keys, staged tables and lengths before their wait
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D)
    half: tl.constexpr = ROTARY // 2
    rotated = d < ROTARY
    partner = tl.where(d < half, d + half, d - half)
    partner = tl.where(rotated, partner, d)
    sign = tl.where(d < half, -1.0, 1.0)
    frequency = tl.where(d < half, d, d - half)
    axis = tl.load(axis_ptr + frequency, mask=rotated, other=0)
    position = tl.load(positions_ptr + axis * positions_stride + token, mask=rotated, other=0).to(tl.float32)
    angle = position * tl.load(inverse_frequencies_ptr + frequency, mask=rotated, other=0.0)
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    row = proj_ptr + token * proj_stride
    is_query = head < QUERY_HEADS
    if is_query:
        base = row + head * (2 * D)
        norm_ptr = q_norm_ptr
    else:
        base = row + QUERY_HEADS * (2 * D) + (head - QUERY_HEADS) * D
        norm_ptr = k_norm_ptr
    weight = tl.load(norm_ptr + d).to(tl.float32) + 1.0
    weight_partner = tl.load(norm_ptr + partner).to(tl.float32) + 1.0
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    after_predecessor(PDL, True)  # only the projection row is the predecessor's
    raw = tl.load(base + d)
    x = raw.to(tl.float32)
    x_partner = tl.load(base + partner).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * rstd * weight
    y_partner = x_partner * rstd * weight_partner
    out = tl.where(rotated, y * cos + sign * y_partner * sin, y)
    if is_query:
        tl.store(q_out_ptr + (token * QUERY_HEADS + head) * D + d, out.to(raw.dtype))
    else:
        kv_head = head - QUERY_HEADS
        cache_offset = (slot * KV_HEADS + kv_head) * D + d
        tl.store(key_cache_ptr + cache_offset, out.to(key_cache_ptr.dtype.element_ty))
        value = tl.load(row + QUERY_HEADS * (2 * D) + (KV_HEADS + kv_head) * D + d)
        tl.store(value_cache_ptr + cache_offset, value.to(value_cache_ptr.dtype.element_ty))


def qk_norm_rope_write_kv(
    proj: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    positions: torch.Tensor,
    inverse_frequencies: torch.Tensor,
    axis_of_frequency: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    eps: float,
    *,
    query_heads: int,
    pdl: bool | None = None,
) -> torch.Tensor:
    """Normalise and rotate q and k of ``proj [T, Hq*2D + 2*Hkv*D]``; store k, v at ``slot_mapping [T]``.

    ``positions [3, T]`` are the MRoPE rows; the caches are ``[pages, page_size, Hkv, D]``. Returns q ``[T, Hq, D]``.
    ``pdl``: programmatic dependent launch (None: where the device has it), the norms, positions and slots loaded
    while the predecessor (which may write ``proj`` only) drains.
    """
    tokens = proj.shape[0]
    _, _, kv_heads, dim = key_cache.shape
    if proj.shape[1] != query_heads * 2 * dim + 2 * kv_heads * dim or proj.stride(1) != 1:
        raise ValueError(f"proj must be [T, {query_heads * 2 * dim + 2 * kv_heads * dim}] with contiguous rows")
    if positions.shape != (3, tokens) or positions.stride(1) != 1:
        raise ValueError(f"positions must be [3, {tokens}] with contiguous rows")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV caches must be contiguous")
    rotary = 2 * inverse_frequencies.shape[0]
    pdl = resolve_pdl(pdl, proj.device)
    q = torch.empty((tokens, query_heads, dim), dtype=proj.dtype, device=proj.device)
    _qk_norm_rope_kernel[(tokens, query_heads + kv_heads)](
        proj, proj.stride(0), q_norm, k_norm, positions, positions.stride(0), inverse_frequencies, axis_of_frequency,
        q, key_cache, value_cache, slot_mapping, eps,
        QUERY_HEADS=query_heads, KV_HEADS=kv_heads, D=dim, ROTARY=rotary, PDL=pdl,
        num_warps=2 if dim <= 256 else 4, **launch_options(pdl),
    )
    return q


@triton.jit
def _partial_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    page_tables_ptr,
    page_tables_stride,
    total_lens_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    scale,
    page_size,
    num_splits,
    TOKENS: tl.constexpr,
    QUERY_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    M_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    PDL: tl.constexpr,
):
    """One split of one row's KV for all ``TOKENS x GROUP`` queries of a KV head (decode: ``TOKENS`` 1), causal
    among the row's new tokens; writes the split's running max, sum and unnormalised output per query. The first
    block's cached keys and values are loaded before the predecessor wait (it writes only the new tokens' KV)."""
    release_dependents(PDL)  # the merge loads only the token lengths (the step prologue's) before its wait
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    total = tl.load(total_lens_ptr + row)
    context = total - TOKENS
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, total)
    page_row = page_tables_ptr + row * page_tables_stride
    index = start + tl.arange(0, BLOCK_N)
    valid = index < end
    offsets = _kv_offsets(page_row, index, valid, page_size, kv_head, KV_HEADS, D)
    cached = (valid & (index < context))[:, None]
    first_k = tl.load(key_cache_ptr + offsets, mask=cached, other=0.0)
    first_v = tl.load(value_cache_ptr + offsets, mask=cached, other=0.0)
    after_predecessor(PDL, True)  # the predecessor writes the queries and the new tokens' KV
    if start < total:
        m = tl.arange(0, M_PAD)  # query m of this KV head: the row's token m // GROUP, query head m % GROUP
        valid_query = m < TOKENS * GROUP
        token = row * TOKENS + m // GROUP
        heads = kv_head * GROUP + m % GROUP
        visible_end = context + m // GROUP + 1  # causal: cached tokens and new tokens up to this one
        d = tl.arange(0, D)
        q_offsets = (token * QUERY_HEADS + heads)[:, None] * D + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=valid_query[:, None], other=0.0)
        running_max = tl.full((M_PAD,), float("-inf"), tl.float32)
        running_sum = tl.zeros((M_PAD,), tl.float32)
        acc = tl.zeros((M_PAD, D), tl.float32)
        fresh = (valid & (index >= context))[:, None]
        k = tl.where(fresh, tl.load(key_cache_ptr + offsets, mask=fresh, other=0.0), first_k)
        v = tl.where(fresh, tl.load(value_cache_ptr + offsets, mask=fresh, other=0.0), first_v)
        running_max, running_sum, acc = _attend_block(
            q, k, v, index, valid, visible_end, running_max, running_sum, acc, scale, IEEE
        )
        for block in range(start + BLOCK_N, end, BLOCK_N):
            later = block + tl.arange(0, BLOCK_N)
            later_valid = later < end
            later_offsets = _kv_offsets(page_row, later, later_valid, page_size, kv_head, KV_HEADS, D)
            running_max, running_sum, acc = _attend_block(
                q, tl.load(key_cache_ptr + later_offsets, mask=later_valid[:, None], other=0.0),
                tl.load(value_cache_ptr + later_offsets, mask=later_valid[:, None], other=0.0), later, later_valid,
                visible_end, running_max, running_sum, acc, scale, IEEE,
            )
        stat = (token * QUERY_HEADS + heads) * num_splits + split
        tl.store(partial_max_ptr + stat, running_max, mask=valid_query)
        tl.store(partial_sum_ptr + stat, running_sum, mask=valid_query)
        tl.store(partial_out_ptr + stat[:, None] * D + d[None, :], acc, mask=valid_query[:, None])


@triton.jit
def _kv_offsets(page_row, index, valid, page_size, kv_head, KV_HEADS: tl.constexpr, D: tl.constexpr):
    """Element offsets ``[BLOCK_N, D]`` of one KV head's cache rows for the row's token positions ``index``."""
    page = tl.load(page_row + index // page_size, mask=valid, other=0)
    slot = page.to(tl.int64) * page_size + index % page_size
    return (slot * KV_HEADS + kv_head)[:, None] * D + tl.arange(0, D)[None, :]


@triton.jit
def _attend_block(q, k, v, index, valid, visible_end, running_max, running_sum, acc, scale, IEEE: tl.constexpr):
    """One block of keys and values into the queries' running max, sum and unnormalised output (online softmax)."""
    if IEEE:
        scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee") * scale
    else:
        scores = tl.dot(q, tl.trans(k.to(q.dtype))) * scale
    scores = tl.where(valid[None, :] & (index[None, :] < visible_end[:, None]), scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    # a query may see nothing in this split yet (its keys end before it): keep its sums at zero, not NaN
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    alpha = tl.exp(running_max - shift)
    p = tl.exp(scores - shift[:, None])
    running_sum = running_sum * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return new_max, running_sum, acc


@triton.jit
def _reduce_kernel(
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    token_lens_ptr,
    gate_ptr,
    gate_row_stride,
    gate_head_stride,
    out_ptr,
    num_splits,
    QUERY_HEADS: tl.constexpr,
    D: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge one query's split results (running max, sum, output) into its attention output, times sigmoid(gate)."""
    release_dependents(PDL)  # its successor (the out projection) loads only weights before its wait
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    used = tl.cdiv(tl.load(token_lens_ptr + token), SPLIT)  # the splits that hold this token's keys
    base = (token * QUERY_HEADS + head) * num_splits
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, D)
    after_predecessor(PDL, True)  # the predecessor writes the split results
    if HAS_GATE:  # the projection's, three launches back: it may still run before this wait (the splits start early)
        gate = tl.load(gate_ptr + token * gate_row_stride + head * gate_head_stride + d).to(tl.float32)
    best = tl.full((), float("-inf"), tl.float32)  # one pass: the running maximum rescales what is summed so far
    total = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for first in range(0, used, BLOCK_S):
        index = first + s
        valid = index < used
        split_max = tl.load(partial_max_ptr + base + index, mask=valid, other=float("-inf"))
        split_sum = tl.load(partial_sum_ptr + base + index, mask=valid, other=0.0)
        part = tl.load(partial_out_ptr + (base + index)[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        new_best = tl.maximum(best, tl.max(split_max, axis=0))
        shift = tl.where(new_best == float("-inf"), 0.0, new_best)
        correction = tl.exp(best - shift)
        weight = tl.exp(split_max - shift)
        total = total * correction + tl.sum(weight * split_sum, axis=0)
        acc = acc * correction + tl.sum(part * weight[:, None], axis=0)
        best = new_best
    out = acc / total
    if HAS_GATE:
        out = out * tl.sigmoid(gate)
    tl.store(out_ptr + (token * QUERY_HEADS + head) * D + d, out.to(out_ptr.dtype.element_ty))


def decode_split_tokens(max_tokens: int, *, max_splits: int = 256, minimum: int = 64) -> int:
    """Tokens per split-K chunk so that at most ``max_splits`` chunks cover ``max_tokens`` (a power of two)."""
    split = minimum
    while split * max_splits < max_tokens:
        split *= 2
    return split


def paged_attention_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_tables: torch.Tensor,
    total_lens: torch.Tensor,
    *,
    scale: float,
    gate: torch.Tensor | None = None,
    split_tokens: int | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """One query token per row attends to its first ``total_lens[row]`` cached tokens (the new one included).

    ``q [B, Hq, D]``; caches ``[pages, page_size, Hkv, D]``; ``page_tables [B, P]`` and ``total_lens [B]`` are
    int32 or int64 on the device. ``gate [B, Hq, D]`` (any strides, unit last stride) multiplies the output by
    sigmoid(gate). The grid covers ``P * page_size`` tokens, so the launch never depends on host-side lengths.
    ``pdl``: programmatic dependent launch (None: where the device has it); the predecessor may write ``q`` and
    the new tokens' KV only. Returns ``[B, Hq*D]``.
    """
    return _attend(
        q, key_cache, value_cache, page_tables, total_lens, total_lens, 1, scale, gate, split_tokens, pdl
    )


def paged_attention_verify(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_tables: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    tokens_per_row: int,
    scale: float,
    gate: torch.Tensor | None = None,
    split_tokens: int | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``tokens_per_row`` query tokens per row (a speculative verify) over the row's paged KV, causal among them.

    Row r's new tokens are ``q[r*n : (r+1)*n]`` (``q [R*n, Hq, D]``, contiguous); their KV is already in the pages
    after the row's ``context_lens[r]`` cached tokens, and new token i attends to the cached tokens and new tokens
    ``<= i``. Each program reads one split of one row's KV once for all its ``n x Hq/Hkv`` queries. Caches, page
    tables, ``gate``, ``pdl`` and the fixed grid are as in :func:`paged_attention_decode`. Returns ``[R*n, Hq*D]``.
    """
    rows = context_lens.shape[0]
    if tokens_per_row < 1 or rows * tokens_per_row != q.shape[0]:
        raise ValueError(f"{rows} rows x {tokens_per_row} tokens != {q.shape[0]} query tokens")
    # token i of row r sees context_lens[r] + i + 1 keys; the row's last token sees them all
    token_lens = (context_lens[:, None] + torch.arange(1, tokens_per_row + 1, device=q.device)).reshape(-1)
    total_lens = context_lens + tokens_per_row
    return _attend(q, key_cache, value_cache, page_tables, total_lens, token_lens, tokens_per_row, scale, gate,
                   split_tokens, pdl)


def _attend(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_tables: torch.Tensor,
    total_lens: torch.Tensor,
    token_lens: torch.Tensor,
    tokens_per_row: int,
    scale: float,
    gate: torch.Tensor | None,
    split_tokens: int | None,
    pdl: bool | None,
) -> torch.Tensor:
    """The split-K launches: per (row, KV head, split) the partial kernel, then per (token, query head) the reduce
    over the ``token_lens[token]`` keys' splits (with the output gate)."""
    tokens, query_heads, dim = q.shape
    _, page_size, kv_heads, cache_dim = key_cache.shape
    rows = total_lens.shape[0]
    if cache_dim != dim or query_heads % kv_heads:
        raise ValueError(f"q [T, {query_heads}, {dim}] does not fit caches with {kv_heads} KV heads of dim {cache_dim}")
    if not q.is_contiguous() or page_tables.stride(1) != 1 or page_tables.shape[0] != rows:
        raise ValueError("q must be contiguous and page_tables [R, P] must have contiguous rows")
    if gate is not None and (gate.shape != q.shape or gate.stride(2) != 1):
        raise ValueError(f"gate must be [T, Hq, D] = {tuple(q.shape)} with a unit last stride")
    max_tokens = page_tables.shape[1] * page_size
    pdl = resolve_pdl(pdl, q.device)
    group = query_heads // kv_heads
    m_pad = max(16, next_power_of_2(tokens_per_row * group))
    if tokens_per_row == 1:  # decode: a split is one block of keys, held across the wait (8 warps: no spills)
        block_n, warps = (32 if dim >= 256 else 64), 8
        split = split_tokens or decode_split_tokens(max_tokens, minimum=block_n)
    else:  # 16 keys per step at 8 warps keeps the [M_PAD, 256] accumulator in registers (sm_90: no spill at 32)
        block_n, warps = (16, 8) if m_pad * dim >= 8192 else (64, 4)
        split = split_tokens or decode_split_tokens(max_tokens)
    num_splits = triton.cdiv(max_tokens, split)
    stats_shape = (tokens, query_heads, num_splits)
    partial_max = torch.empty(stats_shape, dtype=torch.float32, device=q.device)
    partial_sum = torch.empty(stats_shape, dtype=torch.float32, device=q.device)
    partial_out = torch.empty((*stats_shape, dim), dtype=torch.float32, device=q.device)
    _partial_kernel[(rows, kv_heads, num_splits)](
        q, key_cache, value_cache, page_tables, page_tables.stride(0), total_lens,
        partial_out, partial_max, partial_sum, scale, page_size, num_splits,
        TOKENS=tokens_per_row, QUERY_HEADS=query_heads, KV_HEADS=kv_heads, GROUP=group, M_PAD=m_pad, D=dim,
        BLOCK_N=block_n, SPLIT=split, IEEE=q.dtype == torch.float32, PDL=pdl, num_warps=warps, **launch_options(pdl),
    )
    out = torch.empty((tokens, query_heads * dim), dtype=q.dtype, device=q.device)
    _reduce_kernel[(tokens, query_heads)](
        partial_out, partial_max, partial_sum, token_lens,
        gate if gate is not None else q, gate.stride(0) if gate is not None else 0,
        gate.stride(1) if gate is not None else 0, out, num_splits,
        QUERY_HEADS=query_heads, D=dim, SPLIT=split, BLOCK_S=16, HAS_GATE=gate is not None, PDL=pdl, num_warps=4,
        **launch_options(pdl),
    )
    return out
