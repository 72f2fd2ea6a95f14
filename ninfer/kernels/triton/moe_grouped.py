"""The MoE block of a decode batch in three launches, each routed expert read once however many rows select it.

1. ``route_experts``: the router logits (and the shared expert's gate logit) as a GEMV over programs of
   (router rows, slice of the hidden dim); the last program to finish (an atomic counter it resets) adds the slices,
   routes every row (softmax in fp32, top-k, renormalised) and lists the distinct selected experts, ascending.
   ``route_experts_add_norm`` / ``grouped_moe_decode_add_norm``: the router's programs also do the block's residual
   add and RMSNorm (``norm_gemv``'s helpers: each program norms the whole rows; the programs of the first block of
   router rows, one per hidden slice, write their slice of the new residual stream and of the normed rows the next
   two launches read), so no add+RMSNorm launch precedes it.
2. ``grouped_gate_up``: one program per (listed expert, block of inner rows), plus the shared expert's programs: it
   streams the expert's gate and up rows once, multiplies them with every row that selected the expert and writes
   ``silu(gate) * up`` for each such (row, slot) pair.
3. ``grouped_down``: one program per (block of hidden rows, listed expert or the shared one) writes that expert's
   output rows for the rows that selected it; the last program of each hidden block (a counter per block) adds
   them up with the routing weights and ``sigmoid`` of the shared expert's gate logit, in a fixed order. (One
   program per hidden block looping over the experts itself measured slower on the H200 even at one row.)

With programmatic dependent launch (``MoETiles.pdl``, sm_90+) each kernel is launched while its predecessor drains
and waits (``griddepcontrol.wait``) before reading what that one wrote; before the wait each program loads the
weights it can already name, so they stream while the predecessor drains: the router its rows, the shared expert's
gate/up programs their tiles, and the down programs their expert's tile (the routing is final by then: the gate/up
kernel lets the down kernel launch only after its own wait for the router). Grids are fixed per batch size (sized for
``min(rows * k, E)`` experts; programs past the listed count do nothing) and expert ids never leave the device, so
everything is captured in the decode graph. Sums are deterministic (no atomics on data). One row multiplies with
FMA reductions; more rows pad to a ``tl.dot`` tile of >= 16 rows, rows that did not select the expert are not read.
Twin: ``ninfer.kernels.reference.moe.moe_forward``; results are rounded to the
activation dtype where the twin rounds them (router and gate logits, gate/up, the activation, each expert's output).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from ninfer.kernels.triton import next_power_of_2
from ninfer.kernels.triton.norm_gemv import (
    accumulate,
    after_predecessor,
    dot_normed_rows_from,
    inverse_rms,
    launch_options,
    norm_weights,
    pdl_supported,
    token_block,
    weight_tile,
)

MAX_TOKENS = 64  # rows one call takes: the routing of all rows runs in one program


@attrs.frozen
class MoETiles:
    """Launch shapes of the three kernels."""

    router_rows: int = 16  # router rows per program
    router_split: int = 1  # programs along the hidden dim (partial sums, added by the last program)
    router_block_k: int = 256
    router_warps: int = 4
    gate_up_rows: int = 16  # gate rows (and as many up rows) per program
    gate_up_block_k: int = 512
    gate_up_warps: int = 4
    gate_up_stages: int = 3
    down_rows: int = 16  # hidden rows per program
    down_block_k: int = 512
    down_warps: int = 4
    down_stages: int = 3
    pdl: bool = False  # programmatic dependent launch: a kernel starts while its predecessor drains (sm_90+)


def default_tiles(tokens: int, device: torch.device | str = "cpu") -> MoETiles:
    """The tiles for a batch of ``tokens`` rows on ``device``: the fastest measured on an H200.

    One row (FMA reductions): a router GEMV in 264 one-warp programs, gate/up programs of 4+4 full-width rows,
    down programs of 16 rows. More rows (``tl.dot``): wider tiles, software-pipelined. PDL on sm_90 and newer.
    """
    pdl = pdl_supported(device)
    if tokens == 1:
        return MoETiles(
            router_rows=8, router_split=8, router_block_k=256, router_warps=1,
            gate_up_rows=4, gate_up_block_k=2048, gate_up_warps=4, down_rows=16, pdl=pdl,
        )
    return MoETiles(router_split=4, gate_up_rows=32, gate_up_block_k=256, down_rows=32, down_stages=2, pdl=pdl)


def workspace_size(hidden: int) -> int:
    """int32 entries of the counters one call uses: the router's and one per block of hidden rows."""
    return 1 + hidden


