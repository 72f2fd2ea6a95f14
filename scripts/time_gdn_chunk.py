"""Time the fused Triton chunked gated delta rule against ``batched_chunk_gated_delta_rule`` on CUDA.

Usage (CUDA machine, repo root on PYTHONPATH): ``python scripts/time_gdn_chunk.py [T] [Hk] [Hv] [D]`` (defaults:
one 27B layer at 8192 tokens: 16 key heads, 48 value heads, head dim 128). Inputs are laid out as the model feeds
them (bf16 q/k/v views split from one conv output, fp32 g and beta). Prints the median of CUDA-event timings of
each path and the relative difference of their outputs and final states (the batched path computes in fp32).
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from ninfer.kernels.prefill import batched_chunk_gated_delta_rule
from ninfer.kernels.triton.gated_delta_chunk import chunk_gated_delta_rule_fused


def model_like_inputs(length: int, key_heads: int, value_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """bf16 ``q, k, v`` views of one ``[1, T, C]`` conv output; fp32 gates as the model makes them; a random state."""
    conv = torch.randn(1, length, (2 * key_heads + value_heads) * dim, device="cuda").to(torch.bfloat16)
    q, k, v = torch.split(conv, [key_heads * dim, key_heads * dim, value_heads * dim], dim=-1)
    q, k = q.view(1, length, key_heads, dim), k.view(1, length, key_heads, dim)
    v = v.view(1, length, value_heads, dim)
    g = -F.softplus(torch.randn(1, length, value_heads, device="cuda")) * 0.1
    beta = torch.sigmoid(torch.randn(1, length, value_heads, device="cuda"))
    initial = torch.randn(1, value_heads, dim, dim, device="cuda") * 0.1
    return q, k, v, g, beta, initial


def _median_ms(fn, repeats: int, warmup: int) -> float:  # type: ignore[no-untyped-def]
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def time_chunk_gdn(
    T: int = 8192, Hk: int = 16, Hv: int = 48, D: int = 128, repeats: int = 20, warmup: int = 3
) -> dict[str, float]:
    """Median milliseconds of the fused and the batched path for one layer, their ratio and their difference."""
    inputs = model_like_inputs(T, Hk, Hv, D)
    fused_ms = _median_ms(lambda: chunk_gated_delta_rule_fused(*inputs), repeats, warmup)
    batched_ms = _median_ms(lambda: batched_chunk_gated_delta_rule(*inputs), repeats, warmup)
    fused_out, fused_final = chunk_gated_delta_rule_fused(*inputs)
    batched_out, batched_final = batched_chunk_gated_delta_rule(*inputs)
    return {
        "fused_ms": fused_ms,
        "batched_ms": batched_ms,
        "speedup": batched_ms / fused_ms,
        "out_rel_diff": _rel(fused_out, batched_out),
        "final_rel_diff": _rel(fused_final, batched_final),
    }


def main(argv: list[str]) -> int:
    dims = [int(a) for a in argv[1:5]]
    result = time_chunk_gdn(*dims)
    shape = dict(zip(("T", "Hk", "Hv", "D"), dims or (8192, 16, 48, 128)))
    print(shape, {k: round(v, 5) for k, v in result.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
