"""Prefill-side kernels for CUDA, built from well-batched torch operations, with the reference kernels elsewhere.

* ``prefill_gated_delta_rule``: the chunked gated delta rule in three fused Triton kernels on CUDA
  (``ninfer.kernels.triton.gated_delta_chunk``: q/k/v read in place, norms fused). Its fallback,
  ``batched_chunk_gated_delta_rule``, computes every intra-chunk quantity (decay matrices, the triangular solves,
  the causal intra-chunk scores) for all chunks at once with torch; only the state hand-over from chunk to chunk
  stays sequential: one Triton kernel on CUDA (``ninfer.kernels.triton.chunk_state``), three batched products per
  chunk elsewhere (``chunk_state_pass_torch``, its twin).
* ``prefill_causal_conv1d``: the short conv of a whole chunk in one Triton kernel on CUDA.
* ``prefill_attention``: a chunk that continues cached context through the Triton paged prefill attention
  (``ninfer.kernels.triton.prefill_attention``: the cached KV read in place through the page table); rows at root
  through SDPA's flash kernel. ``split_paged_attention`` is the measured alternative for continuation chunks (two
  fused attention calls, the cached prefix without a mask and the chunk causally, merged by log-sum-exp): on
  cuDNN it runs at 515 against the Triton kernel's 284 TFLOP/s after 130K cached tokens on the H200.
* ``moe_feed_forward``: (token, expert) pairs sorted by expert and run as grouped GEMMs (``torch._grouped_mm`` on
  CUDA bf16), one scatter-add back to the tokens.

On a CPU tensor all defer to the reference (``chunk_gated_delta_rule``, ``paged_attention``, ``moe_forward``), which
stay the oracle.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from ninfer.kernels.reference.attention import gather_pages, paged_attention
from ninfer.kernels.reference.conv import causal_conv1d
from ninfer.kernels.reference.gated_delta import _prepare, chunk_gated_delta_rule
from ninfer.kernels.reference.moe import moe_forward, route_tokens, swiglu
from ninfer.quant.kv_codecs import KVCodec


def batched_chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and math as ``chunk_gated_delta_rule``; intra-chunk work batched over all chunks.

    The sequence is padded to whole chunks with ``beta = 0, g = 0`` and zero q/k/v, which leaves the state unchanged.
    Returns ``(o [B,T,Hv,Dv] in v.dtype, final_state [B,Hv,Dk,Dv] fp32)``.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale)
    batch, heads, length, key_dim = q.shape
    value_dim = v.shape[-1]
    if length == 0:
        return v.new_zeros((batch, 0, heads, value_dim)).to(out_dtype), state
    size = chunk_size
    chunks = -(-length // size)
    pad = chunks * size - length
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))

    # chunk-major layout [N, B*H, C, D] so that each chunk's slice is contiguous for the sequential pass
    def chunked(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(batch * heads, chunks, size, *x.shape[3:]).transpose(0, 1).contiguous()

    q, k, v = chunked(q), chunked(k), chunked(v)
    g, beta = chunked(g[..., None])[..., 0], chunked(beta[..., None])[..., 0]
    cum = g.cumsum(dim=-1)  # [N, BH, C]
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    strictly_lower = causal.clone().fill_diagonal_(False)
    a = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).masked_fill(~strictly_lower, 0.0)
    identity = torch.eye(size, dtype=a.dtype, device=a.device)
    # (I + A)^-1 once per chunk and head (a C-wide right-hand side instead of Dv + Dk), then two batched products
    inverse = torch.linalg.solve_triangular(a + identity, identity.expand_as(a), upper=False, unitriangular=True)
    base_corrections = inverse @ (beta[..., None] * v)
    solved_k = inverse @ ((beta * cum.exp())[..., None] * k)
    scores = (q @ k.transpose(-1, -2)) * decay  # causal incl. the diagonal (decay is 0 above it)
    decayed_q = cum.exp()[..., None] * q
    last = cum[..., -1:]  # [N, BH, 1]
    decayed_k_t = ((last - cum).exp()[..., None] * k).transpose(-1, -2).contiguous()  # [N, BH, Dk, C]
    chunk_decay = last.exp()[..., None]  # [N, BH, 1, 1]
    state = state.reshape(batch * heads, key_dim, value_dim).contiguous()
    state_pass = _triton_state_pass(q.device, size, key_dim, value_dim) or chunk_state_pass_torch
    out, corrections, state = state_pass(decayed_q, solved_k, base_corrections, decayed_k_t, chunk_decay, state)
    out += scores @ corrections
    o = out.transpose(0, 1).reshape(batch, heads, chunks * size, value_dim)[:, :, :length]
    return o.transpose(1, 2).contiguous().to(out_dtype), state.view(batch, heads, key_dim, value_dim)


def chunk_state_pass_torch(
    decayed_q: torch.Tensor,
    solved_k: torch.Tensor,
    base_corrections: torch.Tensor,
    decayed_k_t: torch.Tensor,
    chunk_decay: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sequential chunk-to-chunk state hand-over, three batched products per chunk (the Triton kernel's twin).

    Shapes as ``ninfer.kernels.triton.chunk_state.chunk_state_pass``; returns ``(out, corrections, final state)``.
    """
    chunks = decayed_q.shape[0]
    corrections = torch.empty_like(base_corrections)
    out = torch.empty_like(base_corrections)
    chunk_decay = chunk_decay.reshape(chunks, -1, 1, 1)
    for n in range(chunks):
        torch.bmm(decayed_q[n], state, out=out[n])  # what the entering state contributes
        torch.baddbmm(base_corrections[n], solved_k[n], state, alpha=-1.0, out=corrections[n])
        state = torch.baddbmm(state * chunk_decay[n], decayed_k_t[n], corrections[n])
    return out, corrections, state


