"""The chunked gated delta rule for prefill in four Triton kernels that read q, k, v, g and beta in place.

Oracle: ``ninfer.kernels.reference.gated_delta.chunk_gated_delta_rule`` (same math, same 64-token chunks). q and k are read
through their strides (views split from the conv output are fine), each value head reads its key head
(``head // (Hv // Hk)``), the L2 norms and the q scale are applied on load, and the tail chunk is masked. Per value
head, a chunk with cumulative log-decay ``c``, normalised keys ``K`` and entering state ``S`` gives::

    A = strictly_lower(beta_t exp(c_t - c_s) k_t.k_s)   T = (I + A)^-1      # 1: per (chunk, head)
    W = T (beta exp(c) K)      U = T (beta V)                               # 2: per (chunk, head)
    V' = U - W S               S <- exp(c_L) S + (exp(c_L - c) K)^T V'      # 3: per (head, Dv block), chunk by chunk
    O = exp(c) Q S + (causal(Q K^T) * exp(c_t - c_s)) V'                    # 4: per (chunk, head, Dv block)

Kernel 1 writes A into T's place, inverts the four 16x16 diagonal blocks by forward substitution (all four at once,
rows read back from that tile) and merges the blocks below them; it runs on few warps, the substitution being a
chain of small reductions. Kernel 3 keeps its ``[Dk, BV]`` slice of the fp32 state in registers, stores each
chunk's entering state for kernel 4 and overwrites ``U`` with ``V'`` in place. With bf16 (or fp16) inputs the
products run on the tensor cores in that dtype with fp32 accumulation (the inverse in tf32) and ``W``, ``U``/``V'``
and the entering states are stored in it; the state itself stays fp32 (about 3e-3 relative to the fp32 oracle on
the same inputs, the outputs about 5e-3, where rounding the output to bf16 alone gives 1.7e-3). With fp32 inputs
every product is ``tf32x3`` (about fp32 accuracy) and the intermediates are fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.reference.gated_delta import L2_EPS, check_shapes
from ninfer.kernels.triton import interpreting

CHUNK = 64
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
# launch shapes (tuned on an H200 at 8192 tokens): warps, value columns per program, pipelining stages
INVERSE_WARPS, PROJECT_WARPS = 2, 8
STATE_BLOCK_V, STATE_WARPS, STATE_STAGES = 32, 4, 2
OUTPUT_BLOCK_V, OUTPUT_WARPS = 64, 4
INTERPRETING: tl.constexpr = tl.constexpr(interpreting())


@triton.jit
def _dot(a, b, FP32: tl.constexpr, DT: tl.constexpr):
    """``a @ b`` with fp32 accumulation: tf32x3 on fp32 operands, else both cast to ``DT`` (bf16 / fp16).

    Triton's CPU interpreter multiplies bf16 bit patterns as integers, so there the operands are rounded to ``DT``
    and multiplied in fp32 instead (the same exact products, summed in fp32).
    """
    if FP32:
        return tl.dot(a, b, input_precision="tf32x3")
    if INTERPRETING:
        return tl.dot(a.to(DT).to(tl.float32), b.to(DT).to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _dot_fp32(a, b, FP32: tl.constexpr):
    """An fp32 product for the triangular inverse: tf32x3 in the fp32-accurate mode, tf32 otherwise."""
    if FP32:
        return tl.dot(a, b, input_precision="tf32x3")
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _invert_diagonal_blocks(t_base):
    """Replace the four strictly lower 16x16 diagonal blocks ``a`` of the 64x64 tile at ``t_base`` by
    ``(I + a)^-1``: forward substitution, one row of all four blocks per step, rows read back from memory."""
    r = tl.arange(0, 16)
    origins = t_base + tl.arange(0, 4) * (16 * 64 + 16)  # element (0, 0) of each diagonal block
    row_in_block = r[None, :, None]
    inverse = tl.where(row_in_block == r[None, None, :], 1.0, 0.0) + tl.zeros((4, 16, 16), dtype=tl.float32)
    for i in range(1, 16):
        a_row = tl.load(origins[:, None] + i * 64 + r[None, :])  # [4, 16]: a[i, j] of each block
        combination = tl.sum(a_row[:, :, None] * inverse, 1)  # sum_j a[i, j] inverse[j, :]
        inverse = tl.where(row_in_block == i, inverse - combination[:, None, :], inverse)
    tl.debug_barrier()  # every thread has read the blocks before any is overwritten
    tl.store(origins[:, None, None] + row_in_block * 64 + r[None, None, :], inverse)


@triton.jit
def _tile(t_base, block_row: tl.constexpr, block_col: tl.constexpr):
    r = tl.arange(0, 16)
    return t_base + (16 * block_row + r[:, None]) * 64 + 16 * block_col + r[None, :]


@triton.jit(do_not_specialize=["length"])
def _inverse_kernel(
    k_ptr, g_ptr, beta_ptr, cum_ptr, t_ptr,
    length,
    stride_kb, stride_kt, stride_kh, stride_gb, stride_gt, stride_gh, stride_bb, stride_bt, stride_bh,
    H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, FP32: tl.constexpr, L2EPS: tl.constexpr,
):
    """Per (chunk, value head): the cumulative log-decay ``c`` and ``T = (I + A)^-1`` (64x64, fp32; blocks above
    the diagonal blocks are left unwritten). A is written to ``T``'s place first and read back block by block."""
    chunk = tl.program_id(0)
    sequence_head = tl.program_id(1).to(tl.int64)
    batch = sequence_head // H
    head = sequence_head % H
    DT: tl.constexpr = k_ptr.dtype.element_ty
    c = tl.arange(0, 64)
    dk = tl.arange(0, DK)
    rows = chunk.to(tl.int64) * 64 + c
    valid = rows < length
    g = tl.load(g_ptr + batch * stride_gb + head * stride_gh + rows * stride_gt, mask=valid, other=0.0)
    beta = tl.load(beta_ptr + batch * stride_bb + head * stride_bh + rows * stride_bt, mask=valid, other=0.0)
    cum = tl.cumsum(g.to(tl.float32), 0)
    tl.store(cum_ptr + sequence_head * length + rows, cum, mask=valid)
    k_base = k_ptr + batch * stride_kb + (head // GROUP) * stride_kh
    keys = tl.load(k_base + rows[:, None] * stride_kt + dk[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    keys = keys * tl.rsqrt(tl.sum(keys * keys, 1) + L2EPS)[:, None]
    keys_t = tl.load(k_base + rows[None, :] * stride_kt + dk[:, None], mask=valid[None, :], other=0.0)
    keys_t = keys_t.to(tl.float32)
    keys_t = keys_t * tl.rsqrt(tl.sum(keys_t * keys_t, 0) + L2EPS)[None, :]
    below = c[:, None] > c[None, :]
    decay = tl.exp(tl.where(below, cum[:, None] - cum[None, :], 0.0))
    a = tl.where(below, _dot(keys, keys_t, FP32, DT) * decay, 0.0) * beta.to(tl.float32)[:, None]
    t_base = t_ptr + (sequence_head * tl.num_programs(0) + chunk) * 4096
    tl.store(t_base + c[:, None] * 64 + c[None, :], a)
    tl.debug_barrier()
    _invert_diagonal_blocks(t_base)
    tl.debug_barrier()
    # T_ij = -X_i sum_{j<=m<i} A_im T_mj below the diagonal blocks (X_i = T_ii)
    x0, x1 = tl.load(_tile(t_base, 0, 0)), tl.load(_tile(t_base, 1, 1))
    x2, x3 = tl.load(_tile(t_base, 2, 2)), tl.load(_tile(t_base, 3, 3))
    a10, a20, a21 = tl.load(_tile(t_base, 1, 0)), tl.load(_tile(t_base, 2, 0)), tl.load(_tile(t_base, 2, 1))
    a30, a31, a32 = tl.load(_tile(t_base, 3, 0)), tl.load(_tile(t_base, 3, 1)), tl.load(_tile(t_base, 3, 2))
    t10 = -_dot_fp32(x1, _dot_fp32(a10, x0, FP32), FP32)
    t21 = -_dot_fp32(x2, _dot_fp32(a21, x1, FP32), FP32)
    t32 = -_dot_fp32(x3, _dot_fp32(a32, x2, FP32), FP32)
    t20 = -_dot_fp32(x2, _dot_fp32(a20, x0, FP32) + _dot_fp32(a21, t10, FP32), FP32)
    t31 = -_dot_fp32(x3, _dot_fp32(a31, x1, FP32) + _dot_fp32(a32, t21, FP32), FP32)
    t30 = -_dot_fp32(
        x3, _dot_fp32(a30, x0, FP32) + _dot_fp32(a31, t10, FP32) + _dot_fp32(a32, t20, FP32), FP32
    )
    tl.debug_barrier()  # every thread has read A's blocks before they are overwritten
    tl.store(_tile(t_base, 1, 0), t10)
    tl.store(_tile(t_base, 2, 1), t21)
    tl.store(_tile(t_base, 3, 2), t32)
    tl.store(_tile(t_base, 2, 0), t20)
    tl.store(_tile(t_base, 3, 1), t31)
    tl.store(_tile(t_base, 3, 0), t30)


@triton.jit(do_not_specialize=["length"])
def _project_kernel(
    k_ptr, v_ptr, beta_ptr, cum_ptr, t_ptr, w_ptr, u_ptr,
    length,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bb, stride_bt, stride_bh,
    H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    FP32: tl.constexpr, L2EPS: tl.constexpr,
):
    """Per (chunk, value head): ``W = T (beta exp(c) K)`` and ``U = T (beta V)``."""
    chunk = tl.program_id(0)
    sequence_head = tl.program_id(1).to(tl.int64)
    batch = sequence_head // H
    head = sequence_head % H
    DT: tl.constexpr = w_ptr.dtype.element_ty
    c = tl.arange(0, 64)
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    rows = chunk.to(tl.int64) * 64 + c
    valid = rows < length
    t_base = t_ptr + (sequence_head * tl.num_programs(0) + chunk) * 4096
    on_or_below_diagonal_blocks = (c[:, None] // 16) >= (c[None, :] // 16)
    inverse = tl.load(t_base + c[:, None] * 64 + c[None, :], mask=on_or_below_diagonal_blocks, other=0.0)
    beta = tl.load(beta_ptr + batch * stride_bb + head * stride_bh + rows * stride_bt, mask=valid, other=0.0)
    beta = beta.to(tl.float32)
    cum = tl.load(cum_ptr + sequence_head * length + rows, mask=valid, other=0.0)
    k_base = k_ptr + batch * stride_kb + (head // GROUP) * stride_kh
    keys = tl.load(k_base + rows[:, None] * stride_kt + dk[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    keys = keys * (tl.rsqrt(tl.sum(keys * keys, 1) + L2EPS) * beta * tl.exp(cum))[:, None]
    tl.store(w_ptr + sequence_head * length * DK + rows[:, None] * DK + dk[None, :],
             _dot(inverse, keys, FP32, DT).to(DT), mask=valid[:, None])
    values = tl.load(v_ptr + batch * stride_vb + head * stride_vh + rows[:, None] * stride_vt + dv[None, :],
                     mask=valid[:, None], other=0.0)
    values = values.to(tl.float32) * beta[:, None]
    tl.store(u_ptr + sequence_head * length * DV + rows[:, None] * DV + dv[None, :],
             _dot(inverse, values, FP32, DT).to(DT), mask=valid[:, None])


@triton.jit(do_not_specialize=["length", "chunks"])
def _state_kernel(
    k_ptr, w_ptr, u_ptr, cum_ptr, initial_ptr, entering_ptr, final_ptr,
    length, chunks,
    stride_kb, stride_kt, stride_kh,
    H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    FP32: tl.constexpr, HAS_INITIAL: tl.constexpr, L2EPS: tl.constexpr,
):
    """Per (value block, value head), chunk after chunk: store the entering state, ``U -> V' = U - W S`` in place,
    ``S <- exp(c_L) S + (exp(c_L - c) K)^T V'``; finally store ``S``."""
    sequence_head = tl.program_id(1).to(tl.int64)
    batch = sequence_head // H
    head = sequence_head % H
    DT: tl.constexpr = w_ptr.dtype.element_ty
    columns = tl.program_id(0) * BV + tl.arange(0, BV)
    dk = tl.arange(0, DK)
    c = tl.arange(0, 64).to(tl.int64)  # rows index tensors through strides that can pass 2^31 elements
    state_tile = sequence_head * DK * DV + dk[:, None] * DV + columns[None, :]
    if HAS_INITIAL:
        state = tl.load(initial_ptr + state_tile)
    else:
        state = tl.zeros((DK, BV), dtype=tl.float32)
    k_base = k_ptr + batch * stride_kb + (head // GROUP) * stride_kh
    w_base = w_ptr + sequence_head * length * DK
    u_base = u_ptr + sequence_head * length * DV
    cum_base = cum_ptr + sequence_head * length
    entering_base = entering_ptr + sequence_head * chunks * DK * DV + dk[:, None] * DV + columns[None, :]
    for n in range(chunks):
        rows = n * 64 + c
        valid = rows < length
        tl.store(entering_base + n * DK * DV, state.to(DT))
        w = tl.load(w_base + rows[:, None] * DK + dk[None, :], mask=valid[:, None], other=0.0)
        u_tile = u_base + rows[:, None] * DV + columns[None, :]
        corrected = tl.load(u_tile, mask=valid[:, None], other=0.0).to(tl.float32) - _dot(w, state, FP32, DT)
        corrected = corrected.to(DT)
        tl.store(u_tile, corrected, mask=valid[:, None])
        cum = tl.load(cum_base + rows, mask=valid, other=0.0)
        cum_last = tl.load(cum_base + tl.minimum(n * 64 + 63, length - 1))
        keys_t = tl.load(k_base + rows[None, :] * stride_kt + dk[:, None], mask=valid[None, :], other=0.0)
        keys_t = keys_t.to(tl.float32)
        weight = tl.rsqrt(tl.sum(keys_t * keys_t, 0) + L2EPS) * tl.where(valid, tl.exp(cum_last - cum), 0.0)
        state = state * tl.exp(cum_last) + _dot(keys_t * weight[None, :], corrected, FP32, DT)
    tl.store(final_ptr + state_tile, state)


@triton.jit(do_not_specialize=["length", "chunks"])
def _output_kernel(
    q_ptr, k_ptr, cum_ptr, entering_ptr, corrected_ptr, o_ptr,
    length, chunks, scale,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_ob, stride_ot, stride_oh,
    H: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    FP32: tl.constexpr, L2EPS: tl.constexpr,
):
    """Per (chunk, value head, value block): ``O = exp(c) Q S_in + (causal(Q K^T) * exp(c_t - c_s)) V'``."""
    chunk = tl.program_id(0)
    sequence_head = tl.program_id(1).to(tl.int64)
    batch = sequence_head // H
    head = sequence_head % H
    key_head = head // GROUP
    DT: tl.constexpr = entering_ptr.dtype.element_ty
    columns = tl.program_id(2) * BV + tl.arange(0, BV)
    dk = tl.arange(0, DK)
    c = tl.arange(0, 64)
    rows = chunk.to(tl.int64) * 64 + c
    valid = rows < length
    queries = tl.load(q_ptr + batch * stride_qb + key_head * stride_qh + rows[:, None] * stride_qt + dk[None, :],
                      mask=valid[:, None], other=0.0).to(tl.float32)
    queries = queries * (tl.rsqrt(tl.sum(queries * queries, 1) + L2EPS) * scale)[:, None]
    keys_t = tl.load(k_ptr + batch * stride_kb + key_head * stride_kh + rows[None, :] * stride_kt + dk[:, None],
                     mask=valid[None, :], other=0.0).to(tl.float32)
    keys_t = keys_t * tl.rsqrt(tl.sum(keys_t * keys_t, 0) + L2EPS)[None, :]
    cum = tl.load(cum_ptr + sequence_head * length + rows, mask=valid, other=0.0)
    entering = tl.load(entering_ptr + (sequence_head * chunks + chunk) * DK * DV + dk[:, None] * DV + columns[None, :])
    out = _dot(queries, entering, FP32, DT) * tl.exp(cum)[:, None]
    causal = c[:, None] >= c[None, :]
    scores = _dot(queries, keys_t, FP32, DT)
    scores = tl.where(causal, scores * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
    corrected = tl.load(corrected_ptr + sequence_head * length * DV + rows[:, None] * DV + columns[None, :],
                        mask=valid[:, None], other=0.0)
    out += _dot(scores, corrected, FP32, DT)
    o_tile = o_ptr + batch * stride_ob + head * stride_oh + rows[:, None] * stride_ot + columns[None, :]
    tl.store(o_tile, out.to(o_ptr.dtype.element_ty), mask=valid[:, None])


def fused_dims_supported(key_dim: int, value_dim: int) -> bool:
    """Whether the fused kernels tile these head dims (powers of two from 16 to 128)."""
    return all(MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and not d & (d - 1) for d in (key_dim, value_dim))


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> None:
    _, _, _, key_dim, _, value_dim = check_shapes(q, k, v, g, beta, initial_state)
    if not fused_dims_supported(key_dim, value_dim):
        raise ValueError(
            f"the fused kernels need power-of-two head dims in [16, 128]; got Dk={key_dim}, Dv={value_dim}"
        )
    if len({t.device for t in (q, k, v, g, beta)}) != 1:
        raise ValueError("q, k, v, g and beta must be on one device")


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its last dim is contiguous (any other strides are read in place), else a compact copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def chunk_gated_delta_rule_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefill_gated_delta_rule``'s contract in four kernels: q, k ``[B,T,Hk,Dk]`` (un-normalised, any strides
    with a contiguous last dim), v ``[B,T,Hv,Dv]``, g and beta fp32 ``[B,T,Hv]``, ``initial_state [B,Hv,Dk,Dv]``
    fp32 or None. Returns ``(o [B,T,Hv,Dv] in v.dtype, final_state [B,Hv,Dk,Dv] fp32)``.
    """
    _check_inputs(q, k, v, g, beta, initial_state)
    batch, length, key_heads, key_dim = k.shape
    value_heads, value_dim = v.shape[2:]
    device = v.device
    if initial_state is not None:
        initial_state = initial_state.to(device=device, dtype=torch.float32).contiguous()
    if length == 0:
        final = torch.zeros((batch, value_heads, key_dim, value_dim), dtype=torch.float32, device=device)
        if initial_state is not None:
            final.copy_(initial_state)
        return v.new_empty((batch, 0, value_heads, value_dim)), final
    q, k, v = (_rows_contiguous(x) for x in (q, k, v))
    g, beta = g.float(), beta.float()
    low_precision = q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16)
    work_dtype = q.dtype if low_precision else torch.float32
    sequences = batch * value_heads
    chunks = triton.cdiv(length, CHUNK)
    group = value_heads // key_heads
    cum = torch.empty((sequences, length), dtype=torch.float32, device=device)
    w = torch.empty((sequences, length, key_dim), dtype=work_dtype, device=device)
    corrected = torch.empty((sequences, length, value_dim), dtype=work_dtype, device=device)  # U, then V' in place
    entering = torch.empty((sequences, chunks, key_dim, value_dim), dtype=work_dtype, device=device)
    final = torch.empty((batch, value_heads, key_dim, value_dim), dtype=torch.float32, device=device)
    o = torch.empty((batch, length, value_heads, value_dim), dtype=v.dtype, device=device)
    fp32 = not low_precision
    inverse = torch.empty((sequences, chunks, CHUNK, CHUNK), dtype=torch.float32, device=device)
    _inverse_kernel[(chunks, sequences)](
        k, g, beta, cum, inverse, length, *k.stride()[:3], *g.stride(), *beta.stride(),
        H=value_heads, GROUP=group, DK=key_dim, FP32=fp32, L2EPS=L2_EPS, num_warps=INVERSE_WARPS,
    )
    _project_kernel[(chunks, sequences)](
        k, v, beta, cum, inverse, w, corrected, length, *k.stride()[:3], *v.stride()[:3], *beta.stride(),
        H=value_heads, GROUP=group, DK=key_dim, DV=value_dim, FP32=fp32, L2EPS=L2_EPS, num_warps=PROJECT_WARPS,
    )
    state_block = min(STATE_BLOCK_V, value_dim)
    _state_kernel[(value_dim // state_block, sequences)](
        k, w, corrected, cum, initial_state if initial_state is not None else final, entering, final,
        length, chunks, *k.stride()[:3],
        H=value_heads, GROUP=group, DK=key_dim, DV=value_dim, BV=state_block, FP32=fp32,
        HAS_INITIAL=initial_state is not None, L2EPS=L2_EPS, num_warps=STATE_WARPS, num_stages=STATE_STAGES,
    )
    output_block = min(OUTPUT_BLOCK_V, value_dim)
    _output_kernel[(chunks, sequences, value_dim // output_block)](
        q, k, cum, entering, corrected, o, length, chunks, key_dim**-0.5,
        *q.stride()[:3], *k.stride()[:3], *o.stride()[:3],
        H=value_heads, GROUP=group, DK=key_dim, DV=value_dim, BV=output_block, FP32=fp32, L2EPS=L2_EPS,
        num_warps=OUTPUT_WARPS,
    )
    return o, final
