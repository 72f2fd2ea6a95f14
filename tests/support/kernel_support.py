"""What the kernel tests share: the relative error they hold every kernel and traversal to, and the check that
programmatic dependent launch in a CUDA graph changes no result."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (L2, in float64 on the host); ``out`` must be finite and shaped like ``ref``."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_pdl_graph_matches_plain(chain: Callable[[Any, bool], Any], inputs: Sequence[Any]) -> None:
    """``chain(input, pdl)`` for every input, launched with programmatic dependent launch and captured in one CUDA
    graph, gives exactly what the plain launches give (a tensor or a tuple of tensors per input)."""
    expected = [chain(x, False) for x in inputs]
    for x in inputs:  # compile outside the capture
        chain(x, True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [chain(x, True) for x in inputs]
    graph.replay()
    torch.cuda.synchronize()
    for out, ref in zip(outs, expected):
        for got, want in zip(_tensors(out), _tensors(ref)):
            assert torch.equal(got, want)


def _tensors(value: Any) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)
