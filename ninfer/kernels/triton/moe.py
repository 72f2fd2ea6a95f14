"""Graph-capturable mixture-of-experts pieces for decode: top-k routing, per-(token, expert) GEMVs, the combine.

Twin: ``ninfer.kernels.reference.moe.moe_forward`` (softmax over all experts in fp32, top-k, renormalised to sum 1, SwiGLU
experts, sigmoid-gated shared expert). Expert ids stay on the device: no host sync, fixed grids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton import next_power_of_2


@triton.jit
def _route_kernel(
    logits_ptr, logits_stride, weights_ptr, experts_ptr, num_experts,
    TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    logits = tl.load(logits_ptr + token * logits_stride + e, mask=valid, other=float("-inf")).to(tl.float32)
    probabilities = tl.exp(logits - tl.max(logits, axis=0))
    probabilities = probabilities / tl.sum(probabilities, axis=0)
    probabilities = tl.where(valid, probabilities, -1.0)
    slots = tl.arange(0, TOP_K_PAD)
    chosen_weights = tl.zeros((TOP_K_PAD,), tl.float32)
    chosen_experts = tl.zeros((TOP_K_PAD,), tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probabilities, axis=0)
        best_weight = tl.max(probabilities, axis=0)
        chosen_weights = tl.where(slots == j, best_weight, chosen_weights)
        chosen_experts = tl.where(slots == j, best, chosen_experts)
        probabilities = tl.where(e == best, -1.0, probabilities)
    chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=0)
    keep = slots < TOP_K
    tl.store(weights_ptr + token * TOP_K + slots, chosen_weights, mask=keep)
    tl.store(experts_ptr + token * TOP_K + slots, chosen_experts, mask=keep)


def route_top_k(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [N, E]`` (rows may be strided) -> ``(weights [N, k] fp32 summing to 1, experts [N, k] int32)``."""
    tokens, num_experts = logits.shape
    if logits.stride(1) != 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"logits need contiguous rows and 1 <= top_k <= {num_experts}; got top_k={top_k}")
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    experts = torch.empty((tokens, top_k), dtype=torch.int32, device=logits.device)
    _route_kernel[(tokens,)](
        logits, logits.stride(0), weights, experts, num_experts,
        TOP_K=top_k, TOP_K_PAD=next_power_of_2(top_k), BLOCK_E=next_power_of_2(num_experts),
    )
    return weights, experts


@triton.jit
def _expert_gemv_kernel(
    x_ptr, x_stride, weight_ptr, experts_ptr, out_ptr, out_features, in_features, pairs_per_x,
    BLOCK_O: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    row_valid = rows < out_features
    expert = tl.load(experts_ptr + pair).to(tl.int64)
    x_row = x_ptr + (pair // pairs_per_x) * x_stride
    matrix = weight_ptr + expert * out_features * in_features + rows[:, None].to(tl.int64) * in_features
    acc = tl.zeros((BLOCK_O,), tl.float32)
    for first in range(0, in_features, BLOCK_H):
        cols = first + tl.arange(0, BLOCK_H)
        col_valid = cols < in_features
        w = tl.load(matrix + cols[None, :], mask=row_valid[:, None] & col_valid[None, :], other=0.0)
        x = tl.load(x_row + cols, mask=col_valid, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(out_ptr + pair * out_features + rows, acc.to(out_ptr.dtype.element_ty), mask=row_valid)


def expert_gemv(x: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor, *, pairs_per_x: int) -> torch.Tensor:
    """``out[p] = weight[experts[p]] @ x[p // pairs_per_x]`` for every (token, slot) pair ``p``.

    ``x [R, H]`` (contiguous rows), ``weight [E, O, H]`` contiguous, ``experts`` ``[P]`` (any int dtype, flattened).
    Returns ``[P, O]`` in x.dtype.
    """
    experts = experts.reshape(-1)
    pairs = experts.shape[0]
    _, out_features, in_features = weight.shape
    if x.shape[1] != in_features or x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError(f"x must be [R, {in_features}] with contiguous rows and weight contiguous [E, O, H]")
    if x.shape[0] * pairs_per_x != pairs:
        raise ValueError(f"{x.shape[0]} input rows x {pairs_per_x} pairs each != {pairs} pairs")
    out = torch.empty((pairs, out_features), dtype=x.dtype, device=x.device)
    block_o = 16
    _expert_gemv_kernel[(pairs, triton.cdiv(out_features, block_o))](
        x, x.stride(0), weight, experts, out, out_features, in_features, pairs_per_x,
        BLOCK_O=block_o, BLOCK_H=min(512, next_power_of_2(in_features)), num_warps=4,
    )
    return out


@triton.jit
def _combine_kernel(
    expert_out_ptr, weights_ptr, shared_ptr, shared_stride, shared_gate_ptr, shared_gate_stride, out_ptr, hidden,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < hidden
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):
        w = tl.load(weights_ptr + token * TOP_K + j)
        acc += w * tl.load(expert_out_ptr + (token * TOP_K + j) * hidden + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_SHARED:
        gate = tl.sigmoid(tl.load(shared_gate_ptr + token * shared_gate_stride).to(tl.float32))
        acc += gate * tl.load(shared_ptr + token * shared_stride + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=valid)


def combine_experts(
    expert_out: torch.Tensor,
    weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate_logit: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_j weights[n, j] * expert_out[n*k + j] + sigmoid(shared_gate_logit[n]) * shared[n]`` -> ``[N, H]``.

    ``expert_out [N*k, H]``, ``weights [N, k]`` fp32, ``shared [N, H]``, ``shared_gate_logit [N, 1]`` (strided ok).
    """
    tokens, top_k = weights.shape
    hidden = expert_out.shape[1]
    if expert_out.shape[0] != tokens * top_k or not expert_out.is_contiguous():
        raise ValueError(f"expert_out must be a contiguous [{tokens * top_k}, H]")
    has_shared = shared is not None
    if has_shared and (shared_gate_logit is None or shared.shape != (tokens, hidden) or shared.stride(1) != 1):
        raise ValueError("the shared expert needs shared [N, H] with contiguous rows and its gate logit [N, 1]")
    out = torch.empty((tokens, hidden), dtype=expert_out.dtype, device=expert_out.device)
    block = min(1024, next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        expert_out, weights,
        shared if has_shared else expert_out, shared.stride(0) if has_shared else 0,
        shared_gate_logit if has_shared else weights, shared_gate_logit.stride(0) if has_shared else 0,
        out, hidden, TOP_K=top_k, HAS_SHARED=has_shared, BLOCK=block,
    )
    return out
