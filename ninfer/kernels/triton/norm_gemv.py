"""GEMVs of decode batches (rows <= 8) that normalise their own input: one launch instead of a norm and a GEMM.

The activation rows of a decode batch are tiny (2048 bf16 = 4 KB at 35B-A3B), so every program of the GEMV
recomputes the norm of the rows it multiplies instead of reading a normed copy written by a separate launch:

* ``add_norm_gemv``: ``y = rms_norm(hidden + pending) * (1 + w) @ W^T`` (Qwen3.5's zero-centered RMSNorm, the
  residual add deferred into the next norm as in ``ninfer.kernels.triton.norms.add_rms_norm``). Every program first
  sums the squares of the whole rows, then streams its block of output rows. The first program also writes the new
  residual stream ``hidden + pending`` (and, when asked, the normed rows for a second consumer).
* ``gated_norm_gemv``: ``y = (rms_norm_per_head(core) * w * silu(z)) @ W^T``, the Gated DeltaNet output norm and
  out projection. A head's norm needs only that head, so each K tile holds whole heads and is normed on the fly.

Twins: ``ninfer.kernels.reference.norms.rms_norm`` (zero-centered) / ``gated_rms_norm`` followed by ``F.linear``. Rounding
follows the twin: the residual sum and the normed activations are rounded to the activation dtype before the
product, which accumulates in fp32 and is rounded to the activation dtype once. One row multiplies with FMA
reductions; more rows pad to a ``tl.dot`` tile of 16. With programmatic dependent launch (``GemvTiles.pdl``,
sm_90+) a program loads its first weight tile, then waits for the predecessor's writes (``griddepcontrol.wait``):
the weights stream while the previous kernel drains.

The JIT helpers here (``weight_tile``, ``accumulate``, ``summed_tile``, ``norm_weights``, ``normed_product``,
``inverse_rms``, ``dot_normed_rows_from``) are shared with the MoE decode kernels (``moe_grouped``,
``moe_persistent``), whose routers normalise their input the same way; ``conv_windows`` / ``conv_epilogue`` (the
Gated DeltaNet conv step of ``ConvEpilogue``) with the conv decode kernel (``conv``); ``after_predecessor`` and
``release_dependents`` (where a kernel waits for its predecessor and lets its successor start) with every decode
kernel launched as a programmatic dependent.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ninfer.kernels.triton import interpreting, next_power_of_2
from ninfer.kernels.triton.argmax_keys import INT64_MIN, key_column, sortable_key

MAX_ROWS = 64  # activation rows one call takes (a padded tl.dot tile beyond 16 rows)
INTERPRETER_ROWS = 512  # output rows per program at one row in Triton's interpreter, which runs programs one by one
# (the 248320-row lm_head of the test presets would be 31040 programs of 8 rows)


@attrs.frozen
class GemvTiles:
    """Launch shape of a norm-fused GEMV."""

    rows: int = 4  # output rows (weight rows) per program
    block_k: int = 2048  # columns per step (the gated kernel rounds it to whole heads)
    warps: int = 4
    stages: int = 2
    pdl: bool = False  # programmatic dependent launch: the kernel starts while its predecessor drains (sm_90+)


def pdl_supported(device: torch.device | str) -> bool:
    """Programmatic dependent launch needs a CUDA device of compute capability 9.0 or newer."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def default_tiles(tokens: int, device: torch.device | str = "cpu", width: int = 2048) -> GemvTiles:
    """The tiles of ``add_norm_gemv`` for ``tokens`` rows of ``width``: at one row 8 output rows and whole rows of
    up to 2048 columns per step (a whole 35B-A3B row, FMA; the fastest on the H200); wider rows in steps of the
    largest power of two from 256 to 2048 that divides the width, so no step is mostly masked (1024 at the 27B's
    5120, whose lm_head streams 4.5 TB/s in steps of 1024 against 3.7 TB/s in steps of 2048), else 2048. 32-row
    ``tl.dot`` tiles with 256-column steps for more (slower than cuBLAS there: the runner folds norms at one row
    only). Triton's interpreter takes ``INTERPRETER_ROWS`` output rows per program at one row."""
    if tokens == 1:
        block_k = 2048
        if width > block_k:
            block_k = next((step for step in (2048, 1024, 512, 256) if width % step == 0), 2048)
        rows = INTERPRETER_ROWS if interpreting() else 8
        return GemvTiles(rows=rows, block_k=block_k, warps=4, stages=2, pdl=pdl_supported(device))
    return GemvTiles(rows=32, block_k=256, warps=4, stages=3, pdl=pdl_supported(device))


