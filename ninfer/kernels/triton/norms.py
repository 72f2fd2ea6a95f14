"""Fused row kernels: residual add + RMSNorm, gated RMSNorm * silu(z), SiLU(gate) * up and x * sigmoid(gate).

Twins: ``ninfer.kernels.reference.norms.rms_norm`` / ``gated_rms_norm``, the activation inside ``ninfer.kernels.reference.moe.swiglu``
and the output gate of ``ninfer.plugins.qwen3_5.model.layers.full_attention``. All math is fp32; outputs take the input
dtype. Every grid puts the rows on its first axis, so any number of tokens (a whole prefill) fits one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton import next_power_of_2

# elements per program of ``gated_rms_norm``: 32 heads of 128 (27B prefill of 8192 tokens on the H200: 298 us with
# one head per program, 135 us with 16, 117 us with 32, 124 us with 64)
GATED_NORM_ELEMENTS = 4096


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    hidden_ptr,
    normed_ptr,
    n_cols,
    x_stride,
    residual_stride,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(hidden_ptr + row * n_cols + cols, x, mask=mask)
    values = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(values * values, axis=0) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        weight = weight + 1.0
    tl.store(normed_ptr + row * n_cols + cols, (values * rstd * weight).to(x.dtype), mask=mask)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    zero_centered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden = x + residual`` (rounded to x.dtype; just ``x`` without a residual) and ``rms_norm(hidden)``.

    ``x``/``residual`` are ``[N, H]`` with unit column stride. Returns ``(hidden, normed)``, both ``[N, H]``.
    """
    rows, cols = x.shape
    _check_rows(x, "x")
    normed = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if residual is None:
        hidden = x
        residual_arg, residual_stride = x, 0
    else:
        _check_rows(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
        hidden = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
        residual_arg, residual_stride = residual, residual.stride(0)
    block = next_power_of_2(cols)
    _add_rms_norm_kernel[(rows,)](
        x, residual_arg, weight, hidden, normed, cols, x.stride(0), residual_stride, eps,
        HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered, BLOCK=block,
        num_warps=_warps_for(block),
    )
    return hidden, normed


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, weight_ptr, out_ptr, n_rows, n_cols, heads, x_stride, z_stride, eps,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    """``ROWS`` (token, head) rows of ``BLOCK`` columns per program: one head per program leaves a prefill's ~400K
    programs of one warp each four times slower than its bytes (H200, 27B)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    token = rows // heads
    head = rows % heads
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offsets = head[:, None] * n_cols + cols[None, :]
    x = tl.load(x_ptr + token[:, None] * x_stride + offsets, mask=mask, other=0.0)
    values = x.to(tl.float32)
    z = tl.load(z_ptr + token[:, None] * z_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(values * values, axis=1) / n_cols + eps)
    normed = values * rstd[:, None] * weight[None, :] * z * tl.sigmoid(z)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], normed.to(x.dtype), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm(x) * weight * silu(z)`` over the last dim of ``x, z [..., D]`` (plain weight); ``[..., D]`` out.

    Rows may be strided; with three or more dims the heads of one token (the last two dims) may sit in a strided
    row, e.g. ``z`` as a column slice of a fused projection viewed ``[N, H, D]``: nothing is copied then.
    """
    if x.shape != z.shape:
        raise ValueError(f"x {tuple(x.shape)} and z {tuple(z.shape)} must have the same shape")
    dim = x.shape[-1]
    heads = x.shape[-2] if x.dim() >= 3 else 1
    x3, z3 = x.reshape(-1, heads, dim), z.reshape(-1, heads, dim)
    for tensor, name in ((x3, "x"), (z3, "z")):
        if tensor.stride(2) != 1 or (heads > 1 and tensor.stride(1) != dim):
            raise ValueError(f"{name} must have contiguous heads of {dim}; got strides {tuple(tensor.stride())}")
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    block = next_power_of_2(dim)
    rows = x3.shape[0] * heads
    per_program = min(max(1, GATED_NORM_ELEMENTS // block), next_power_of_2(rows))
    _gated_rms_norm_kernel[(triton.cdiv(rows, per_program),)](
        x3, z3, weight, out, rows, dim, heads, x3.stride(0), z3.stride(0), eps, ROWS=per_program, BLOCK=block,
        num_warps=_warps_for(per_program * block),
    )
    return out.view(x.shape)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inner, x_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_stride + inner + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    tl.store(out_ptr + row * inner + cols, (g * tl.sigmoid(g) * up).to(gate.dtype), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [N, 2I]`` laid out ``[gate | up]``; returns ``[N, I]``."""
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up must have an even width, got {width}")
    _check_rows(gate_up, "gate_up")
    inner = width // 2
    out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_power_of_2(inner))
    _silu_mul_kernel[(rows, triton.cdiv(inner, block))](gate_up, out, inner, gate_up.stride(0), BLOCK=block)
    return out


@triton.jit
def _sigmoid_gate_kernel(
    x_ptr, gate_ptr, out_ptr, width, x_stride, x_head_stride, gate_stride, gate_head_stride,
    D: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    head = cols // D
    d = cols % D
    x = tl.load(x_ptr + row * x_stride + head * x_head_stride + d, mask=mask, other=0.0)
    gate = tl.load(gate_ptr + row * gate_stride + head * gate_head_stride + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (x.to(tl.float32) * tl.sigmoid(gate)).to(x.dtype), mask=mask)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` for ``x, gate [N, heads, D]``; returns a contiguous ``[N, heads, D]`` in x.dtype.

    Only the last dim must be contiguous: ``gate`` may be the per-head gate half of an interleaved projection.
    """
    if x.dim() != 3 or x.shape != gate.shape:
        raise ValueError(f"x {tuple(x.shape)} and gate {tuple(gate.shape)} must be the same [N, heads, D]")
    if x.stride(2) != 1 or gate.stride(2) != 1:
        raise ValueError("x and gate must have a contiguous last dim")
    rows, heads, dim = x.shape
    width = heads * dim
    out = torch.empty((rows, heads, dim), dtype=x.dtype, device=x.device)
    if rows and width:
        block = min(1024, next_power_of_2(width))
        _sigmoid_gate_kernel[(rows, triton.cdiv(width, block))](
            x, gate, out, width, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), D=dim, BLOCK=block
        )
    return out


def _check_rows(tensor: torch.Tensor, name: str) -> None:
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise ValueError(f"{name} must be a 2-D tensor with contiguous rows; got shape {tuple(tensor.shape)}")


def _warps_for(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8
