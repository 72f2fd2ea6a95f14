"""Decode GEMVs (rows <= 64) in one launch, optionally reading their input through SwiGLU's SiLU·mul.

* ``act_gemv(gate_up, W, silu_mul=True)``: ``y = (silu(gate) * up) @ W^T``, the dense MLP's down projection straight
  from its gate/up projection: no SiLU·mul launch, and at one row no cuBLAS split-K kernel with its workspace memset
  and reduce launch (at 27B shapes those cost ~10 µs of gaps per layer on the H200).
* ``act_gemv(x, W)``: ``y = x @ W^T`` (the attention output projection).

Each program owns a block of output rows over the whole K and streams its weight tiles (software-pipelined),
recomputing the activation of each K tile from the tiny input rows. With programmatic dependent launch
(``GemvTiles.pdl``, sm_90+) a program loads its first weight tile, then waits for the predecessor's writes.

Twin: ``ninfer.kernels.triton.norms.silu_mul`` (``silu(gate) * up`` rounded once to the activation dtype) followed
by ``F.linear``; the product accumulates in fp32 and is rounded to the activation dtype once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton import next_power_of_2
from ninfer.kernels.triton.norm_gemv import (
    MAX_ROWS,
    GemvTiles,
    accumulate,
    after_predecessor,
    launch_options,
    pdl_supported,
    token_block,
    weight_tile,
)


def default_act_tiles(tokens: int, device: torch.device | str = "cpu", silu_mul: bool = False) -> GemvTiles:
    """The tiles of ``act_gemv`` for ``tokens`` rows: at one row 4 output rows per program, over 1024-column steps
    at 4 warps with ``silu_mul`` (the fastest of 8 tile sets on the H200 for the 27B down projection, 43.7 µs
    against 50.5 µs for SiLU·mul + cuBLAS) and over 2048-column steps at 8 warps for plain products (the mixers'
    output projections, which start beside the decode attention: the 35B-A3B step is 0.01-0.02 ms shorter); 32-row
    ``tl.dot`` tiles with 256-column steps for more."""
    pdl = pdl_supported(device)
    if tokens == 1 and silu_mul:
        return GemvTiles(rows=4, block_k=1024, warps=4, stages=3, pdl=pdl)
    if tokens == 1:
        return GemvTiles(rows=4, block_k=2048, warps=8, stages=2, pdl=pdl)
    return GemvTiles(rows=32, block_k=256, warps=4, stages=3, pdl=pdl)


@triton.jit
def _input_tile(x_rows, token_valid, first, width, SILU_MUL: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns ``[first, first + BLOCK_K)`` of the input rows: ``x``, or ``silu(gate) * up`` with the up half
    ``width`` columns after the gate half (rounded to the activation dtype as the twin rounds it)."""
    cols = first + tl.arange(0, BLOCK_K)
    mask = token_valid[:, None] & (cols < width)[None, :]
    x = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    if SILU_MUL:
        up = tl.load(x_rows[:, None] + width + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        gate = x.to(tl.float32)
        x = (gate * tl.sigmoid(gate) * up).to(x.dtype)
    return x


@triton.jit
def _act_gemv_kernel(
    x_ptr, x_stride, w_ptr, out_ptr, tokens, out_features, width,
    SILU_MUL: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_valid = rows < out_features
    w_rows = w_ptr + rows.to(tl.int64) * width
    first_tile = weight_tile(w_rows, row_valid, 0, width, BLOCK_K)
    after_predecessor(PDL)  # the weights are not the predecessor's: their first tile is already on its way
    t = tl.arange(0, TOKENS)
    token_valid = t < tokens
    x_rows = x_ptr + t * x_stride
    acc = accumulate(
        tl.zeros((TOKENS, ROWS), tl.float32), _input_tile(x_rows, token_valid, 0, width, SILU_MUL, BLOCK_K),
        first_tile, TOKENS,
    )
    for first in range(BLOCK_K, width, BLOCK_K):
        w = weight_tile(w_rows, row_valid, first, width, BLOCK_K)
        acc = accumulate(acc, _input_tile(x_rows, token_valid, first, width, SILU_MUL, BLOCK_K), w, TOKENS)
    out = out_ptr + t[:, None] * out_features + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=token_valid[:, None] & row_valid[None, :])


def act_gemv(
    x: torch.Tensor, weight: torch.Tensor, *, silu_mul: bool = False, tiles: GemvTiles | None = None
) -> torch.Tensor:
    """``x @ weight^T``, or with ``silu_mul`` ``(silu(gate) * up) @ weight^T`` of ``x = [gate | up]``.

    ``x [N <= 64, K]`` (``[N, 2K]`` with ``silu_mul``) with contiguous rows, ``weight [O, K]`` contiguous; returns
    ``[N, O]`` in ``x.dtype``.
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, K] with contiguous rows; got {tuple(x.shape)}")
    tokens, columns = x.shape
    if not 1 <= tokens <= MAX_ROWS:
        raise ValueError(f"act_gemv takes 1..{MAX_ROWS} rows; got {tokens}")
    width = columns // 2 if silu_mul else columns
    if silu_mul and columns % 2:
        raise ValueError(f"silu_mul needs x = [gate | up] of an even width; got {columns} columns")
    if weight.dim() != 2 or weight.shape[1] != width or weight.stride() != (width, 1):
        raise ValueError(f"weight must be a contiguous [O, {width}]; got {tuple(weight.shape)}")
    tiles = tiles or default_act_tiles(tokens, x.device, silu_mul)
    out_features = weight.shape[0]
    out = torch.empty((tokens, out_features), dtype=x.dtype, device=x.device)
    _act_gemv_kernel[(triton.cdiv(out_features, tiles.rows),)](
        x, x.stride(0), weight, out, tokens, out_features, width,
        SILU_MUL=silu_mul, TOKENS=token_block(tokens, tiles.rows), ROWS=tiles.rows,
        BLOCK_K=min(tiles.block_k, next_power_of_2(width)), PDL=tiles.pdl, num_warps=tiles.warps,
        num_stages=tiles.stages, **launch_options(tiles.pdl),
    )
    return out