def default_gated_tiles(tokens: int, device: torch.device | str = "cpu") -> GemvTiles:
    """The tiles of ``gated_norm_gemv``: 8 output rows over 16 heads of 128 per step and 8 warps at one row (the
    fastest of 9 in the 35B-A3B decode step on the H200: graphs 2.234 ms against 2.306 ms with 2 rows and 4 warps,
    the fastest in isolation; the 27B step is the same with either), 2 heads with 32-row dot tiles for more."""
    if tokens == 1:
        return GemvTiles(rows=8, block_k=2048, warps=8, stages=2, pdl=pdl_supported(device))
    return GemvTiles(rows=32, block_k=256, warps=4, stages=3, pdl=pdl_supported(device))


def resolve_pdl(pdl: bool | None, device: torch.device) -> bool:
    """A wrapper's ``pdl`` argument: None means wherever ``device`` supports it; True where it does not is an error."""
    if pdl is None:
        return pdl_supported(device)
    if pdl and not pdl_supported(device):
        raise ValueError(f"pdl=True needs a CUDA device of compute capability 9.0+; got {device}")
    return pdl


def launch_options(pdl: bool) -> dict:
    """Extra launch arguments of a kernel that may use programmatic dependent launch."""
    return {"launch_pdl": True} if pdl else {}


def token_block(tokens: int, *rows_per_program: int) -> int:
    """Token rows of a program's tile: 1 (FMA reductions) or a ``tl.dot`` tile of at least 16 (then >= 16 rows)."""
    if tokens == 1:
        return 1
    if min(rows_per_program) < 16:
        raise ValueError(f"tiles for {tokens} rows (tl.dot) need >= 16 weight rows per program; got {rows_per_program}")
    return max(16, next_power_of_2(tokens))


@triton.jit
def after_predecessor(PDL: tl.constexpr, DEPENDENTS_STARTED: tl.constexpr = False):
    """With programmatic dependent launch: wait until the previous kernel's writes are visible, and let the next
    start unless ``release_dependents`` already did."""
    if PDL:
        gdc_wait()
        if not DEPENDENTS_STARTED:
            gdc_launch_dependents()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """With programmatic dependent launch: let the next kernel start now, before this one waits for its own
    predecessor (then ``after_predecessor(PDL, True)``). The successor may then start while this kernel's
    predecessor still runs (and that one's, where it released early too), so what the successor loads before its
    own wait must not be written by any of them (weights, staged inputs, caches of earlier steps). The decode
    attention's q/k norm, splits and merge do this (35B-A3B graphs 2.044 ms against 2.06-2.07 ms without); the
    gated delta step and the out projections do not (slower with it)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def accumulate(acc, x, w, TOKENS: tl.constexpr):
    """``acc [TOKENS, ROWS] += x [TOKENS, K] @ w [ROWS, K]^T`` (FMA reductions for one token, else ``tl.dot``)."""
    if TOKENS == 1:
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)[None, :]
    else:
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision="ieee")
    return acc


@triton.jit
def summed_tile(hidden_rows, pending_rows, cols, mask, HAS_PENDING: tl.constexpr):
    """``hidden + pending`` over ``cols`` of the rows (pointers at row starts), rounded to the activation dtype."""
    x = tl.load(hidden_rows[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_PENDING:
        pending = tl.load(pending_rows[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (pending.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def inverse_rms(
    hidden_rows, pending_rows, token_valid, width, eps,
    HAS_PENDING: tl.constexpr, TOKENS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``[TOKENS]`` fp32 ``1 / rms(hidden + pending)`` over the rows' ``width`` columns."""
    squares = tl.zeros((TOKENS, BLOCK_K), tl.float32)
    for first in range(0, width, BLOCK_K):
        cols = first + tl.arange(0, BLOCK_K)
        mask = token_valid[:, None] & (cols < width)[None, :]
        values = summed_tile(hidden_rows, pending_rows, cols, mask, HAS_PENDING).to(tl.float32)
        squares += values * values
    return tl.rsqrt(tl.sum(squares, axis=1) / width + eps)