def moe_workspace(hidden: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed counters for ``grouped_moe_decode``; every call leaves them zeroed, so one serves a stream forever."""
    return torch.zeros(workspace_size(hidden), dtype=torch.int32, device=device)


@attrs.frozen
class Routing:
    """What ``route_experts`` leaves on the device for the next two launches."""

    logits: torch.Tensor  # [N, E + 1] fp32: router logits, then the shared expert's gate logit (if any)
    weights: torch.Tensor  # [N, k] fp32, summing to 1
    experts: torch.Tensor  # [N, k] int32
    active: torch.Tensor  # [min(N*k, E)] int32: the distinct selected experts, ascending, then unused entries
    count: torch.Tensor  # [1] int32: how many entries of ``active`` are used


@triton.jit
def _x_tile(x_rows, token_valid, first, stop, BLOCK_K: tl.constexpr):
    """The activation rows' columns ``[first, first + BLOCK_K)`` (zero past ``stop``)."""
    cols = first + tl.arange(0, BLOCK_K)
    return tl.load(x_rows[:, None] + cols[None, :], mask=token_valid[:, None] & (cols < stop)[None, :], other=0.0)


@triton.jit
def _dot_rows_from(
    first_tile, x_rows, token_valid, w_rows, row_valid, start, stop,
    TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``[TOKENS, ROWS]`` fp32 sums over columns ``[start, stop)`` of ``x[t] * w[r]`` (pointers at row starts); the
    first step multiplies ``first_tile`` (``weight_tile`` at ``start``, loaded before the predecessor wait)."""
    acc = accumulate(
        tl.zeros((TOKENS, ROWS), tl.float32), _x_tile(x_rows, token_valid, start, stop, BLOCK_K), first_tile, TOKENS
    )
    for first in range(start + BLOCK_K, stop, BLOCK_K):
        w = weight_tile(w_rows, row_valid, first, stop, BLOCK_K)
        acc = accumulate(acc, _x_tile(x_rows, token_valid, first, stop, BLOCK_K), w, TOKENS)
    return acc


@triton.jit
def _dot_row_pairs_from(
    first_a, first_b, x_rows, token_valid, a_rows, b_rows, row_valid, width,
    TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``_dot_rows_from`` over ``[0, width)`` for two sets of weight rows at once (gate and up)."""
    x = _x_tile(x_rows, token_valid, 0, width, BLOCK_K)
    acc_a = accumulate(tl.zeros((TOKENS, ROWS), tl.float32), x, first_a, TOKENS)
    acc_b = accumulate(tl.zeros((TOKENS, ROWS), tl.float32), x, first_b, TOKENS)
    for first in range(BLOCK_K, width, BLOCK_K):
        w_a = weight_tile(a_rows, row_valid, first, width, BLOCK_K)
        w_b = weight_tile(b_rows, row_valid, first, width, BLOCK_K)
        x = _x_tile(x_rows, token_valid, first, width, BLOCK_K)
        acc_a = accumulate(acc_a, x, w_a, TOKENS)
        acc_b = accumulate(acc_b, x, w_b, TOKENS)
    return acc_a, acc_b


@triton.jit
def _load_routing(experts_ptr, weights_ptr, tokens, TOKENS: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr):
    """The ``[TOKENS, TOP_K_PAD]`` tiles of selected experts (-1 where padded) and their routing weights (read
    through L2: the down kernel reads them before its predecessor wait)."""
    t = tl.arange(0, TOKENS)
    j = tl.arange(0, TOP_K_PAD)
    valid = (t < tokens)[:, None] & (j < TOP_K)[None, :]
    chosen = tl.load(experts_ptr + t[:, None] * TOP_K + j[None, :], mask=valid, other=-1, cache_modifier=".cg")
    weights = tl.load(weights_ptr + t[:, None] * TOP_K + j[None, :], mask=valid, other=0.0, cache_modifier=".cg")
    return chosen, weights


@triton.jit
def _rows_of_expert(chosen, weights, expert, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr):
    """Per token row: whether it selected ``expert``, its (row, slot) pair index and its routing weight (else 0)."""
    j = tl.arange(0, TOP_K_PAD)
    match = chosen == expert
    uses = tl.max(match.to(tl.int32), axis=1) > 0
    slot = tl.sum(tl.where(match, j[None, :], 0), axis=1)
    weight = tl.sum(tl.where(match, weights, 0.0), axis=1)
    pair = tl.arange(0, chosen.shape[0]) * TOP_K + slot
    return uses, pair, weight


@triton.jit
def _finish_routing(
    partials_ptr, logits_ptr, weights_ptr, experts_ptr, active_ptr, count_ptr, tokens, num_experts,
    ACT: tl.constexpr, TOKENS: tl.constexpr, SPLIT: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr, HAS_GATE: tl.constexpr,
):
    """Add the router's partial sums, route every row and list the selected experts (run by one program)."""
    stride = num_experts + 1
    t = tl.arange(0, TOKENS)
    e = tl.arange(0, BLOCK_E)
    token_valid = t < tokens
    valid = token_valid[:, None] & (e < num_experts)[None, :]
    logits = tl.zeros((TOKENS, BLOCK_E), tl.float32)
    for part in tl.static_range(SPLIT):  # written by other programs: read through L2, not L1
        offsets = (part * tokens + t)[:, None] * stride + e[None, :]
        logits += tl.load(partials_ptr + offsets, mask=valid, other=0.0, cache_modifier=".cg")
    logits = logits.to(ACT).to(tl.float32)  # the twin's logits are activations
    tl.store(logits_ptr + t[:, None] * stride + e[None, :], logits, mask=valid)
    if HAS_GATE:
        gate = tl.zeros((TOKENS,), tl.float32)
        for part in tl.static_range(SPLIT):
            offsets = (part * tokens + t) * stride + num_experts
            gate += tl.load(partials_ptr + offsets, mask=token_valid, other=0.0, cache_modifier=".cg")
        tl.store(logits_ptr + t * stride + num_experts, gate.to(ACT).to(tl.float32), mask=token_valid)
    logits = tl.where(valid, logits, float("-inf"))
    row_max = tl.where(token_valid, tl.max(logits, axis=1), 0.0)
    probabilities = tl.exp(logits - row_max[:, None])
    probabilities = probabilities / tl.maximum(tl.sum(probabilities, axis=1), 1e-30)[:, None]
    probabilities = tl.where(valid, probabilities, -1.0)
    slots = tl.arange(0, TOP_K_PAD)
    chosen_weights = tl.zeros((TOKENS, TOP_K_PAD), tl.float32)
    chosen_experts = tl.zeros((TOKENS, TOP_K_PAD), tl.int32)
    present = tl.zeros((BLOCK_E,), tl.int32)
    for j in tl.static_range(TOP_K):
        best_weight, best = tl.max(probabilities, axis=1, return_indices=True)
        chosen_weights = tl.where(slots[None, :] == j, best_weight[:, None], chosen_weights)
        chosen_experts = tl.where(slots[None, :] == j, best[:, None], chosen_experts)
        hit = (e[None, :] == best[:, None]) & token_valid[:, None]
        present = tl.maximum(present, tl.max(hit.to(tl.int32), axis=0))
        probabilities = tl.where(hit, -1.0, probabilities)
    chosen_weights = chosen_weights / tl.sum(chosen_weights, axis=1)[:, None]
    keep = token_valid[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + t[:, None] * TOP_K + slots[None, :], chosen_weights, mask=keep)
    tl.store(experts_ptr + t[:, None] * TOP_K + slots[None, :], chosen_experts, mask=keep)
    tl.store(active_ptr + tl.cumsum(present, axis=0) - 1, e, mask=present > 0)
    tl.store(count_ptr, tl.sum(present, axis=0))


@triton.jit
def _router_kernel(
    x_ptr, x_stride, pending_ptr, pending_stride, norm_weight_ptr, hidden_out_ptr, normed_out_ptr, eps,
    router_ptr, gate_ptr, partials_ptr, logits_ptr, weights_ptr, experts_ptr, active_ptr,
    count_ptr, counter_ptr, tokens, num_experts, hidden, slice_width,
    TOKENS: tl.constexpr, ROUTE_TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
    HAS_GATE: tl.constexpr, NORM: tl.constexpr, HAS_PENDING: tl.constexpr, PDL: tl.constexpr,
):
    stride = num_experts + 1
    part = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_valid = rows < num_experts + HAS_GATE
    w_rows = tl.where(rows < num_experts, router_ptr + rows.to(tl.int64) * hidden, gate_ptr)
    start = part * slice_width
    stop = tl.minimum(start + slice_width, hidden)
    first_tile = weight_tile(w_rows, row_valid, start, stop, BLOCK_K)
    first_cols = start + tl.arange(0, BLOCK_K)
    first_weights = norm_weights(norm_weight_ptr, first_cols, (first_cols < stop) & NORM)
    after_predecessor(PDL)  # the router rows are not the predecessor's: their first tile is already on its way
    t = tl.arange(0, TOKENS)
    token_valid = t < tokens
    x_rows = x_ptr + t * x_stride
    if NORM:  # x is the residual stream: multiply rms_norm(x + pending); the first row block writes its slice
        pending_rows = pending_ptr + t * pending_stride
        rstd = inverse_rms(x_rows, pending_rows, token_valid, hidden, eps, HAS_PENDING, TOKENS, BLOCK_K)
        partial = dot_normed_rows_from(
            first_tile, first_weights, x_rows, pending_rows, norm_weight_ptr, rstd, token_valid, w_rows, row_valid,
            start, stop,
            hidden_out_ptr + t * hidden, normed_out_ptr + t * hidden, tl.program_id(0) == 0, HAS_PENDING, True,
            TOKENS, ROWS, BLOCK_K,
        )
    else:
        partial = _dot_rows_from(first_tile, x_rows, token_valid, w_rows, row_valid, start, stop, TOKENS, ROWS, BLOCK_K)
    offsets = (part * tokens + t)[:, None] * stride + rows[None, :]
    tl.store(partials_ptr + offsets, partial, mask=token_valid[:, None] & row_valid[None, :])
    tl.debug_barrier()  # every thread's partial sums are written before the release below
    finished = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) * SPLIT - 1:  # the last program: every partial sum is visible
        _finish_routing(
            partials_ptr, logits_ptr, weights_ptr, experts_ptr, active_ptr, count_ptr, tokens, num_experts,
            x_ptr.dtype.element_ty, ROUTE_TOKENS, SPLIT, TOP_K, TOP_K_PAD, BLOCK_E, HAS_GATE,
        )
        tl.atomic_xchg(counter_ptr, 0)  # ready for the next launch


def _workspace(workspace: torch.Tensor | None, hidden: int, device: torch.device) -> torch.Tensor:
    if workspace is None:
        return moe_workspace(hidden, device)
    if workspace.dtype != torch.int32 or workspace.numel() < workspace_size(hidden):
        raise ValueError(f"workspace must be a zeroed int32 tensor of >= {workspace_size(hidden)} entries")
    return workspace


def route_experts(
    x: torch.Tensor,
    router: torch.Tensor,
    top_k: int,
    *,
    shared_expert_gate: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    tiles: MoETiles | None = None,
) -> Routing:
    """Router logits of ``x [N, H]`` (``router [E, H]``, ``shared_expert_gate [1, H]``), routing, selected experts.

    ``workspace``: see ``moe_workspace`` (a fresh one if None).
    """
    return _route(x, None, None, 0.0, router, top_k, shared_expert_gate, workspace, tiles)[0]


def route_experts_add_norm(
    hidden: torch.Tensor,
    pending: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    top_k: int,
    *,
    shared_expert_gate: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    tiles: MoETiles | None = None,
) -> tuple[Routing, torch.Tensor, torch.Tensor]:
    """``route_experts`` of ``normed = rms_norm(hidden + pending) * (1 + norm_weight)`` with the residual add and
    the norm done by the router's own programs (no separate add+RMSNorm launch).

    Returns ``(routing, new hidden, normed)``: ``hidden + pending`` (``hidden`` itself without ``pending``) and the
    normed rows, both rounded to ``hidden.dtype`` as ``add_rms_norm`` rounds them, for the expert kernels.
    """
    tokens, width = hidden.shape
    if pending is not None and (pending.shape != hidden.shape or pending.stride(1) != 1):
        raise ValueError(f"pending must be [{tokens}, {width}] with contiguous rows; got {tuple(pending.shape)}")
    if norm_weight.shape != (width,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be a contiguous [{width}]; got {tuple(norm_weight.shape)}")
    return _route(hidden, pending, norm_weight, eps, router, top_k, shared_expert_gate, workspace, tiles)


def check_router(router: torch.Tensor, shared_expert_gate: torch.Tensor | None, top_k: int, hidden: int) -> int:
    """The expert count of a valid router ``[E, H]`` (contiguous), optional shared expert gate ``[1, H]`` and
    ``top_k`` in ``1..E``; raises ``ValueError`` naming the bad argument otherwise."""
    num_experts = router.shape[0]
    if router.shape[1] != hidden or router.stride() != (hidden, 1):
        raise ValueError(f"router must be a contiguous [E, {hidden}]; got {tuple(router.shape)}")
    if shared_expert_gate is not None and (
        shared_expert_gate.shape != (1, hidden) or shared_expert_gate.stride(1) != 1
    ):
        raise ValueError(f"shared_expert_gate must be [1, {hidden}]; got {tuple(shared_expert_gate.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in 1..{num_experts}; got {top_k}")
    return num_experts


def _route(
    x: torch.Tensor,
    pending: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    router: torch.Tensor,
    top_k: int,
    shared_expert_gate: torch.Tensor | None,
    workspace: torch.Tensor | None,
    tiles: MoETiles | None,
) -> tuple[Routing, torch.Tensor, torch.Tensor]:
    """Launch the router over ``x``, or with ``norm_weight`` over the add+norm of ``x`` (the residual stream) and
    ``pending``; returns ``(routing, new hidden, normed)`` (``x`` for both without the norm)."""
    tokens, hidden = x.shape
    if not 1 <= tokens <= MAX_TOKENS or x.stride(1) != 1:
        raise ValueError(f"x must be [N <= {MAX_TOKENS}, H] with contiguous rows; got {tuple(x.shape)}")
    num_experts = check_router(router, shared_expert_gate, top_k, hidden)
    has_gate = shared_expert_gate is not None
    tiles = tiles or default_tiles(tokens, x.device)
    device = x.device
    counters = _workspace(workspace, hidden, device)
    routing = Routing(
        logits=torch.empty((tokens, num_experts + 1), dtype=torch.float32, device=device),
        weights=torch.empty((tokens, top_k), dtype=torch.float32, device=device),
        experts=torch.empty((tokens, top_k), dtype=torch.int32, device=device),
        active=torch.empty(min(tokens * top_k, num_experts), dtype=torch.int32, device=device),
        count=torch.empty(1, dtype=torch.int32, device=device),
    )
    norm = norm_weight is not None
    has_pending = norm and pending is not None
    new_hidden = torch.empty_like(x) if has_pending else x
    normed = torch.empty_like(x) if norm else x
    split = tiles.router_split
    partials = torch.empty((split, tokens, num_experts + 1), dtype=torch.float32, device=device)
    block_k = min(tiles.router_block_k, next_power_of_2(hidden))
    slice_width = triton.cdiv(triton.cdiv(hidden, split), block_k) * block_k
    _router_kernel[(triton.cdiv(num_experts + has_gate, tiles.router_rows), split)](
        x, x.stride(0), pending if has_pending else x, pending.stride(0) if has_pending else 0,
        norm_weight if norm else x, new_hidden, normed, eps,
        router, shared_expert_gate if has_gate else router, partials, routing.logits,
        routing.weights, routing.experts, routing.active, routing.count, counters, tokens, num_experts, hidden,
        slice_width,
        TOKENS=token_block(tokens, tiles.router_rows), ROUTE_TOKENS=next_power_of_2(tokens),
        ROWS=tiles.router_rows, BLOCK_K=block_k, SPLIT=split, TOP_K=top_k, TOP_K_PAD=next_power_of_2(top_k),
        BLOCK_E=next_power_of_2(num_experts), HAS_GATE=has_gate, NORM=norm, HAS_PENDING=has_pending, PDL=tiles.pdl,
        num_warps=tiles.router_warps, **launch_options(tiles.pdl),
    )
    return routing, new_hidden, normed


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, x_stride, gate_up_ptr, shared_gate_up_ptr, act_ptr, shared_act_ptr, experts_ptr, weights_ptr,
    active_ptr, count_ptr, tokens, hidden, inner, shared_inner,
    TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr, MAX_GROUPS: tl.constexpr, PDL: tl.constexpr,
):
    group = tl.program_id(0)
    t = tl.arange(0, TOKENS)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    # a listed expert, or the shared one (selects rather than branches keep the pointers' alignment known); the
    # shared expert's programs load their first gate and up tiles before waiting for the router
    shared = group >= MAX_GROUPS
    shared_rows = shared_gate_up_ptr + rows.to(tl.int64) * hidden
    shared_valid = (rows < shared_inner) & shared
    first_gate = weight_tile(shared_rows, shared_valid, 0, hidden, BLOCK_K)
    first_up = weight_tile(shared_rows + shared_inner * hidden, shared_valid, 0, hidden, BLOCK_K)
    after_predecessor(PDL)
    run = (group < tl.load(count_ptr)) | shared
    expert = tl.load(active_ptr + group, mask=run & ~shared, other=0).to(tl.int64)
    chosen, weights = _load_routing(experts_ptr, weights_ptr, tokens, TOKENS, TOP_K, TOP_K_PAD)
    uses, pair, _ = _rows_of_expert(chosen, weights, expert, TOP_K, TOP_K_PAD)
    uses = tl.where(shared, t < tokens, uses)
    width = tl.where(shared, shared_inner, inner)
    weight_base = tl.where(shared, shared_gate_up_ptr, gate_up_ptr + expert * 2 * inner * hidden)
    out_rows = tl.where(shared, shared_act_ptr + t.to(tl.int64) * shared_inner, act_ptr + pair.to(tl.int64) * inner)
    if run:
        row_valid = rows < width
        gate_rows = weight_base + rows.to(tl.int64) * hidden
        routed_valid = row_valid & ~shared  # a routed expert's first tiles (masked loads are zero: sums are exact)
        first_gate += weight_tile(gate_rows, routed_valid, 0, hidden, BLOCK_K)
        first_up += weight_tile(gate_rows + width * hidden, routed_valid, 0, hidden, BLOCK_K)
        gate, up = _dot_row_pairs_from(
            first_gate, first_up, x_ptr + t * x_stride, uses, gate_rows, gate_rows + width * hidden, row_valid,
            hidden, TOKENS, ROWS, BLOCK_K,
        )
        out_type = act_ptr.dtype.element_ty
        gate = gate.to(out_type).to(tl.float32)
        up = up.to(out_type).to(tl.float32)
        activated = (gate * tl.sigmoid(gate)).to(out_type).to(tl.float32) * up
        tl.store(out_rows[:, None] + rows[None, :], activated.to(out_type), mask=uses[:, None] & row_valid[None, :])


def grouped_gate_up(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    routing: Routing,
    *,
    shared_gate_up: torch.Tensor | None = None,
    tiles: MoETiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(act [N*k, I], shared_act [N, S] or None)``: ``silu(gate) * up`` of every selected (row, slot) pair.

    ``gate_up [E, 2I, H]`` contiguous (gate rows first); ``shared_gate_up [2S, H]`` (gate rows, then up rows).
    """
    tokens, hidden = x.shape
    _, double_inner, weight_hidden = gate_up.shape
    inner = double_inner // 2
    if weight_hidden != hidden or not gate_up.is_contiguous() or x.stride(1) != 1:
        raise ValueError(f"gate_up must be a contiguous [E, 2I, {hidden}] and x [N, {hidden}] with contiguous rows")
    has_shared = shared_gate_up is not None
    if has_shared and (shared_gate_up.shape[1] != hidden or shared_gate_up.stride() != (hidden, 1)):
        raise ValueError(f"shared_gate_up must be a contiguous [2S, {hidden}]; got {tuple(shared_gate_up.shape)}")
    shared_inner = shared_gate_up.shape[0] // 2 if has_shared else 0
    top_k = routing.experts.shape[1]
    tiles = tiles or default_tiles(tokens, x.device)
    act = torch.empty((tokens * top_k, inner), dtype=x.dtype, device=x.device)
    shared_act = torch.empty((tokens, shared_inner), dtype=x.dtype, device=x.device) if has_shared else None
    max_groups = routing.active.shape[0]
    _grouped_gate_up_kernel[(max_groups + has_shared, triton.cdiv(max(inner, shared_inner), tiles.gate_up_rows))](
        x, x.stride(0), gate_up, shared_gate_up if has_shared else gate_up, act, shared_act if has_shared else act,
        routing.experts, routing.weights, routing.active, routing.count, tokens, hidden, inner, shared_inner,
        TOKENS=token_block(tokens, tiles.gate_up_rows), ROWS=tiles.gate_up_rows,
        BLOCK_K=min(tiles.gate_up_block_k, next_power_of_2(hidden)), TOP_K=top_k, TOP_K_PAD=next_power_of_2(top_k),
        MAX_GROUPS=max_groups, PDL=tiles.pdl, num_warps=tiles.gate_up_warps, num_stages=tiles.gate_up_stages,
        **launch_options(tiles.pdl),
    )
    return act, shared_act


@triton.jit
def _grouped_down_kernel(
    act_ptr, down_ptr, shared_act_ptr, shared_down_ptr, logits_ptr, experts_ptr, weights_ptr, active_ptr,
    count_ptr, pair_out_ptr, counters_ptr, out_ptr, tokens, hidden, inner, shared_inner, num_experts,
    TOKENS: tl.constexpr, ROUTE_TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
    TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, MAX_GROUPS: tl.constexpr, HAS_SHARED: tl.constexpr,
    PDL: tl.constexpr,
):
    block = tl.program_id(0)
    group = tl.program_id(1)
    rows = block * ROWS + tl.arange(0, ROWS)
    row_valid = rows < hidden
    t = tl.arange(0, TOKENS)
    out_type = out_ptr.dtype.element_ty
    # The routing is final before this kernel starts (its predecessor, the gate/up kernel, let it launch only after
    # waiting for the router), so the expert and its first weight tile load before the wait for gate/up.
    shared = group >= MAX_GROUPS  # the shared expert: its outputs follow the pairs'
    run = (group < tl.load(count_ptr, cache_modifier=".cg")) | shared
    expert = tl.load(active_ptr + group, mask=run & ~shared, other=0, cache_modifier=".cg").to(tl.int64)
    chosen, weights = _load_routing(experts_ptr, weights_ptr, tokens, TOKENS, TOP_K, TOP_K_PAD)
    uses, pair, _ = _rows_of_expert(chosen, weights, expert, TOP_K, TOP_K_PAD)
    uses = tl.where(shared, t < tokens, uses)
    pair = tl.where(shared, tokens * TOP_K + t, pair).to(tl.int64)
    width = tl.where(shared, shared_inner, inner)
    w_rows = tl.where(shared, shared_down_ptr, down_ptr + expert * hidden * inner) + rows.to(tl.int64) * width
    x_rows = tl.where(shared, shared_act_ptr + t.to(tl.int64) * shared_inner, act_ptr + pair * inner)
    out_rows = pair_out_ptr + pair * hidden
    first_tile = weight_tile(w_rows, row_valid & run, 0, width, BLOCK_K)
    after_predecessor(PDL)
    if run:
        y = _dot_rows_from(first_tile, x_rows, uses, w_rows, row_valid, 0, width, TOKENS, ROWS, BLOCK_K)
        tl.store(out_rows[:, None] + rows[None, :], y.to(out_type), mask=uses[:, None] & row_valid[None, :])
    tl.debug_barrier()
    finished = tl.atomic_add(counters_ptr + block, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(1) - 1:  # the last program of this block of hidden rows adds them up
        n = tl.arange(0, ROUTE_TOKENS)
        token_valid = n < tokens
        mask = token_valid[:, None] & row_valid[None, :]
        total = tl.zeros((ROUTE_TOKENS, ROWS), tl.float32)
        for j in tl.static_range(TOP_K):
            weight = tl.load(weights_ptr + n * TOP_K + j, mask=token_valid, other=0.0)
            offsets = (n * TOP_K + j).to(tl.int64)[:, None] * hidden + rows[None, :]
            part = tl.load(pair_out_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            total += weight[:, None] * part.to(tl.float32)
        if HAS_SHARED:
            gate = tl.sigmoid(tl.load(logits_ptr + n * (num_experts + 1) + num_experts, mask=token_valid, other=0.0))
            offsets = (tokens * TOP_K + n).to(tl.int64)[:, None] * hidden + rows[None, :]
            part = tl.load(pair_out_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg")
            total += gate[:, None] * part.to(tl.float32)
        tl.store(out_ptr + n[:, None] * hidden + rows[None, :], total.to(out_type), mask=mask)
        tl.atomic_xchg(counters_ptr + block, 0)


def grouped_down(
    act: torch.Tensor,
    down: torch.Tensor,
    routing: Routing,
    *,
    shared_act: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    tiles: MoETiles | None = None,
) -> torch.Tensor:
    """The block output ``[N, H]``: routed experts' down projections weighted by routing, plus the gated shared one.

    ``act [N*k, I]`` from ``grouped_gate_up``, ``down [E, H, I]`` contiguous, ``shared_down [H, S]`` contiguous.
    """
    tokens, top_k = routing.experts.shape
    num_experts, hidden, inner = down.shape
    if act.shape != (tokens * top_k, inner) or not act.is_contiguous() or not down.is_contiguous():
        raise ValueError(f"act must be a contiguous [{tokens * top_k}, {inner}] and down a contiguous [E, H, I]")
    has_shared = shared_act is not None
    if has_shared and (
        shared_down is None or shared_down.shape != (hidden, shared_act.shape[1]) or not shared_down.is_contiguous()
    ):
        raise ValueError(f"the shared expert needs shared_down as a contiguous [{hidden}, S]")
    tiles = tiles or default_tiles(tokens, act.device)
    shared_inner = shared_act.shape[1] if has_shared else 0
    max_groups = routing.active.shape[0]
    out = torch.empty((tokens, hidden), dtype=act.dtype, device=act.device)
    blocks = triton.cdiv(hidden, tiles.down_rows)
    common = dict(
        TOKENS=token_block(tokens, tiles.down_rows), ROWS=tiles.down_rows,
        BLOCK_K=min(tiles.down_block_k, next_power_of_2(max(inner, shared_inner))), TOP_K=top_k,
        TOP_K_PAD=next_power_of_2(top_k), MAX_GROUPS=max_groups, HAS_SHARED=has_shared, PDL=tiles.pdl,
        num_warps=tiles.down_warps, num_stages=tiles.down_stages, **launch_options(tiles.pdl),
    )
    shared_args = (shared_act, shared_down) if has_shared else (act, down)
    counters = _workspace(workspace, hidden, act.device)[1:]
    pair_out = torch.empty((tokens * (top_k + 1), hidden), dtype=act.dtype, device=act.device)
    _grouped_down_kernel[(blocks, max_groups + has_shared)](
        act, down, *shared_args, routing.logits, routing.experts, routing.weights, routing.active,
        routing.count, pair_out, counters, out, tokens, hidden, inner, shared_inner, num_experts,
        ROUTE_TOKENS=next_power_of_2(tokens), **common,
    )
    return out


def grouped_moe_decode(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    *,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_expert_gate: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    tiles: MoETiles | None = None,
) -> torch.Tensor:
    """``moe_forward`` of a decode batch ``x [N <= 64, H]`` in three launches; returns ``[N, H]`` in ``x.dtype``.

    Weights as in ``moe_forward``, except that the shared expert's gate and up rows come as one ``[2S, H]`` block
    (row views of one fused tensor are fine for ``router``, ``shared_gate_up`` and ``shared_expert_gate``).
    ``workspace``: zeroed counters from ``moe_workspace`` (one per stream, reused by every call; fresh if None).
    """
    _check_shared(shared_gate_up, shared_down, shared_expert_gate)
    workspace = _workspace(workspace, x.shape[1], x.device)
    routing = route_experts(
        x, router, top_k, shared_expert_gate=shared_expert_gate, workspace=workspace, tiles=tiles
    )
    return _experts(x, routing, gate_up, down, shared_gate_up, shared_down, workspace, tiles)


def grouped_moe_decode_add_norm(
    hidden: torch.Tensor,
    pending: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    *,
    shared_gate_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_expert_gate: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    tiles: MoETiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``grouped_moe_decode`` of ``rms_norm(hidden + pending) * (1 + norm_weight)``, the residual add and the norm
    done by the router launch (``route_experts_add_norm``): still three launches. Returns ``(block output, new
    hidden)``."""
    _check_shared(shared_gate_up, shared_down, shared_expert_gate)
    workspace = _workspace(workspace, hidden.shape[1], hidden.device)
    routing, new_hidden, normed = route_experts_add_norm(
        hidden, pending, norm_weight, eps, router, top_k, shared_expert_gate=shared_expert_gate,
        workspace=workspace, tiles=tiles,
    )
    return _experts(normed, routing, gate_up, down, shared_gate_up, shared_down, workspace, tiles), new_hidden


def _check_shared(*shared: torch.Tensor | None) -> None:
    if len({tensor is None for tensor in shared}) > 1:
        raise ValueError("the shared expert needs shared_gate_up, shared_down and shared_expert_gate together")


def _experts(
    x: torch.Tensor,
    routing: Routing,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    shared_gate_up: torch.Tensor | None,
    shared_down: torch.Tensor | None,
    workspace: torch.Tensor,
    tiles: MoETiles | None,
) -> torch.Tensor:
    """The grouped gate/up and down launches of a routed block."""
    act, shared_act = grouped_gate_up(x, gate_up, routing, shared_gate_up=shared_gate_up, tiles=tiles)
    return grouped_down(
        act, down, routing, shared_act=shared_act, shared_down=shared_down, workspace=workspace, tiles=tiles
    )
