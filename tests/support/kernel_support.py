"""What the kernel tests share: the device they run on and the skips that follow from it, the per-test seeding, the
relative error they hold every kernel and traversal to, and the check that programmatic dependent launch in a CUDA
graph changes no result.

The Triton tests run on CUDA; without a GPU in Triton's CPU interpreter when ``TRITON_INTERPRET=1`` (toy shapes, fp32),
otherwise they are skipped. A module that imports a Triton submodule calls ``skip_module_without_triton()`` first; one
that mixes pure-torch and Triton cases marks the Triton ones ``needs_triton``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest
import torch

from ninfer.kernels.triton import triton_available

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPE = torch.bfloat16 if CUDA else torch.float32  # the interpreter's bf16 is not faithful: fp32 there
TRITON = triton_available(DEVICE)  # the Triton kernels run on DEVICE (CUDA, or the interpreter on the CPU)

NEEDS_TRITON = "needs Triton on a CUDA device (or TRITON_INTERPRET=1)"
needs_triton = pytest.mark.skipif(not TRITON, reason=NEEDS_TRITON)
needs_cuda_triton = pytest.mark.skipif(not (CUDA and TRITON), reason="needs Triton on a CUDA device")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_cuda_graphs = pytest.mark.skipif(not CUDA, reason="CUDA graphs")
needs_gpu_pdl = pytest.mark.skipif(not CUDA, reason="programmatic dependent launch and CUDA graphs need a GPU")


def skip_module_without_triton() -> None:
    """Skips the calling test module (reported at the call) unless the Triton kernels run on ``DEVICE``; call it
    before the module imports a Triton submodule."""
    __tracebackhide__ = True
    if not TRITON:
        pytest.skip(NEEDS_TRITON, allow_module_level=True)


def seed_each_test(seed: int, *, autouse: bool = True) -> Any:
    """A fixture that seeds torch's global generator with ``seed`` before each test; a module assigns it to the
    fixture's name (``_seed = seed_each_test(1234)``, or ``seeded = seed_each_test(1234, autouse=False)``)."""

    @pytest.fixture(autouse=autouse)
    def seeded() -> None:
        torch.manual_seed(seed)

    return seeded


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
