"""Causal depthwise conv + SiLU: a single step for decode (updating each row's conv window in place), a few tokens
per row for speculative verify (the window after every token kept for rollback) and a whole prefill chunk
continuing from a window.

Twin: ``ninfer.kernels.reference.conv.causal_conv1d``. The window of slot ``s`` is ``conv_cache[s] [C, K-1]``, oldest input
first; after a step it holds the last K-1 inputs including the new one.

The decode step is ``norm_gemv``'s conv epilogue (``conv_windows`` / ``conv_epilogue``, which the norm-fused entry
projection runs inside its GEMV) over a row's channel block. With programmatic dependent launch (sm_90+) it loads the
slot id and the slot's window before ``griddepcontrol.wait`` and the taps and the new input column (the
predecessor's output) after it, where it also writes the window back: the predecessor (the input projection) writes
none of the early data, and everything older has finished by the time a dependent launch lets this kernel start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.triton.norm_gemv import (
    after_predecessor,
    conv_epilogue,
    conv_windows,
    launch_options,
    resolve_pdl,
)


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
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # this program's row, as the [1]-token tile of the helpers
    chans = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    window_ptr, mask, update, pasts = conv_windows(cache_ptr, cache_slot_stride, slots_ptr, chans, t, t >= 0, channels,
                                                   WINDOW)
    after_predecessor(PDL)  # the windows are not the predecessor's: they are already on their way
    x = tl.load(x_ptr + t[:, None] * x_stride + chans[None, :], mask=mask, other=0.0)
    y = conv_epilogue(x, chans, weight_ptr, window_ptr, mask, update, pasts, WINDOW)
    tl.store(out_ptr + t[:, None] * channels + chans[None, :], y, mask=mask)


def _check_conv_inputs(x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor) -> int:
    """Validate ``x [*, C]`` (contiguous rows), ``weight [C, K]`` and ``conv_cache [S, C, K-1]``; the window ``K-1``."""
    channels = x.shape[1]
    if x.stride(1) != 1:
        raise ValueError("x must have contiguous rows")
    if weight.shape[0] != channels or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [C={channels}, K]; got {tuple(weight.shape)}")
    window = weight.shape[1] - 1
    if conv_cache.dim() != 3 or tuple(conv_cache.shape[1:]) != (channels, window) or conv_cache.stride(2) != 1:
        raise ValueError(f"conv_cache must be [S, {channels}, {window}] with contiguous windows")
    if conv_cache.stride(1) != window:
        raise ValueError("conv_cache windows must be packed ([S, C, K-1] contiguous per slot)")
    return window


def causal_conv1d_update(
    x: torch.Tensor, weight: torch.Tensor, conv_cache: torch.Tensor, slots: torch.Tensor, *, pdl: bool | None = None
) -> torch.Tensor:
    """One token per row: ``x [B, C]`` (contiguous rows), ``weight [C, K]``, ``conv_cache [S, C, K-1]``, ``slots [B]``.

    Returns ``silu(conv) [B, C]`` in x.dtype and shifts the rows' windows in place; a negative slot ``-1 - s`` reads
    slot ``s`` and leaves its window as it is (``ForwardBatch.state_update_stops``). ``pdl``: programmatic dependent
    launch (None: wherever the device has it); then the kernel immediately before this one in the stream must not
    write ``weight``, ``conv_cache`` or ``slots``.
    """
    batch, channels = x.shape
    window = _check_conv_inputs(x, weight, conv_cache)
    pdl = resolve_pdl(pdl, x.device)
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    block = 256
    _conv_update_kernel[(batch, triton.cdiv(channels, block))](
        x, x.stride(0), weight, conv_cache, conv_cache.stride(0), slots, out, channels, WINDOW=window, BLOCK=block,
        PDL=pdl, **launch_options(pdl),
    )
    return out


@triton.jit
def _conv_verify_kernel(
    x_ptr,
    x_stride,
    weight_ptr,
    cache_ptr,
    cache_slot_stride,
    slots_ptr,
    out_ptr,
    states_ptr,
    channels,
    TOKENS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK: tl.constexpr,
    STORE_STATES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chans = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = chans < channels
    slot = tl.load(slots_ptr + row).to(tl.int64)
    window_ptr = cache_ptr + slot * cache_slot_stride + chans * WINDOW
    first = row * TOKENS
    # input at row time s (compile-time): the cached window for s < 0, else the row's token s
    for t in tl.static_range(TOKENS):
        acc = tl.zeros((BLOCK,), tl.float32)
        for j in tl.static_range(WINDOW + 1):
            source = t - WINDOW + j
            if source < 0:
                value = tl.load(window_ptr + (source + WINDOW), mask=mask, other=0.0)
            else:
                value = tl.load(x_ptr + (first + source) * x_stride + chans, mask=mask, other=0.0)
            tap = tl.load(weight_ptr + chans * (WINDOW + 1) + j, mask=mask, other=0.0)
            acc += value.to(tl.float32) * tap.to(tl.float32)
        y = acc * tl.sigmoid(acc)
        tl.store(out_ptr + (first + t) * channels + chans, y.to(out_ptr.dtype.element_ty), mask=mask)
        if STORE_STATES:  # the window after token t: inputs t-WINDOW+1 .. t
            for i in tl.static_range(WINDOW):
                kept = t - WINDOW + 1 + i
                if kept < 0:
                    value = tl.load(window_ptr + (kept + WINDOW), mask=mask, other=0.0)
                else:
                    value = tl.load(x_ptr + (first + kept) * x_stride + chans, mask=mask, other=0.0)
                state_offset = ((first + t) * channels + chans) * WINDOW + i
                tl.store(states_ptr + state_offset, value.to(states_ptr.dtype.element_ty), mask=mask)
    # the final window, slot by slot: slot i reads window slot TOKENS + i (> i) before anything overwrites it
    for i in tl.static_range(WINDOW):
        kept = TOKENS - WINDOW + i
        if kept < 0:
            value = tl.load(window_ptr + (kept + WINDOW), mask=mask, other=0.0)
        else:
            value = tl.load(x_ptr + (first + kept) * x_stride + chans, mask=mask, other=0.0)
        tl.store(window_ptr + i, value.to(cache_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_verify(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    tokens_per_row: int,
    states_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``tokens_per_row`` consecutive tokens per row: ``x [R*q, C]`` (contiguous rows, a row's tokens adjacent),
    ``weight [C, K]``, ``conv_cache [S, C, K-1]``, ``slots [R]``.

    Returns ``silu(conv) [R*q, C]`` in x.dtype and leaves each row's window after its last token in its slot. With
    ``states_out [>= R*q, C, K-1]`` (contiguous, any dtype) the window after every token is stored there too.
    """
    tokens, channels = x.shape
    rows = slots.shape[0]
    if tokens_per_row < 1 or rows * tokens_per_row != tokens:
        raise ValueError(f"{rows} rows x {tokens_per_row} tokens != {tokens} tokens")
    window = _check_conv_inputs(x, weight, conv_cache)
    if states_out is not None and (
        states_out.shape[0] < tokens or tuple(states_out.shape[1:]) != (channels, window)
        or not states_out.is_contiguous()
    ):
        raise ValueError(f"states_out must be a contiguous [>= {tokens}, {channels}, {window}] tensor")
    out = torch.empty((tokens, channels), dtype=x.dtype, device=x.device)
    block = 256
    _conv_verify_kernel[(rows, triton.cdiv(channels, block))](
        x, x.stride(0), weight, conv_cache, conv_cache.stride(0), slots, out,
        states_out if states_out is not None else out, channels,
        TOKENS=tokens_per_row, WINDOW=window, BLOCK=block, STORE_STATES=states_out is not None,
    )
    return out


