"""Read bandwidth of the persistent MoE's gate/up access pattern against contiguous layouts (CUDA only).

Usage (repo root): ``python scripts/gpu_chunk_bandwidth.py``. One Triton kernel streams "units" the way the
persistent MoE's gate/up phase does (264 programs of 8 warps at 128 registers, unit ``u`` on program ``u % 264``,
each unit's successor loading while it is reduced): a unit is two ``[4, 2048]`` bf16 tiles (16 KB each) at
``offset`` and ``offset + up_offset``. Per call 1152 units (37.7 MB: the 35B-A3B block's shared expert and eight
experts, 128 units each), ``CALLS`` calls over other random experts captured in one graph so that nothing is served
from L2. Layouts:

* ``experts``: as the model stores them, gate and up rows of an expert 2 MB apart (two 16 KB reads per unit);
* ``interleaved``: each unit's gate and up rows adjacent (one 32 KB read per unit);
* ``sequential``: the 37.7 MB as one contiguous range, units in order.

Prints µs per call and GB/s against the copy bandwidth. Round 10 asks whether the gate/up phase (10.3 µs for the
37.7 MB, ~3.7 TB/s, ~2.6 µs per unit) is at what the H200 gives this pattern, or whether a layout change would help.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from gpu_moe_tune import graph_us

from ninfer.bench_synthetic import Clock, copy_bandwidth

HIDDEN, ROWS, INNER, EXPERTS, SELECTED = 2048, 4, 512, 256, 9  # 35B-A3B: 8 routed + the shared expert
CALLS = 40
PROGRAMS_PER_SM, WARPS, MAX_REGISTERS = 2, 8, 128


@triton.jit
def _stream_units(src_ptr, offsets_ptr, out_ptr, units, up_offset, ROWS: tl.constexpr, COLS: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    tile = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    first = tl.load(offsets_ptr + pid)
    gate = tl.load(src_ptr + first + tile)
    up = tl.load(src_ptr + first + up_offset + tile)
    acc = tl.zeros((ROWS,), tl.float32)
    for unit in range(pid, units, programs):
        following = unit + programs
        offset = tl.load(offsets_ptr + following, mask=following < units, other=0)
        valid = (tile >= 0) & (following < units)
        next_gate = tl.load(src_ptr + offset + tile, mask=valid, other=0.0)
        next_up = tl.load(src_ptr + offset + up_offset + tile, mask=valid, other=0.0)
        acc += tl.sum(gate.to(tl.float32), axis=1) + tl.sum(up.to(tl.float32), axis=1)
        gate, up = next_gate, next_up
    tl.store(out_ptr + pid * ROWS + tl.arange(0, ROWS), acc)


def unit_offsets(layout: str, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Element offsets of the 1152 units' gate tiles in a buffer of ``EXPERTS`` experts, and the up tiles' offset."""
    expert_elements = 2 * INNER * HIDDEN
    units_per_expert = INNER // ROWS
    unit_elements = ROWS * HIDDEN
    if layout == "sequential":
        start = int(torch.randint(0, EXPERTS - SELECTED, (1,), generator=generator)) * expert_elements
        return torch.arange(SELECTED * units_per_expert) * 2 * unit_elements + start, unit_elements
    experts = torch.randperm(EXPERTS, generator=generator)[:SELECTED]
    block = torch.arange(units_per_expert)
    if layout == "experts":  # gate rows, then up rows INNER rows later
        offsets = experts[:, None] * expert_elements + block[None, :] * unit_elements
        return offsets.reshape(-1), INNER * HIDDEN
    offsets = experts[:, None] * expert_elements + block[None, :] * 2 * unit_elements  # interleaved
    return offsets.reshape(-1), unit_elements


def main() -> int:
    device = torch.device("cuda")
    clock = Clock(device)
    bandwidth = copy_bandwidth(device, clock)
    source = torch.zeros(EXPERTS * 2 * INNER * HIDDEN, dtype=torch.bfloat16, device=device)  # 1 GB
    programs = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(programs * ROWS, dtype=torch.float32, device=device)
    moved = SELECTED * 2 * INNER * HIDDEN * 2
    generator = torch.Generator().manual_seed(0)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {moved / 1e6:.1f} MB per call, {programs} programs")
    for layout in ("experts", "interleaved", "sequential"):
        calls = []
        for _ in range(CALLS):
            offsets, up_offset = unit_offsets(layout, generator)
            offsets = offsets.to(device)
            calls.append(lambda offsets=offsets, up_offset=up_offset: _stream_units[(programs,)](
                source, offsets, out, offsets.numel(), up_offset, ROWS=ROWS, COLS=HIDDEN, num_warps=WARPS,
                maxnreg=MAX_REGISTERS,
            ))
        us = graph_us(calls, clock)
        print(f"  {layout:12s} {us:6.2f} us per call, {moved / us / 1e3:5.0f} GB/s ({moved / us * 1e6 / bandwidth:.0%} "
              f"of copy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
