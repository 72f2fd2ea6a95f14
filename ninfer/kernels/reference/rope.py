"""Partial multimodal RoPE (MRoPE) with NeoX rotate-half, as used by the Qwen3.5 full-attention layers.

Only the first ``rotary_dim`` dims of each head rotate. Each of the ``rotary_dim // 2`` frequencies takes its
position from one axis of the 3-row (t, h, w) position ids: interleaved layout gives frequency i to h when
``i % 3 == 1`` and ``i < 3 * section[1]``, to w when ``i % 3 == 2`` and ``i < 3 * section[2]``, otherwise to t;
the contiguous layout gives the first ``section[0]`` to t, the next ``section[1]`` to h, the rest to w.
For text all three rows are equal and this is ordinary 1-D partial RoPE.
"""

from __future__ import annotations

from typing import Sequence

import torch


def rope_inverse_frequencies(rotary_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``1 / theta^(2i / rotary_dim)`` for ``i < rotary_dim // 2``, fp32."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    return 1.0 / (theta**exponents)


def mrope_axis_of_frequency(
    num_frequencies: int, mrope_section: Sequence[int], *, interleaved: bool, device: torch.device | str | None = None
) -> torch.Tensor:
    """For each frequency the position row (0 = t, 1 = h, 2 = w) it rotates by, int64 ``[num_frequencies]``."""
    if len(mrope_section) != 3 or sum(mrope_section) != num_frequencies:
        raise ValueError(
            f"mrope_section {list(mrope_section)} must have 3 entries summing to rotary_dim // 2 = {num_frequencies}"
        )
    axis = torch.zeros(num_frequencies, dtype=torch.int64)
    if interleaved:
        for row in (1, 2):
            axis[row : 3 * mrope_section[row] : 3] = row
    else:
        axis[mrope_section[0] : mrope_section[0] + mrope_section[1]] = 1
        axis[mrope_section[0] + mrope_section[1] :] = 2
    return axis.to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rotary_cos_sin(
    positions: torch.Tensor, inverse_frequencies: torch.Tensor, axis_of_frequency: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, 2F]`` fp32 for ``positions [3, T]`` given precomputed frequencies and their position rows."""
    if positions.dim() == 1:
        positions = positions.unsqueeze(0).expand(3, -1)
    if positions.dim() != 2 or positions.shape[0] != 3:
        raise ValueError(f"positions must be [3, T]; got {tuple(positions.shape)}")
    chosen = positions[axis_of_frequency].float()  # [F, T]: the position row of every frequency
    angles = chosen.transpose(0, 1) * inverse_frequencies  # [T, F]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def mrope_cos_sin(
    positions: torch.Tensor,
    *,
    rotary_dim: int,
    theta: float,
    mrope_section: Sequence[int],
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [T, rotary_dim]`` fp32 for ``positions [3, T]`` (or ``[T]``, used for all three rows)."""
    inv_freq = rope_inverse_frequencies(rotary_dim, theta, positions.device)
    axis = mrope_axis_of_frequency(inv_freq.numel(), mrope_section, interleaved=interleaved, device=positions.device)
    return rotary_cos_sin(positions, inv_freq, axis)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of ``x [T,H,D]`` by ``cos, sin [T, rotary_dim]`` (fp32 math)."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = x[..., :rotary_dim].float()
    return torch.cat([(rot * cos + _rotate_half(rot) * sin).to(x.dtype), x[..., rotary_dim:]], dim=-1)


def apply_mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    *,
    rotary_dim: int,
    theta: float,
    mrope_section: Sequence[int],
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rotary_dim`` dims of ``q [T,Hq,D]`` and ``k [T,Hk,D]`` (fp32 math, input dtypes kept)."""
    cos, sin = mrope_cos_sin(
        positions, rotary_dim=rotary_dim, theta=theta, mrope_section=mrope_section, interleaved=interleaved
    )
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
