"""RMS norms of the Qwen3.5 family, computed in fp32 and cast back to the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centered: bool) -> torch.Tensor:
    """RMS-normalise the last dim, then scale by ``1 + weight`` if ``zero_centered`` (Qwen3.5) else ``weight``."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps)
    scale = weight.float() + 1.0 if zero_centered else weight.float()
    return (normed * scale).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Gated-DeltaNet output norm: ``rms_norm(x) * weight * silu(z)`` (plain weight) over the last dim."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float() * F.silu(z.float())).to(x.dtype)
