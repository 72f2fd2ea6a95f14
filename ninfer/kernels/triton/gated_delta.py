"""Fused recurrent gated delta rule for decode / verify: gates, L2 norms, the state update and the gated output norm.

Twin: ``ninfer.kernels.reference.gated_delta.recurrent_gated_delta_rule`` followed by ``ninfer.kernels.reference.norms.gated_rms_norm``.
One program owns one (row, value head, block of value columns): the delta rule is independent per column of the
state (``S^T k`` and the update are per column), so ``value_split`` programs share a head's ``[Dk, Dv]`` fp32 state
(more programs for small batches). A program reads its columns of the row's state from its slot, runs the row's
``T`` tokens, optionally stores the state after every token (speculative verify), and writes its columns back in
place. The gated output norm needs a whole head: with one program per head it is fused, with a split the kernel
writes ``o`` and ``ninfer.kernels.triton.norms.gated_rms_norm`` normalises it in a second launch. The gates are
computed from the raw projections: ``beta = sigmoid(b)``, ``g = decay_rate * softplus(a + dt_bias)`` with
``decay_rate = -exp(A_log)``.

With programmatic dependent launch (sm_90+) a program loads its slot id, the head's gate parameters, the norm weight
and its fp32 state tile before ``griddepcontrol.wait``, and q/k/v, a, b, z (the predecessor's outputs) after it: the
state is written only by this kernel in an earlier step or by a rollback copy several kernels earlier, which have
finished by the time a dependent launch lets this kernel start, so the state streams while the conv drains.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.reference.gated_delta import L2_EPS
from ninfer.kernels.triton.norm_gemv import after_predecessor, launch_options, resolve_pdl
from ninfer.kernels.triton.norms import gated_rms_norm
from ninfer.kernels.triton.pending_state import PendingLayer, replay_pending


@triton.jit
def _gated_delta_kernel(
    qkv_ptr,
    qkv_stride,
    a_ptr,
    b_ptr,
    gate_stride,
    z_ptr,
    z_stride,
    decay_rate_ptr,
    dt_bias_ptr,
    norm_weight_ptr,
    state_ptr,
    slots_ptr,
    out_ptr,
    states_out_ptr,
    pending_keys_ptr,
    pending_deltas_ptr,
    pending_decays_ptr,
    pending_counts_ptr,
    tokens_per_row,
    scale,
    norm_eps,
    KEY_HEADS: tl.constexpr,
    VALUE_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    FUSE_NORM: tl.constexpr,
    STORE_STATES: tl.constexpr,
    L2EPS: tl.constexpr,
    PDL: tl.constexpr,
    PENDING: tl.constexpr,
):
    # PENDING > 0 (one token per row): the state's last updates wait in records of this capacity (``pending_state``)
    pid = tl.program_id(0)
    row = (pid // VALUE_HEADS).to(tl.int64)
    head = pid % VALUE_HEADS
    key_head = head // (VALUE_HEADS // KEY_HEADS)
    raw_slot = tl.load(slots_ptr + row).to(tl.int64)
    update = raw_slot >= 0  # a negative slot -1 - s reads slot s and leaves its state as it is
    slot = tl.where(update, raw_slot, -1 - raw_slot)
    dk = tl.arange(0, DK)
    dv = tl.program_id(1) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    tile = dk[:, None] * DV + dv[None, :]
    state_base = state_ptr + (slot * VALUE_HEADS + head) * (DK * DV)
    state = tl.load(state_base + tile)
    if PENDING > 0:
        record = slot * VALUE_HEADS + head
        count_at = pending_counts_ptr + record * tl.num_programs(1) + tl.program_id(1)
        count = tl.load(count_at)
        keys_at = pending_keys_ptr + record * (PENDING * DK)
        deltas_at = pending_deltas_ptr + record * (PENDING * DV)
        decays_at = pending_decays_ptr + record * PENDING
        state = replay_pending(state, keys_at, deltas_at, decays_at, count, dk, dv, PENDING, DK, DV)
    rate = tl.load(decay_rate_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    if FUSE_NORM:
        norm_weight = tl.load(norm_weight_ptr + dv).to(tl.float32)
    after_predecessor(PDL)  # none of the above is the predecessor's: the state tile is already on its way
    for t in range(tokens_per_row):
        token = row * tokens_per_row + t
        base = qkv_ptr + token * qkv_stride
        q = tl.load(base + key_head * DK + dk).to(tl.float32)
        k = tl.load(base + (KEY_HEADS + key_head) * DK + dk).to(tl.float32)
        v_raw = tl.load(base + 2 * KEY_HEADS * DK + head * DV + dv)
        v = v_raw.to(tl.float32)
        beta = tl.sigmoid(tl.load(b_ptr + token * gate_stride + head).to(tl.float32))
        x = tl.load(a_ptr + token * gate_stride + head).to(tl.float32) + dt_bias
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        decay = tl.exp(rate * softplus)
        # With k' = k * rk, q' = q * rq (the L2 norms, q's scaled) and S' = decay * S + k' delta^T, the prediction is
        # (decay * S)^T k' = decay * rk * S^T k and the output S'^T q' = decay * rq * S^T q + rk * rq * (k . q) *
        # delta: every reduction reads the loaded q, k and state, none waits for another (one level, was three).
        rk = tl.rsqrt(tl.sum(k * k, axis=0) + L2EPS)
        rq = tl.rsqrt(tl.sum(q * q, axis=0) + L2EPS) * scale
        kq = tl.sum(k * q, axis=0)
        state_k = tl.sum(state * k[:, None], axis=0)
        state_q = tl.sum(state * q[:, None], axis=0)
        delta = beta * (v - decay * rk * state_k)
        o = decay * rq * state_q + (rk * rq * kq) * delta
        state = state * decay + (k * rk)[:, None] * delta[None, :]
        if FUSE_NORM:
            z = tl.load(z_ptr + token * z_stride + head * DV + dv).to(tl.float32)
            o = o * tl.rsqrt(tl.sum(o * o, axis=0) / DV + norm_eps) * norm_weight * (z * tl.sigmoid(z))
        tl.store(out_ptr + (token * VALUE_HEADS + head) * DV + dv, o.to(v_raw.dtype))
        if STORE_STATES:
            tl.store(states_out_ptr + (token * VALUE_HEADS + head) * (DK * DV) + tile, state)
        if PENDING > 0:  # this update joins the record unless it is full
            append = update & (count < PENDING)
            tl.store(deltas_at + count * DV + dv, delta, mask=append & (dv >= 0))
            first_block = tl.program_id(1) == 0
            tl.store(keys_at + count * DK + dk, k * rk, mask=append & first_block & (dk >= 0))
            tl.store(decays_at + count, decay, mask=append & first_block)
    if PENDING > 0:  # a full record: the state is stored, and the record starts again
        full = count >= PENDING
        tl.store(state_base + tile, state, mask=(tile >= 0) & update & full)
        tl.store(count_at, tl.where(full, 0, count + 1), mask=update)
    else:
        tl.store(state_base + tile, state, mask=(tile >= 0) & update)


def fused_recurrent_gated_delta(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    decay_rate: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    key_heads: int,
    tokens_per_row: int = 1,
    z: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    scale: float | None = None,
    output_states: bool = False,
    states_out: torch.Tensor | None = None,
    value_split: int = 1,
    pdl: bool | None = None,
    pending: PendingLayer | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``tokens_per_row`` tokens of every row through the gated delta rule, updating ``ssm_cache`` in place.

    ``qkv [N, 2*Hk*Dk + Hv*Dv]`` is the conv output (q | k | v, N = rows * tokens_per_row, a row's tokens
    consecutive); ``a, b [N, Hv]`` the raw gate projections; ``ssm_cache [S, Hv, Dk, Dv]`` fp32; ``slots [rows]`` (a
    negative slot ``-1 - s`` reads slot ``s`` and leaves it as it is: ``ForwardBatch.state_update_stops``).
    With ``z [N, Hv*Dv]`` and ``norm_weight [Dv]`` the output is ``rms_norm(o) * w * silu(z)``, else ``o``.
    ``value_split`` programs share each head's value columns (it must divide Dv into powers of two).
    Returns ``(out [N, Hv, Dv] in qkv.dtype, states [N, Hv, Dk, Dv] fp32 or None)``. ``states_out`` (a contiguous
    fp32 ``[>= N, Hv, Dk, Dv]`` buffer, e.g. a CUDA graph's static one) implies ``output_states``: the states are
    written to its first N entries, which are returned. ``pdl``: programmatic dependent launch (None: wherever the
    device has it); then the kernel immediately before this one in the stream must not write ``ssm_cache``,
    ``slots``, ``decay_rate``, ``dt_bias`` or ``norm_weight``. ``pending`` (one token per row, no states out, its
    value split ``value_split``): ``ssm_cache``'s records of pending updates (``pending_state``), which the step
    replays before its token and appends its update to, storing the state only when the record is full.
    """
    tokens = qkv.shape[0]
    _, value_heads, key_dim, value_dim = ssm_cache.shape
    if ssm_cache.dtype != torch.float32 or not ssm_cache.is_contiguous():
        raise ValueError("ssm_cache must be a contiguous fp32 [S, Hv, Dk, Dv] tensor")
    if qkv.shape[1] != 2 * key_heads * key_dim + value_heads * value_dim or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [N, {2 * key_heads * key_dim + value_heads * value_dim}] with contiguous rows")
    rows = slots.shape[0]
    if rows * tokens_per_row != tokens:
        raise ValueError(f"{rows} rows x {tokens_per_row} tokens != {tokens} tokens")
    if a.stride() != b.stride() or a.shape != (tokens, value_heads) or a.stride(1) != 1:
        raise ValueError(f"a and b must be [N={tokens}, Hv={value_heads}] with the same strides")
    fuse_norm = z is not None
    if fuse_norm and (norm_weight is None or z.shape != (tokens, value_heads * value_dim) or z.stride(1) != 1):
        raise ValueError("the fused norm needs z [N, Hv*Dv] with contiguous rows and norm_weight [Dv]")
    block_dv = value_dim // value_split if value_split >= 1 and value_dim % value_split == 0 else 0
    if block_dv < 1 or block_dv & (block_dv - 1) or key_dim & (key_dim - 1):
        raise ValueError(f"value_split={value_split} must cut Dv={value_dim} (and Dk={key_dim}) into powers of two")
    if pending is not None and (
        tokens_per_row != 1 or output_states or states_out is not None or pending.value_split != value_split
        or pending.keys.shape[:2] != ssm_cache.shape[:2] or pending.keys.shape[3] != key_dim
    ):
        raise ValueError("pending updates need one token per row, no states out, the records' value split and "
                         "records of the cache's slots and heads")
    norm_apart = fuse_norm and value_split > 1  # the norm needs whole heads: a second launch
    out = torch.empty((tokens, value_heads, value_dim), dtype=qkv.dtype, device=qkv.device)
    if states_out is not None:
        if (
            states_out.dtype != torch.float32 or not states_out.is_contiguous() or states_out.shape[0] < tokens
            or tuple(states_out.shape[1:]) != (value_heads, key_dim, value_dim)
        ):
            raise ValueError(f"states_out must be a contiguous fp32 [>= {tokens}, Hv, Dk, Dv] tensor")
        output_states = True
        states: torch.Tensor | None = states_out[:tokens]
    elif output_states:
        states = torch.empty((tokens, value_heads, key_dim, value_dim), dtype=torch.float32, device=qkv.device)
    else:
        states = None
    pdl = resolve_pdl(pdl, qkv.device)
    scale = key_dim**-0.5 if scale is None else scale
    _gated_delta_kernel[(rows * value_heads, value_split)](
        qkv, qkv.stride(0), a, b, a.stride(0),
        z if fuse_norm else qkv, z.stride(0) if fuse_norm else 0,
        decay_rate, dt_bias, norm_weight if fuse_norm else decay_rate,
        ssm_cache, slots, out, states if output_states else out,
        *((pending.keys, pending.deltas, pending.decays, pending.counts) if pending is not None else (out,) * 4),
        tokens_per_row, scale, norm_eps,
        KEY_HEADS=key_heads, VALUE_HEADS=value_heads, DK=key_dim, DV=value_dim, BLOCK_DV=block_dv,
        FUSE_NORM=fuse_norm and not norm_apart, STORE_STATES=output_states, L2EPS=L2_EPS, PDL=pdl,
        PENDING=0 if pending is None else pending.capacity,
        num_warps=8 if key_dim * block_dv >= 8192 else 4, **launch_options(pdl),
    )
    if norm_apart:
        z_heads = z.view(tokens, value_heads, value_dim)
        out = gated_rms_norm(out, z_heads, norm_weight, norm_eps)
    return out, states