@triton.jit
def norm_weights(norm_weight_ptr, cols, col_valid):
    """The norm weights of ``cols`` (zero past the row), for ``normed_product``: a program whose first columns do
    not depend on its predecessor loads them before ``after_predecessor``, so they are not a dependent load after
    the norm's reduction."""
    return tl.load(norm_weight_ptr + cols, mask=col_valid, other=0.0)


@triton.jit
def normed_tile(summed, rstd, weights):
    """``rms_norm(summed) * (1 + weights)`` rounded to the activation dtype (``rstd`` from ``inverse_rms``)."""
    scale = weights.to(tl.float32) + 1.0
    return (summed.to(tl.float32) * rstd[:, None] * scale[None, :]).to(summed.dtype)


@triton.jit
def normed_product(
    acc, w, summed, cols, mask, weights, rstd, hidden_out_rows, normed_out_rows, write_out,
    HAS_PENDING: tl.constexpr, KEEP_NORMED: tl.constexpr, TOKENS: tl.constexpr,
):
    """``acc += normed[:, cols] @ w^T`` for a weight tile ``w [ROWS, len(cols)]``, the rows' ``summed`` tile
    (``summed_tile``) and the columns' norm ``weights`` (``norm_weights``); with ``write_out`` the tile's new residual
    stream (and normed rows) are stored too."""
    normed = normed_tile(summed, rstd, weights)
    if HAS_PENDING:
        tl.store(hidden_out_rows[:, None] + cols[None, :], summed, mask=mask & write_out)
    if KEEP_NORMED:
        tl.store(normed_out_rows[:, None] + cols[None, :], normed, mask=mask & write_out)
    return accumulate(acc, normed, w, TOKENS)


