"""Launch shapes of the prefill's bandwidth-bound Triton kernels at 27B shapes (CUDA only).

Usage (repo root): ``python scripts/gpu_prefill_kernels.py [tokens]`` (default 8192). Times, as the median of CUDA
event pairs, the chunk conv (``_conv_prefill_kernel``: ``[1, T, 10240]``, window 3) under several tile shapes and
the gated output norm (``gated_rms_norm``: ``[T, 48, 128]``, z a strided slice) with its default rows per program
and with one head per program, each against the time its bytes take at the measured copy bandwidth.
"""

from __future__ import annotations

import statistics
import sys

import torch
import triton

from ninfer.bench_synthetic import Clock, copy_bandwidth
from ninfer.kernels.triton import norms
from ninfer.kernels.triton.conv import _conv_prefill_kernel

CONV_SHAPES = [(32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8), (128, 128, 8), (16, 256, 4), (8, 512, 4)]
HEADS, DIM, CHANNELS, WINDOW = 48, 128, 10240, 3


def median_us(clock: Clock, run, repeats: int = 20) -> float:
    run()
    return statistics.median(clock.measure(run) for _ in range(repeats)) * 1e3


def main(tokens: str = "8192") -> int:
    length = int(tokens)
    device = torch.device("cuda")
    clock = Clock(device)
    bandwidth = copy_bandwidth(device, clock)
    x = torch.randn(1, length, CHANNELS, device=device, dtype=torch.bfloat16)
    weight = torch.randn(CHANNELS, WINDOW + 1, device=device, dtype=torch.bfloat16)
    state = torch.randn(1, CHANNELS, WINDOW, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(x)
    bytes_us = 2 * x.numel() * 2 / bandwidth * 1e6
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; conv [1, {length}, {CHANNELS}]: bytes {bytes_us:.1f} us")
    for block_t, block_c, warps in CONV_SHAPES:
        grid = (1, triton.cdiv(length, block_t), triton.cdiv(CHANNELS, block_c))
        us = median_us(clock, lambda: _conv_prefill_kernel[grid](
            x, weight, state, out, length, CHANNELS, WINDOW=WINDOW, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps
        ))
        print(f"  conv tiles {block_t}x{block_c} w{warps}: {us:.1f} us ({bytes_us / us:.0%} of bytes)")
    core = torch.randn(length, HEADS, DIM, device=device, dtype=torch.bfloat16)
    z = torch.randn(length, 2 * HEADS * DIM, device=device, dtype=torch.bfloat16)[:, : HEADS * DIM]
    z = z.view(length, HEADS, DIM)
    norm_weight = torch.randn(DIM, device=device, dtype=torch.bfloat16)
    bytes_us = 3 * core.numel() * 2 / bandwidth * 1e6
    print(f"gated norm [{length}, {HEADS}, {DIM}]: bytes {bytes_us:.1f} us")
    for elements in (norms.GATED_NORM_ELEMENTS, DIM, 4096, 8192):
        norms.GATED_NORM_ELEMENTS = elements
        us = median_us(clock, lambda: norms.gated_rms_norm(core, z, norm_weight, 1e-6))
        print(f"  gated norm {elements // DIM} heads per program: {us:.1f} us ({bytes_us / us:.0%} of bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
