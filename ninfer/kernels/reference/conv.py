"""The depthwise causal short convolution of Gated DeltaNet (followed by SiLU), continuing from a conv window."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    *,
    output_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv + SiLU over ``x [B,T,C]`` with ``weight [C,K]``, continuing from ``conv_state``.

    ``conv_state [B,C,K-1]`` holds the K-1 inputs before ``x`` (zeros for a fresh sequence; None means zeros).
    Computes in fp32 and returns ``(y [B,T,C] in x.dtype, new_state [B,C,K-1] in x.dtype, states or None)`` where
    ``states [B,T,C,K-1]`` is the window after each token. Serves prefill chunks and single-token updates alike.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C]; got {tuple(x.shape)}")
    batch, length, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"weight must be [C={channels}, K]; got {tuple(weight.shape)}")
    window = weight.shape[1] - 1
    if conv_state is None:
        conv_state = x.new_zeros((batch, channels, window))
    elif tuple(conv_state.shape) != (batch, channels, window):
        raise ValueError(f"conv_state must be [B, C, K-1] = {(batch, channels, window)}; got {tuple(conv_state.shape)}")
    sequence = torch.cat([conv_state.float(), x.float().transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
    # y[b, c, t] = sum_j sequence[b, c, t + j] * weight[c, j]
    y = F.silu((sequence.unfold(-1, window + 1, 1) * weight.float()[:, None, :]).sum(dim=-1))  # [B, C, T]
    new_state = sequence[..., sequence.shape[-1] - window :].to(x.dtype)
    states = None
    if output_states:
        # window after token t = sequence[t+1 : t+1+window]
        states = sequence.unfold(-1, window, 1)[:, :, 1 : length + 1].permute(0, 2, 1, 3).to(x.dtype)
    return y.transpose(1, 2).to(x.dtype), new_state, states
