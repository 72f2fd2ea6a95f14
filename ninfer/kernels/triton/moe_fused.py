"""The whole routed + shared MoE block of a small decode batch in two Triton launches (after the entry GEMM).

1. ``_route_gate_up_kernel``, one program per (token, slot, block of inner rows): top-k routing of the token's router
   logits (softmax in fp32, top-k, renormalised; every program recomputes it, it is 256 values), then the selected
   expert's gate and up GEMV rows and ``silu(gate) * up``. The first program of each token writes the routing.
2. ``_down_combine_kernel``, one program per (token, block of hidden rows): for each selected expert its down GEMV
   rows weighted by the routing weight, plus the shared expert (``silu(gate) * up`` of its entry-GEMM outputs, its
   down GEMV rows, scaled by ``sigmoid`` of its gate logit).

Only the selected experts' weights are read; expert ids stay on the device (fixed grids, no host sync), so both
launches are captured in the decode graph. Twin: ``ninfer.kernels.moe.moe_forward``; intermediate results are
rounded to the activation dtype where the twin rounds them (gate/up, the activation, each expert's output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton import next_power_of_2

GATE_UP_BLOCK_ROWS = 8  # inner rows per program of the first kernel (many programs even for one token)
DOWN_BLOCK_ROWS = 8  # hidden rows per program of the second kernel


@triton.jit
def _top_k_routing(
    logits_row, num_experts, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BLOCK_E: tl.constexpr
):
    """``(weights [TOP_K_PAD] fp32 renormalised, experts [TOP_K_PAD] int32)`` of one row of router logits."""
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    logits = tl.load(logits_row + e, mask=valid, other=float("-inf")).to(tl.float32)
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
    return chosen_weights / tl.sum(chosen_weights, axis=0), chosen_experts


@triton.jit
def _route_gate_up_kernel(
    x_ptr, x_stride, logits_ptr, logits_stride, gate_up_ptr, act_ptr, weights_ptr, experts_ptr,
    num_experts, hidden, inner,
    TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    token = pair // TOP_K
    slot = pair % TOP_K
    chosen_weights, chosen_experts = _top_k_routing(
        logits_ptr + token * logits_stride, num_experts, TOP_K, TOP_K_PAD, BLOCK_E
    )
    slots = tl.arange(0, TOP_K_PAD)
    first_program = (slots < TOP_K) & (slot == 0) & (block == 0)
    tl.store(weights_ptr + token * TOP_K + slots, chosen_weights, mask=first_program)
    tl.store(experts_ptr + token * TOP_K + slots, chosen_experts, mask=first_program)
    expert = tl.sum(tl.where(slots == slot, chosen_experts, 0), axis=0).to(tl.int64)

    rows = block * BLOCK_I + tl.arange(0, BLOCK_I)
    row_valid = rows < inner
    gate_rows = gate_up_ptr + expert * 2 * inner * hidden + rows[:, None].to(tl.int64) * hidden
    up_rows = gate_rows + inner * hidden
    x_row = x_ptr + token * x_stride
    gate = tl.zeros((BLOCK_I,), tl.float32)
    up = tl.zeros((BLOCK_I,), tl.float32)
    for first in range(0, hidden, BLOCK_H):
        cols = first + tl.arange(0, BLOCK_H)
        col_valid = cols < hidden
        mask = row_valid[:, None] & col_valid[None, :]
        x = tl.load(x_row + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        gate += tl.sum(tl.load(gate_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
        up += tl.sum(tl.load(up_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32) * x, axis=1)
    out_type = act_ptr.dtype.element_ty
    gate = gate.to(out_type).to(tl.float32)
    up = up.to(out_type).to(tl.float32)
    activated = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + pair * inner + rows, activated.to(out_type), mask=row_valid)


@triton.jit
def _down_combine_kernel(
    act_ptr, down_ptr, weights_ptr, experts_ptr,
    shared_ptr, shared_stride, shared_down_ptr, shared_gate_ptr, shared_gate_stride,
    out_ptr, hidden, inner, shared_inner,
    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    row_valid = rows < hidden
    out_type = out_ptr.dtype.element_ty
    total = tl.zeros((BLOCK_O,), tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(experts_ptr + token * TOP_K + j).to(tl.int64)
        weight = tl.load(weights_ptr + token * TOP_K + j)
        matrix = down_ptr + expert * hidden * inner + rows[:, None].to(tl.int64) * inner
        act_row = act_ptr + (token * TOP_K + j) * inner
        part = tl.zeros((BLOCK_O,), tl.float32)
        for first in range(0, inner, BLOCK_I):
            cols = first + tl.arange(0, BLOCK_I)
            col_valid = cols < inner
            w = tl.load(matrix + cols[None, :], mask=row_valid[:, None] & col_valid[None, :], other=0.0)
            a = tl.load(act_row + cols, mask=col_valid, other=0.0).to(tl.float32)
            part += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        total += weight * part.to(out_type).to(tl.float32)
    if HAS_SHARED:
        shared_row = shared_ptr + token * shared_stride
        matrix = shared_down_ptr + rows[:, None].to(tl.int64) * shared_inner
        part = tl.zeros((BLOCK_O,), tl.float32)
        for first in range(0, shared_inner, BLOCK_S):
            cols = first + tl.arange(0, BLOCK_S)
            col_valid = cols < shared_inner
            gate = tl.load(shared_row + cols, mask=col_valid, other=0.0).to(tl.float32)
            up = tl.load(shared_row + shared_inner + cols, mask=col_valid, other=0.0).to(tl.float32)
            a = (gate * tl.sigmoid(gate)).to(out_type).to(tl.float32) * up
            a = a.to(out_type).to(tl.float32)
            w = tl.load(matrix + cols[None, :], mask=row_valid[:, None] & col_valid[None, :], other=0.0)
            part += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        shared_gate = tl.sigmoid(tl.load(shared_gate_ptr + token * shared_gate_stride).to(tl.float32))
        total += shared_gate * part.to(out_type).to(tl.float32)
    tl.store(out_ptr + token * hidden + rows, total.to(out_type), mask=row_valid)


def fused_moe_decode(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    *,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_gate_logit: torch.Tensor | None = None,
) -> torch.Tensor:
    """``moe_forward`` for a small batch given the entry GEMM's outputs, in two launches.

    ``x [N, H]`` the normed input, ``router_logits [N, E]``, ``gate_up [E, 2I, H]`` (gate rows first) and
    ``down [E, H, I]`` contiguous; the optional shared expert takes ``shared_gate_up [N, 2S]`` (its gate and up
    projections of ``x``, gate first), ``shared_down [H, S]`` and ``shared_gate_logit [N, 1]``. Row-strided views
    (e.g. column slices of one fused entry GEMM) are fine. Returns ``[N, H]`` in ``x.dtype``.
    """
    tokens, hidden = x.shape
    num_experts, double_inner, weight_hidden = gate_up.shape
    inner = double_inner // 2
    if weight_hidden != hidden or x.stride(1) != 1:
        raise ValueError(f"x must be [N, {weight_hidden}] with contiguous rows; got {tuple(x.shape)}")
    if down.shape != (num_experts, hidden, inner) or not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError(f"gate_up [E, 2I, H] and down [{num_experts}, {hidden}, {inner}] must be contiguous")
    if router_logits.shape != (tokens, num_experts) or router_logits.stride(1) != 1:
        raise ValueError(f"router_logits must be [{tokens}, {num_experts}] with contiguous rows")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}; got {top_k}")
    has_shared = shared_gate_up is not None
    if has_shared:
        if shared_down is None or shared_gate_logit is None:
            raise ValueError("the shared expert needs shared_gate_up, shared_down and shared_gate_logit")
        shared_inner = shared_down.shape[1]
        if (
            shared_gate_up.shape != (tokens, 2 * shared_inner)
            or shared_gate_up.stride(1) != 1
            or shared_down.shape != (hidden, shared_inner)
            or not shared_down.is_contiguous()
            or shared_gate_logit.shape != (tokens, 1)
        ):
            raise ValueError("shared expert shapes: gate_up [N, 2S] (contiguous rows), down [H, S], gate logit [N, 1]")
    else:
        shared_inner = 1
    pairs = tokens * top_k
    activated = torch.empty((pairs, inner), dtype=x.dtype, device=x.device)
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=x.device)
    experts = torch.empty((tokens, top_k), dtype=torch.int32, device=x.device)
    _route_gate_up_kernel[(pairs, triton.cdiv(inner, GATE_UP_BLOCK_ROWS))](
        x, x.stride(0), router_logits, router_logits.stride(0), gate_up, activated, weights, experts,
        num_experts, hidden, inner,
        TOP_K=top_k, TOP_K_PAD=next_power_of_2(top_k), BLOCK_E=next_power_of_2(num_experts),
        BLOCK_I=GATE_UP_BLOCK_ROWS, BLOCK_H=min(512, next_power_of_2(hidden)), num_warps=4,
    )
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    _down_combine_kernel[(tokens, triton.cdiv(hidden, DOWN_BLOCK_ROWS))](
        activated, down, weights, experts,
        shared_gate_up if has_shared else activated, shared_gate_up.stride(0) if has_shared else 0,
        shared_down if has_shared else down,
        shared_gate_logit if has_shared else weights, shared_gate_logit.stride(0) if has_shared else 0,
        out, hidden, inner, shared_inner,
        TOP_K=top_k, HAS_SHARED=has_shared, BLOCK_O=DOWN_BLOCK_ROWS, BLOCK_I=min(512, next_power_of_2(inner)),
        BLOCK_S=min(512, next_power_of_2(shared_inner)), num_warps=4,
    )
    return out