def _triton_state_pass(device: torch.device, size: int, key_dim: int, value_dim: int):  # type: ignore[no-untyped-def]
    """The Triton state pass when it can run on ``device`` with these sizes (powers of two >= 16), else None."""
    from ninfer.kernels.triton import triton_available

    if device.type != "cuda" or not triton_available(device):
        return None
    if any(n < 16 or n & (n - 1) for n in (size, key_dim, value_dim)):
        return None
    from ninfer.kernels.triton.chunk_state import chunk_state_pass

    return chunk_state_pass


def prefill_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over a chunk per row: ``(y [B,T,C], new window [B,C,K-1])``.

    One Triton kernel on CUDA (``ninfer.kernels.triton.conv.causal_conv1d_prefill``), the reference elsewhere.
    """
    from ninfer.kernels.triton import triton_available

    if x.device.type == "cuda" and triton_available(x.device):
        from ninfer.kernels.triton.conv import causal_conv1d_prefill

        return causal_conv1d_prefill(x, weight, conv_state)
    y, new_state, _ = causal_conv1d(x, weight, conv_state)
    return y, new_state


def prefill_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule: the fused Triton kernels on CUDA (``ninfer.kernels.triton.gated_delta_chunk``)
    when Triton runs and the head dims suit them, else batched over chunks on CUDA, the reference elsewhere."""
    if v.device.type != "cuda":
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state)
    from ninfer.kernels.triton import triton_available

    if triton_available(v.device):
        from ninfer.kernels.triton.gated_delta_chunk import chunk_gated_delta_rule_fused, fused_dims_supported

        if fused_dims_supported(k.shape[-1], v.shape[-1]):
            return chunk_gated_delta_rule_fused(q, k, v, g, beta, initial_state)
    return batched_chunk_gated_delta_rule(q, k, v, g, beta, initial_state)


def sdpa_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_tables: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    scale: float,
) -> torch.Tensor:
    """``paged_attention``'s contract through ``scaled_dot_product_attention``, one row at a time."""
    query_heads = query.shape[1]
    group = query_heads // key_cache.shape[2]
    output = torch.empty_like(query)
    start = 0
    for row, (length, context) in enumerate(zip(query_lens, context_lens)):
        total = context + length
        keys = gather_pages(key_cache, page_tables[row], total).to(query.dtype)
        values = gather_pages(value_cache, page_tables[row], total).to(query.dtype)
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        q = query[start : start + length].transpose(0, 1)[None]
        k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        if context == 0:
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            positions = context + torch.arange(length, device=query.device)
            mask = torch.arange(total, device=query.device)[None, :] <= positions[:, None]
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        output[start : start + length] = attended[0].transpose(0, 1)
        start += length
    return output


AttendWithLse = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """cuDNN's fused attention on ``[1, H, L, D]`` operands: the output and its natural-log ``logsumexp``."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )[:2]
    return out, lse


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """SDPA's flash kernel on ``[1, H, L, D]`` operands: the output and its natural-log ``logsumexp``."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    return out, lse


def split_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_tables: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    scale: float,
    attend: AttendWithLse = cudnn_attention,
) -> torch.Tensor:
    """``paged_attention``'s contract through two mask-free fused attention calls per row, merged by log-sum-exp.

    A continuation chunk sees all of its row's cached prefix and its own tokens causally. The prefix part needs no
    mask, so the query heads that share a KV head are folded into the query sequence and the prefix KV is read once
    per KV head (not repeated per query head); the chunk's own part is causal with both ends aligned. The prefix
    is gathered from its pages (a copy ~2 % of the attention's time at any context length)."""
    heads, dim = query.shape[1], query.shape[2]
    kv_heads = key_cache.shape[2]
    group = heads // kv_heads
    output = torch.empty_like(query)
    start = 0
    for row, (length, context) in enumerate(zip(query_lens, context_lens)):
        chunk = query[start : start + length]
        total = context + length
        keys = gather_pages(key_cache, page_tables[row], total).to(query.dtype)
        values = gather_pages(value_cache, page_tables[row], total).to(query.dtype)
        own_k = keys[context:].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        own_v = values[context:].repeat_interleave(group, dim=1).transpose(0, 1)[None]
        own, own_lse = attend(chunk.transpose(0, 1)[None], own_k, own_v, True, scale)
        own, own_lse = own[0].transpose(0, 1), own_lse.reshape(heads, length).transpose(0, 1)
        if context == 0:
            output[start : start + length] = own
        else:
            folded = chunk.view(length, kv_heads, group, dim).permute(2, 0, 1, 3).reshape(-1, kv_heads, dim)
            prefix_k, prefix_v = keys[:context].transpose(0, 1)[None], values[:context].transpose(0, 1)[None]
            past, past_lse = attend(folded.transpose(0, 1)[None], prefix_k, prefix_v, False, scale)
            past = past.view(kv_heads, group, length, dim).permute(2, 0, 1, 3).reshape(length, heads, dim)
            past_lse = past_lse.reshape(kv_heads, group, length).permute(2, 0, 1).reshape(length, heads)
            past_weight = torch.sigmoid(past_lse - own_lse)[..., None]
            merged = own.float() + past_weight * (past.float() - own.float())
            output[start : start + length] = merged.to(query.dtype)
        start += length
    return output


def prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    page_tables: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    scale: float,
    codec: KVCodec | None = None,
) -> torch.Tensor:
    """Causal paged attention on CUDA: rows that all start at root through SDPA (its flash kernel: 1.5 against
    2.1 ms for one 8192-token 27B layer on the H200); a batch that continues cached context through the Triton
    paged kernel (cached KV read in place: 0.85 against SDPA's 1.39 ms for a 1024-token chunk after 7168 cached
    tokens, which SDPA must gather and mask); SDPA also without Triton or for a head dim the kernel cannot tile.
    The reference ``paged_attention`` elsewhere, and for a quantized pool (``codec``: the fast kernels read
    model-dtype pages only)."""
    if query.device.type == "cuda" and codec is None:
        from ninfer.kernels.triton import triton_available

        if any(context_lens) and triton_available(query.device):
            from ninfer.kernels.triton.prefill_attention import paged_prefill_attention, prefill_dims_supported

            if prefill_dims_supported(query.shape[-1]):
                return paged_prefill_attention(
                    query, key_cache, value_cache, page_tables, query_lens, context_lens, scale=scale
                )
        return sdpa_paged_attention(
            query, key_cache, value_cache, page_tables, query_lens, context_lens, scale=scale
        )
    return paged_attention(
        query, key_cache, value_cache, page_tables, query_lens, context_lens, scale=scale, codec=codec
    )


def _grouped_matmul(
    x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, counts: list[int] | None
) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (group e ends at ``ends[e]``) times ``weight[e].T`` (``weight [E, O, I]``)."""
    if counts is None:
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)
    out = x.new_empty((x.shape[0], weight.shape[1]))
    start = 0
    for expert, count in enumerate(counts):
        if count:
            out[start : start + count] = F.linear(x[start : start + count], weight[expert])
        start += count
    return out


def grouped_moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    *,
    shared_gate: torch.Tensor | None = None,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_expert_gate: torch.Tensor | None = None,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """``moe_forward``'s contract with the (token, expert) pairs sorted by expert and multiplied group by group;
    deterministic (each token's expert outputs are summed in slot order).

    ``use_grouped_mm`` (default: on CUDA bf16 when torch has it) selects ``torch._grouped_mm``; otherwise each
    non-empty expert segment is one ``F.linear`` (one host sync for the segment sizes).
    """
    if use_grouped_mm is None:
        use_grouped_mm = x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
    num_experts = gate_up.shape[0]
    weights, experts = route_tokens(x, router_weight, top_k)
    order = torch.argsort(experts.reshape(-1), stable=True)
    token_of = order // top_k
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    host_counts = None if use_grouped_mm else counts.tolist()
    gate, up = _grouped_matmul(x[token_of], gate_up, ends, host_counts).chunk(2, dim=-1)
    expert_out = _grouped_matmul(F.silu(gate) * up, down, ends, host_counts)
    # back to (token, slot) order and summed over the slots in a fixed order, not scattered with atomic adds (whose
    # order the device picks): deterministic, and faster on the H200 (35B-A3B TTFT at 8192: 238 ms against 250-262)
    weighted = torch.empty((order.shape[0], x.shape[1]), dtype=torch.float32, device=x.device)
    weighted[order] = expert_out.float() * weights.reshape(-1)[order, None]
    output = weighted.view(x.shape[0], top_k, x.shape[1]).sum(dim=1)
    if shared_gate is not None:
        if shared_up is None or shared_down is None or shared_expert_gate is None:
            raise ValueError("the shared expert needs shared_gate, shared_up, shared_down and shared_expert_gate")
        shared = swiglu(x, shared_gate, shared_up, shared_down)
        output += torch.sigmoid(F.linear(x, shared_expert_gate).float()) * shared.float()
    return output.to(x.dtype)


def moe_feed_forward(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     top_k: int, **shared: torch.Tensor | None) -> torch.Tensor:
    """The MoE block: grouped GEMMs on CUDA, the reference ``moe_forward`` elsewhere."""
    if x.is_cuda:
        return grouped_moe_forward(x, router_weight, gate_up, down, top_k, **shared)  # type: ignore[arg-type]
    return moe_forward(x, router_weight, gate_up, down, top_k, **shared)  # type: ignore[arg-type]
