"""The one-row lm_head on the H200: cuBLAS after a norm launch against the norm-fused Triton GEMV, by launch shape.

Usage (repo root, CUDA): ``python scripts/gpu_lm_head.py``. For the 35B-A3B (hidden 2048) and 27B (hidden 5120)
lm_heads of 248320 rows (random bf16), it replays 20 one-row steps in a CUDA graph and prints µs per step and the
weight bytes per µs for: ``add_rms_norm`` then ``F.linear(...).float()`` (what the decode epilogue ran before round
17), and ``add_norm_gemv(..., out_dtype=float32)`` for each ``GemvTiles`` in ``TILES``; the copy bandwidth of the
same process is printed first (``ninfer.bench_synthetic.copy_bandwidth``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.bench_synthetic import Clock, copy_bandwidth
from ninfer.kernels.triton.norm_gemv import GemvTiles, add_norm_gemv
from ninfer.kernels.triton.norms import add_rms_norm

VOCAB, REPLAYS, EPS = 248320, 20, 1e-6
TILES = [  # (rows, block_k, warps): (8, 2048, 4) is the decode default at one row
    (8, 2048, 4), (4, 2048, 4), (16, 2048, 8), (8, 2048, 8), (8, 1024, 4), (16, 1024, 4),
]


def graph_us(step, clock: Clock) -> float:
    """µs per call of ``step`` replayed ``REPLAYS`` times in one CUDA graph (after a warm-up call)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS):
            step()
    graph.replay()
    return min(clock.measure(graph.replay) for _ in range(3)) * 1000 / REPLAYS


def main() -> None:
    device = torch.device("cuda")
    clock = Clock(device)
    print(f"copy bandwidth {copy_bandwidth(device, clock) / 1e9:.0f} GB/s")
    print("| hidden | variant | µs per step | GB/s of weights |")
    for hidden in (2048, 5120):
        weight = (torch.randn(VOCAB, hidden, device=device) * 0.02).to(torch.bfloat16)
        norm = (torch.randn(hidden, device=device) * 0.1).to(torch.bfloat16)
        row, pending = (torch.randn(2, 1, hidden, device=device)).to(torch.bfloat16)
        gigabytes = weight.numel() * weight.element_size() / 1e9

        def cublas() -> None:
            _, normed = add_rms_norm(pending, row, norm, EPS)
            F.linear(normed, weight).float()

        variants = {"norm + cuBLAS": cublas}
        for rows, block_k, warps in TILES:
            tiles = GemvTiles(rows=rows, block_k=block_k, warps=warps, stages=2, pdl=True)
            variants[f"add_norm_gemv {rows}x{block_k} w{warps}"] = (
                lambda tiles=tiles: add_norm_gemv(row, pending, norm, weight, EPS, out_dtype=torch.float32, tiles=tiles)
            )
        for name, step in variants.items():
            us = graph_us(step, clock)
            print(f"| {hidden} | {name} | {us:.1f} | {gigabytes * 1e6 / us:.0f} |")


if __name__ == "__main__":
    main()
