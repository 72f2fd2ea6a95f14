"""What the kernel tests share: the relative error they hold every kernel and traversal to."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (L2, in float64 on the host); ``out`` must be finite and shaped like ``ref``."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))