@triton.jit
def dot_normed_rows(
    acc, hidden_rows, pending_rows, norm_weight_ptr, rstd, token_valid, w_rows, row_valid, start, stop,
    hidden_out_rows, normed_out_rows, write_out,
    HAS_PENDING: tl.constexpr, KEEP_NORMED: tl.constexpr, TOKENS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``acc [TOKENS, ROWS] +=`` the normed rows times weight rows ``w_rows`` over columns ``[start, stop)``
    (``rstd`` from ``inverse_rms``); with ``write_out`` the columns' new residual stream / normed rows are stored."""
    for first in range(start, stop, BLOCK_K):
        cols = first + tl.arange(0, BLOCK_K)
        col_valid = cols < stop
        w = tl.load(w_rows[:, None] + cols[None, :], mask=row_valid[:, None] & col_valid[None, :], other=0.0)
        mask = token_valid[:, None] & col_valid[None, :]
        summed = summed_tile(hidden_rows, pending_rows, cols, mask, HAS_PENDING)
        acc = normed_product(
            acc, w, summed, cols, mask, norm_weights(norm_weight_ptr, cols, col_valid), rstd, hidden_out_rows,
            normed_out_rows, write_out, HAS_PENDING, KEEP_NORMED, TOKENS,
        )
    return acc


@triton.jit
def weight_tile(w_rows, row_valid, start, stop, BLOCK_K: tl.constexpr):
    """The ``[ROWS, BLOCK_K]`` weight tile at columns ``[start, start + BLOCK_K)`` (zero past ``stop``): a program
    loads it before ``after_predecessor`` so it streams while the previous kernel drains."""
    cols = start + tl.arange(0, BLOCK_K)
    return tl.load(w_rows[:, None] + cols[None, :], mask=row_valid[:, None] & (cols < stop)[None, :], other=0.0)


@triton.jit
def dot_normed_rows_from(
    first_tile, first_weights, hidden_rows, pending_rows, norm_weight_ptr, rstd, token_valid, w_rows, row_valid,
    start, stop, hidden_out_rows, normed_out_rows, write_out,
    HAS_PENDING: tl.constexpr, KEEP_NORMED: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``dot_normed_rows`` from a zero accumulator whose first step multiplies ``first_tile`` (``weight_tile`` at
    ``start``) with the norm weights ``first_weights`` (``norm_weights`` there) instead of loading them."""
    cols = start + tl.arange(0, BLOCK_K)
    mask = token_valid[:, None] & (cols < stop)[None, :]
    summed = summed_tile(hidden_rows, pending_rows, cols, mask, HAS_PENDING)
    acc = normed_product(
        tl.zeros((TOKENS, ROWS), tl.float32), first_tile, summed, cols, mask, first_weights, rstd,
        hidden_out_rows, normed_out_rows, write_out, HAS_PENDING, KEEP_NORMED, TOKENS,
    )
    return dot_normed_rows(
        acc, hidden_rows, pending_rows, norm_weight_ptr, rstd, token_valid, w_rows, row_valid, start + BLOCK_K, stop,
        hidden_out_rows, normed_out_rows, write_out, HAS_PENDING, KEEP_NORMED, TOKENS, BLOCK_K,
    )


@triton.jit
def conv_windows(cache_ptr, cache_slot_stride, slots_ptr, rows, t, token_valid, conv_channels, WINDOW: tl.constexpr):
    """``(window pointers [TOKENS, ROWS], their mask, whether each row updates its slot [TOKENS, 1], the pasts)``
    of the conv epilogue: output columns ``rows`` below ``conv_channels`` of each token row's slot (a negative slot
    ``-1 - s`` reads slot ``s`` and is not written)."""
    raw_slot = tl.load(slots_ptr + t, mask=token_valid, other=0).to(tl.int64)
    update = (raw_slot >= 0)[:, None]
    slot = tl.where(raw_slot >= 0, raw_slot, -1 - raw_slot)
    mask = token_valid[:, None] & (rows < conv_channels)[None, :]
    window_ptr = cache_ptr + slot[:, None] * cache_slot_stride + rows[None, :] * WINDOW
    pasts = ()
    for j in tl.static_range(WINDOW):
        pasts = pasts + (tl.load(window_ptr + j, mask=mask, other=0.0),)
    return window_ptr, mask, update, pasts


@triton.jit
def conv_epilogue(y, rows, conv_weight_ptr, window_ptr, mask, update, pasts, WINDOW: tl.constexpr):
    """``silu(y * tap[K-1] + sum_j pasts[j] * tap[j])`` (fp32, rounded to ``y``'s dtype) of the new columns ``y
    [TOKENS, ROWS]`` with their windows (``conv_windows``), which shift in place to end with ``y`` where the row
    updates its slot; columns past the conv keep ``y``. Twin: ``ninfer.kernels.reference.conv.causal_conv1d``."""
    taps_ptr = conv_weight_ptr + rows[None, :] * (WINDOW + 1)
    acc = y.to(tl.float32) * tl.load(taps_ptr + WINDOW, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(WINDOW):
        acc += pasts[j].to(tl.float32) * tl.load(taps_ptr + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(window_ptr + (j - 1), pasts[j], mask=mask & update)
    tl.store(window_ptr + (WINDOW - 1), y.to(window_ptr.dtype.element_ty), mask=mask & update)
    return tl.where(mask, (acc * tl.sigmoid(acc)).to(y.dtype), y)


@triton.jit
def _add_norm_gemv_kernel(
    hidden_ptr, hidden_stride, pending_ptr, pending_stride, norm_weight_ptr, w_ptr, out_ptr, hidden_out_ptr,
    normed_out_ptr, tokens, out_features, width, eps,
    conv_weight_ptr, conv_cache_ptr, cache_slot_stride, slots_ptr, conv_channels, out_address_ptr,
    argmax_keys_ptr, argmax_limit_ptr,
    TOKENS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, WHOLE_ROW: tl.constexpr,
    HAS_PENDING: tl.constexpr, KEEP_NORMED: tl.constexpr, CONV: tl.constexpr, WINDOW: tl.constexpr,
    OUT_AT_ADDRESS: tl.constexpr, ARGMAX: tl.constexpr, PDL: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_valid = rows < out_features
    # The row starts as a select, so that the compiler issues each row's two column chunks back to back instead of
    # interleaving the rows' (sm_90 SASS; 35B-A3B decode graphs 2.115 ms against 2.143 ms). Rows past the weight
    # start in another tensor (their loads are masked): a select between two bases makes the step faster than one
    # falling back to the weight's first row (graphs 2.09 ms against 2.12-2.13 ms), with the same loads in the same
    # order before the predecessor wait and the projection alone as fast either way; why is not known.
    w_rows = tl.where(row_valid, w_ptr + rows.to(tl.int64) * width, norm_weight_ptr + (rows - out_features) * width)
    cols = tl.arange(0, BLOCK_K)
    col_valid = cols < width
    t = tl.arange(0, TOKENS)
    token_valid = t < tokens
    first_tile = weight_tile(w_rows, row_valid, 0, width, BLOCK_K)
    first_weights = norm_weights(norm_weight_ptr, cols, col_valid)
    if CONV:  # the windows are not the predecessor's either (this kernel wrote them a step ago)
        window_ptr, conv_mask, update, pasts = conv_windows(
            conv_cache_ptr, cache_slot_stride, slots_ptr, rows, t, token_valid, conv_channels, WINDOW
        )
    after_predecessor(PDL)  # the weights are not the predecessor's: their first tile (and norm weights) on its way
    hidden_rows = hidden_ptr + t * hidden_stride
    pending_rows = pending_ptr + t * pending_stride
    mask = token_valid[:, None] & col_valid[None, :]
    summed = summed_tile(hidden_rows, pending_rows, cols, mask, HAS_PENDING)
    if WHOLE_ROW:  # the first step holds the whole rows: their norm needs no second read
        values = summed.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(values * values, axis=1) / width + eps)
    else:
        rstd = inverse_rms(hidden_rows, pending_rows, token_valid, width, eps, HAS_PENDING, TOKENS, BLOCK_K)
    hidden_out_rows = hidden_out_ptr + t * width
    normed_out_rows = normed_out_ptr + t * width
    write_out = tl.program_id(0) == 0
    acc = tl.zeros((TOKENS, ROWS), tl.float32)
    acc = normed_product(
        acc, first_tile, summed, cols, mask, first_weights, rstd, hidden_out_rows, normed_out_rows, write_out,
        HAS_PENDING, KEEP_NORMED, TOKENS,
    )
    if not WHOLE_ROW:
        acc = dot_normed_rows(
            acc, hidden_rows, pending_rows, norm_weight_ptr, rstd, token_valid, w_rows, row_valid, BLOCK_K, width,
            hidden_out_rows, normed_out_rows, write_out, HAS_PENDING, KEEP_NORMED, TOKENS, BLOCK_K,
        )
    y = acc.to(hidden_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)  # rounded as the activations
    if CONV:
        y = conv_epilogue(y, rows, conv_weight_ptr, window_ptr, conv_mask, update, pasts, WINDOW)
    if OUT_AT_ADDRESS:  # staged before the launch (not the predecessor's)
        out_ptr = tl.load(out_address_ptr).to(tl.pointer_type(out_ptr.dtype.element_ty))
    out = out_ptr + t[:, None] * out_features + rows[None, :]
    tl.store(out, y, mask=token_valid[:, None] & row_valid[None, :])
    if ARGMAX:  # each token's largest key among this program's rows below the staged limit, merged by atomic max
        limit = tl.load(argmax_limit_ptr)
        candidate = token_valid[:, None] & (rows < limit)[None, :]
        keys = tl.where(candidate, sortable_key(y.to(tl.float32), rows[None, :]), INT64_MIN)
        tl.atomic_max(argmax_keys_ptr + t, tl.max(keys, axis=1), mask=token_valid & (limit > 0), sem="relaxed")


@attrs.frozen
class ArgmaxEpilogue:
    """Each token's argmax over the first ``limit[0]`` projected columns, computed inside ``add_norm_gemv`` (the
    one-row lm_head: greedy ids without a pass over the logits): the kernel merges every program's largest key
    (``argmax_keys``) into ``keys [N]`` (int64, ``INT64_MIN`` before the launch) by atomic max; ``limit [1]`` (int64
    on the device, read when the kernel runs; 0: none) lets a captured graph take it per replay.
    ``greedy_ids_from_keys`` turns the keys into ids and resets them."""

    keys: torch.Tensor
    limit: torch.Tensor


def argmax_keys(tokens: int, device: torch.device | str) -> torch.Tensor:
    """``ArgmaxEpilogue`` keys for ``tokens`` rows as a launch expects them (and ``greedy_ids_from_keys`` leaves
    them): ``INT64_MIN``."""
    return torch.full((tokens,), INT64_MIN.value, dtype=torch.int64, device=device)


@attrs.frozen
class ConvEpilogue:
    """The Gated DeltaNet's causal conv step applied to the first ``weight.shape[0]`` projected columns inside
    ``add_norm_gemv`` (each column's program owns its window, so no separate conv launch): ``weight [C, K]``,
    ``cache [S, C, K-1]`` (windows packed per slot), ``slots [N]`` (a negative slot ``-1 - s`` reads slot ``s`` and
    leaves its window as it is). The same contract as ``conv.causal_conv1d_update``."""

    weight: torch.Tensor
    cache: torch.Tensor
    slots: torch.Tensor


def _check_rows(tensor: torch.Tensor, name: str, rows: int, width: int) -> None:
    if tensor.dim() != 2 or tensor.shape != (rows, width) or tensor.stride(1) != 1:
        raise ValueError(f"{name} must be [{rows}, {width}] with contiguous rows; got {tuple(tensor.shape)}")


def add_norm_gemv(
    hidden: torch.Tensor,
    pending: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    keep_normed: bool = False,
    conv: ConvEpilogue | None = None,
    out_dtype: torch.dtype | None = None,
    out_address: torch.Tensor | None = None,
    argmax: ArgmaxEpilogue | None = None,
    tiles: GemvTiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(new hidden, projected or None, normed or None)`` of ``hidden, pending [N <= 64, H]`` in one launch.

    ``new hidden = hidden + pending`` (rounded; ``hidden`` itself without ``pending``), ``normed =
    rms_norm(new hidden) * (1 + norm_weight)`` (rounded), ``projected = normed @ weight^T`` (``weight [O, H]``
    contiguous, e.g. a layer's fused input rows). ``keep_normed``: also return ``normed`` (for a second consumer).
    ``conv``: the first ``C`` projected columns come back as ``silu(conv)`` of the projection, their windows shifted
    in place (``ConvEpilogue``); then the kernel immediately before this one must not write the conv weight, cache
    or slots (they load before the wait for it). ``out_dtype``: ``projected`` is stored in this dtype (rounded to the
    activation dtype first, e.g. fp32 logits that equal the bf16 ones); default the activation dtype.
    ``out_address``: a one-element int64 tensor on the device that holds, when the kernel runs, the address of the
    contiguous ``[N, O]`` tensor of that dtype to store ``projected`` in (so each replay of a captured graph writes
    into a tensor of its own); ``projected`` is then returned as None. ``argmax``: each token's argmax of
    ``projected`` as keys (``ArgmaxEpilogue``).
    """
    tokens, width = hidden.shape
    if not 1 <= tokens <= MAX_ROWS:
        raise ValueError(f"add_norm_gemv takes 1..{MAX_ROWS} rows; got {tokens}")
    _check_rows(hidden, "hidden", tokens, width)
    if pending is not None:
        _check_rows(pending, "pending", tokens, width)
    if weight.dim() != 2 or weight.shape[1] != width or weight.stride() != (width, 1):
        raise ValueError(f"weight must be a contiguous [O, {width}]; got {tuple(weight.shape)}")
    if norm_weight.shape != (width,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be a contiguous [{width}]; got {tuple(norm_weight.shape)}")
    tiles = tiles or default_tiles(tokens, hidden.device, width)
    out_features = weight.shape[0]
    window = _check_conv(conv, tokens, out_features) if conv is not None else 0
    like_hidden = dict(dtype=hidden.dtype, device=hidden.device)
    if out_address is not None and (
        out_address.shape != (1,) or out_address.dtype != torch.int64 or out_address.device != hidden.device
    ):
        raise ValueError(f"out_address must be a one-element int64 tensor on {hidden.device}")
    if argmax is not None and (
        argmax.keys.shape != (tokens,) or argmax.limit.shape != (1,)
        or any(t.dtype != torch.int64 or t.device != hidden.device for t in (argmax.keys, argmax.limit))
    ):
        raise ValueError(f"argmax keys and limit must be int64 [{tokens}] and [1] on {hidden.device}")
    out_shape = (tokens, out_features) if out_address is None else (1,)  # else only the pointer's type
    out = torch.empty(out_shape, dtype=out_dtype or hidden.dtype, device=hidden.device)
    if conv is not None and out.dtype != hidden.dtype:
        raise ValueError("the conv epilogue writes the activation dtype: out_dtype must be left out with conv")
    new_hidden = torch.empty((tokens, width), **like_hidden) if pending is not None else hidden
    normed = torch.empty((tokens, width), **like_hidden) if keep_normed else None
    block_k = min(tiles.block_k, next_power_of_2(width))
    _add_norm_gemv_kernel[(triton.cdiv(out_features, tiles.rows),)](
        hidden, hidden.stride(0), pending if pending is not None else hidden,
        pending.stride(0) if pending is not None else 0, norm_weight, weight, out, new_hidden,
        normed if keep_normed else out, tokens, out_features, width, eps,
        *((conv.weight, conv.cache, conv.cache.stride(0), conv.slots, conv.weight.shape[0]) if conv is not None
          else (weight, weight, 0, weight, 0)),
        out_address if out_address is not None else out,
        *((argmax.keys, argmax.limit) if argmax is not None else (out, out)),
        TOKENS=token_block(tokens, tiles.rows), ROWS=tiles.rows, BLOCK_K=block_k, WHOLE_ROW=block_k >= width,
        HAS_PENDING=pending is not None, KEEP_NORMED=keep_normed, CONV=conv is not None, WINDOW=window,
        OUT_AT_ADDRESS=out_address is not None, ARGMAX=argmax is not None, PDL=tiles.pdl, num_warps=tiles.warps,
        num_stages=tiles.stages, **launch_options(tiles.pdl),
    )
    return new_hidden, out if out_address is None else None, normed


@triton.jit
def _greedy_ids_kernel(keys_ptr, ids_address_ptr, tokens, BLOCK: tl.constexpr, PDL: tl.constexpr):
    ids_address = tl.load(ids_address_ptr)  # staged before the launch
    after_predecessor(PDL)
    t = tl.arange(0, BLOCK)
    inside = t < tokens
    keys = tl.load(keys_ptr + t, mask=inside, other=INT64_MIN)
    ids_ptr = ids_address.to(tl.pointer_type(tl.int64))
    tl.store(ids_ptr + t, key_column(keys), mask=inside & (ids_address != 0))
    tl.store(keys_ptr + t, tl.full([BLOCK], INT64_MIN, tl.int64), mask=inside)


def greedy_ids_from_keys(keys: torch.Tensor, ids_address: torch.Tensor) -> None:
    """The launch after an ``add_norm_gemv`` with ``ArgmaxEpilogue(keys, ...)``: stores each token's argmax column
    as int64 at the address ``ids_address [1]`` holds when it runs (none where it holds 0) and sets ``keys`` back
    to ``INT64_MIN`` for the next launch."""
    if keys.dim() != 1 or keys.dtype != torch.int64 or ids_address.shape != (1,) or ids_address.dtype != torch.int64:
        raise ValueError("keys must be an int64 [N] and ids_address an int64 [1]")
    pdl = pdl_supported(keys.device)
    _greedy_ids_kernel[(1,)](
        keys, ids_address, keys.shape[0], BLOCK=max(2, next_power_of_2(keys.shape[0])), PDL=pdl, num_warps=1,
        **launch_options(pdl),
    )


def _check_conv(conv: ConvEpilogue, tokens: int, out_features: int) -> int:
    """The conv window ``K-1`` of a valid ``ConvEpilogue`` over ``tokens`` rows of ``out_features`` columns."""
    channels, taps = conv.weight.shape
    window = taps - 1
    if not conv.weight.is_contiguous() or channels > out_features or window < 1:
        raise ValueError(
            f"conv weight must be a contiguous [C <= {out_features}, K >= 2]; got {tuple(conv.weight.shape)}"
        )
    cache = conv.cache
    if cache.dim() != 3 or tuple(cache.shape[1:]) != (channels, window) or cache.stride()[1:] != (window, 1):
        raise ValueError(f"conv cache must be [S, {channels}, {window}] with packed windows; got {tuple(cache.shape)}")
    if conv.slots.shape != (tokens,) or conv.slots.device != cache.device:
        raise ValueError(f"conv slots must be [{tokens}] on the cache's device; got {tuple(conv.slots.shape)}")
    return window


@triton.jit
def _gated_product(
    acc, w, first, core_rows, z_rows, norm_weight, token_valid, heads, eps,
    TOKENS: tl.constexpr, HEADS_PER_TILE: tl.constexpr, DV: tl.constexpr,
):
    """``acc += gated[:, first : first + HEADS_PER_TILE * DV] @ w^T`` with the heads' norms computed here."""
    head = first // DV + tl.arange(0, HEADS_PER_TILE)
    d = tl.arange(0, DV)
    offsets = (head * DV)[None, :, None] + d[None, None, :]
    mask = token_valid[:, None, None] & (head < heads)[None, :, None]
    core = tl.load(core_rows[:, None, None] + offsets, mask=mask, other=0.0)
    z = tl.load(z_rows[:, None, None] + offsets, mask=mask, other=0.0).to(tl.float32)
    values = core.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(values * values, axis=2) / DV + eps)
    gated = values * rstd[:, :, None] * norm_weight[None, None, :] * (z * tl.sigmoid(z))
    x = tl.reshape(gated.to(core.dtype), (TOKENS, HEADS_PER_TILE * DV))
    return accumulate(acc, x, w, TOKENS)


@triton.jit
def _gated_norm_gemv_kernel(
    core_ptr, core_stride, z_ptr, z_stride, norm_weight_ptr, w_ptr, out_ptr, tokens, out_features, heads, eps,
    TOKENS: tl.constexpr, ROWS: tl.constexpr, HEADS_PER_TILE: tl.constexpr, DV: tl.constexpr, PDL: tl.constexpr,
):
    BLOCK_K: tl.constexpr = HEADS_PER_TILE * DV
    width = heads * DV
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_valid = rows < out_features
    w_rows = w_ptr + rows.to(tl.int64) * width
    first_tile = weight_tile(w_rows, row_valid, 0, width, BLOCK_K)
    after_predecessor(PDL)
    t = tl.arange(0, TOKENS)
    token_valid = t < tokens
    core_rows = core_ptr + t * core_stride
    z_rows = z_ptr + t * z_stride
    norm_weight = tl.load(norm_weight_ptr + tl.arange(0, DV)).to(tl.float32)
    acc = tl.zeros((TOKENS, ROWS), tl.float32)
    acc = _gated_product(acc, first_tile, 0, core_rows, z_rows, norm_weight, token_valid, heads, eps,
                         TOKENS, HEADS_PER_TILE, DV)
    for first in range(BLOCK_K, width, BLOCK_K):
        w = weight_tile(w_rows, row_valid, first, width, BLOCK_K)
        acc = _gated_product(acc, w, first, core_rows, z_rows, norm_weight, token_valid, heads, eps,
                             TOKENS, HEADS_PER_TILE, DV)
    out = out_ptr + t[:, None] * out_features + rows[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=token_valid[:, None] & row_valid[None, :])


def gated_norm_gemv(
    core: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    tiles: GemvTiles | None = None,
) -> torch.Tensor:
    """``gated_rms_norm(core, z, norm_weight) @ weight^T`` in one launch; returns ``[N, O]`` in ``core.dtype``.

    ``core [N <= 64, heads, D]`` (D a power of two; heads contiguous), ``z [N, heads * D]`` with contiguous rows (a
    column slice of the fused input projection is fine), ``norm_weight [D]`` (plain weight), ``weight [O, heads*D]``
    contiguous.
    """
    if core.dim() != 3:
        raise ValueError(f"core must be [N, heads, D]; got {tuple(core.shape)}")
    tokens, heads, dim = core.shape
    if not 1 <= tokens <= MAX_ROWS:
        raise ValueError(f"gated_norm_gemv takes 1..{MAX_ROWS} rows; got {tokens}")
    if dim & (dim - 1) or core.stride(2) != 1 or core.stride(1) != dim:
        raise ValueError(f"core needs contiguous heads of a power-of-two dim; got {tuple(core.shape)}")
    width = heads * dim
    _check_rows(z, "z", tokens, width)
    if weight.dim() != 2 or weight.shape[1] != width or weight.stride() != (width, 1):
        raise ValueError(f"weight must be a contiguous [O, {width}]; got {tuple(weight.shape)}")
    if norm_weight.shape != (dim,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be a contiguous [{dim}]; got {tuple(norm_weight.shape)}")
    tiles = tiles or default_gated_tiles(tokens, core.device)
    out_features = weight.shape[0]
    out = torch.empty((tokens, out_features), dtype=core.dtype, device=core.device)
    heads_per_tile = min(next_power_of_2(heads), max(1, tiles.block_k // dim))
    _gated_norm_gemv_kernel[(triton.cdiv(out_features, tiles.rows),)](
        core, core.stride(0), z, z.stride(0), norm_weight, weight, out, tokens, out_features, heads, eps,
        TOKENS=token_block(tokens, tiles.rows), ROWS=tiles.rows, HEADS_PER_TILE=next_power_of_2(heads_per_tile),
        DV=dim, PDL=tiles.pdl, num_warps=tiles.warps, num_stages=tiles.stages, **launch_options(tiles.pdl),
    )
    return out
