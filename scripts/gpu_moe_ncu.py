"""The persistent MoE block under Nsight Compute: where its gate/up phase stalls (CUDA only, Firecracker runtime).

Usage (repo root)::

    ncu --clock-control none -k regex:_persistent_moe_kernel -s 4 -c 1 --set full -o OUT/moe \\
        python3 scripts/gpu_moe_ncu.py
    ncu --import OUT/moe.ncu-rep --page details > OUT/moe_ncu.txt
    ncu --import OUT/moe.ncu-rep --page source --csv > OUT/moe_source.csv   # stall reasons per source line

Runs ``CALLS`` blocks of ``gpu_moe_sweep``'s inputs (35B-A3B shapes, rotating weight sets) with the default tiles,
plainly launched (no graph), so the profiler can replay one of them after a few warm-up launches (``-s 4``).
Round 10 left the question open: each gate/up unit takes ~2.6 µs whatever its rows, and neither more bytes in flight
(shared memory, L2 prefetch, larger units) nor early address translations shortened it.
"""

from __future__ import annotations

import sys

import torch
from gpu_moe_sweep import Blocks
from gpu_moe_tune import CALLS

from ninfer.kernels.triton.moe_persistent import default_tiles


def main() -> int:
    device = torch.device("cuda")
    blocks = Blocks.random(device)
    tiles = default_tiles(device)
    for index in range(CALLS):
        blocks.persistent(index, tiles)
    torch.cuda.synchronize()
    print("blocks run:", CALLS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
