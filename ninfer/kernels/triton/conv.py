"""Single-step causal depthwise conv + SiLU for decode, updating each row's conv window in place.

Twin: ``ninfer.kernels.conv.causal_conv1d`` with one new token per row. The window of slot ``s`` is
``conv_cache[s] [C, K-1]``, oldest input first; after the step it holds the last K-1 inputs including the new one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_update_kernel(
    x_ptr,
    x_stride,
    weight_ptr,
    cache_ptr,
    cache_slot_stride,
    slots_ptr,
    out_ptr,
    channels,
    WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chans = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = chans < channels
    slot = tl.load(slots_ptr + row).to(tl.int64)
    window_ptr = cache_ptr + slot * cache_slot_stride + chans * WINDOW
    x = tl.load(x_ptr + row * x_stride + chans, mask=mask, other=0.0)
    acc = x.to(tl.float32) * tl.load(weight_ptr + chans * (WINDOW + 1) + WINDOW, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(WINDOW):
        past = tl.load(window_ptr + j, mask=mask, other=0.0)
        acc += past.to(tl.float32) * tl.load(weight_ptr + chans * (WINDOW + 1) + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(window_ptr + (j - 1), past, mask=mask)
    tl.store(window_ptr + (WINDOW - 1), x.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + row * channels + chans, (acc * tl.sigmoid(acc)).to(x.dtype), mask=mask)


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One token per row: ``x [B, C]`` (contiguous rows), ``weight [C, K]``, ``conv_cache [S, C, K-1]``, ``slots [B]``.

    Returns ``silu(conv) [B, C]`` in x.dtype and shifts the rows' windows in place.
    """
    batch, channels = x.shape
    if x.stride(1) != 1:
        raise ValueError("x must have contiguous rows")
    if weight.shape[0] != channels or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [C={channels}, K]; got {tuple(weight.shape)}")
    window = weight.shape[1] - 1
    if conv_cache.dim() != 3 or tuple(conv_cache.shape[1:]) != (channels, window) or conv_cache.stride(2) != 1:
        raise ValueError(f"conv_cache must be [S, {channels}, {window}] with contiguous windows")
    if conv_cache.stride(1) != window:
        raise ValueError("conv_cache windows must be packed ([S, C, K-1] contiguous per slot)")
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    block = 256
    _conv_update_kernel[(batch, triton.cdiv(channels, block))](
        x, x.stride(0), weight, conv_cache, conv_cache.stride(0), slots, out, channels, WINDOW=window, BLOCK=block
    )
    return out
