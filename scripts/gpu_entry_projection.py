"""The 35B-A3B GDN entry projection alone (CUDA only): ``add_norm_gemv`` with the conv epilogue at one row.

Usage (repo root): ``python scripts/gpu_entry_projection.py [LABEL]``. ``LAYERS`` projections of 12352 x 2048 over
as many weights (cold in L2), chained through their outputs as the step chains them and launched with
programmatic dependent launch, in one CUDA graph; prints µs per projection (20 replays back to back).
"""

from __future__ import annotations

import sys

import torch

from ninfer.bench_synthetic import Clock
from ninfer.kernels.triton.norm_gemv import ConvEpilogue, add_norm_gemv

LAYERS, HIDDEN, ROWS, CONV_CHANNELS, TAPS = 30, 2048, 12352, 8192, 4


def main(label: str = "entry") -> int:
    device = torch.device("cuda")
    clock = Clock(device)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device=device) * scale).to(torch.bfloat16)

    weights = [draw(ROWS, HIDDEN, scale=0.02) for _ in range(LAYERS)]
    norm = draw(HIDDEN, scale=0.1)
    slots = torch.zeros(1, device=device, dtype=torch.int64)
    conv = ConvEpilogue(draw(CONV_CHANNELS, TAPS), draw(1, CONV_CHANNELS, TAPS - 1), slots)
    hidden, pending = draw(1, HIDDEN), draw(1, HIDDEN)

    def chain() -> None:
        current, added = hidden, pending
        for weight in weights:
            current, projected, _ = add_norm_gemv(current, added, norm, weight, 1e-6, conv=conv)
            added = projected[:, :HIDDEN]

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        graph.replay()
    elapsed = clock.measure(lambda: [graph.replay() for _ in range(20)]) / 20
    print(f"{label}: {elapsed * 1e3 / LAYERS:.2f} us per entry projection "
          f"({ROWS} x {HIDDEN}, conv epilogue, PDL, cold weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