@triton.jit(do_not_specialize=["length"])
def _conv_prefill_kernel(
    x_ptr,
    weight_ptr,
    state_ptr,
    out_ptr,
    length,
    channels,
    WINDOW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    times = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    chans = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_mask = chans < channels
    in_range = (times < length)[:, None] & chan_mask[None, :]
    x_row = x_ptr + row * length * channels
    state_row = state_ptr + row * channels * WINDOW
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(WINDOW + 1):
        source = times - WINDOW + j  # input time; negative times come from the window
        from_x = in_range & (source >= 0)[:, None]
        from_state = in_range & (source < 0)[:, None]
        value = tl.load(x_row + source[:, None] * channels + chans[None, :], mask=from_x, other=0.0).to(tl.float32)
        value += tl.load(
            state_row + chans[None, :] * WINDOW + (source + WINDOW)[:, None], mask=from_state, other=0.0
        ).to(tl.float32)
        acc += value * tl.load(weight_ptr + chans * (WINDOW + 1) + j, mask=chan_mask, other=0.0).to(tl.float32)[None, :]
    y = acc * tl.sigmoid(acc)
    out_tile = out_ptr + row * length * channels + times[:, None] * channels + chans[None, :]
    tl.store(out_tile, y.to(out_ptr.dtype.element_ty), mask=in_range)


def causal_conv1d_prefill(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk per row: ``x [B, T, C]``, ``weight [C, K]``, ``conv_state [B, C, K-1]`` (the inputs before ``x``).

    Returns ``(silu(conv) [B, T, C] in x.dtype, new window [B, C, K-1] in x.dtype)``; ``conv_state`` is not modified.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C]; got {tuple(x.shape)}")
    batch, length, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"weight must be [C={channels}, K]; got {tuple(weight.shape)}")
    window = weight.shape[1] - 1
    if tuple(conv_state.shape) != (batch, channels, window):
        raise ValueError(f"conv_state must be [B, C, K-1] = {(batch, channels, window)}; got {tuple(conv_state.shape)}")
    x, weight, conv_state = x.contiguous(), weight.contiguous(), conv_state.contiguous()
    out = torch.empty_like(x)
    if length:
        block_t, block_c = 32, 128
        grid = (batch, triton.cdiv(length, block_t), triton.cdiv(channels, block_c))
        _conv_prefill_kernel[grid](
            x, weight, conv_state, out, length, channels, WINDOW=window, BLOCK_T=block_t, BLOCK_C=block_c
        )
    if length >= window:
        new_state = x[:, length - window :].transpose(1, 2)
    else:
        new_state = torch.cat([conv_state[..., length:], x.transpose(1, 2).to(conv_state.dtype)], dim=-1)
    return out, new_state.to(x.dtype).contiguous()
