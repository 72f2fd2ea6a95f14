"""The persistent MoE's gate/up access pattern streamed through shared memory by TMA, several units in flight
(CUDA sm_90 only; Triton's Gluon dialect).

Usage (repo root): ``python scripts/gpu_tma_stream.py``. The same 1152 units per call as
``scripts/gpu_chunk_bandwidth.py`` (a unit: 4 gate rows and the 4 up rows 2 MB later, or both adjacent), but each
program keeps ``STAGES`` units in flight in shared memory (TMA copies completing on one mbarrier per stage) instead
of one unit in registers. Prints µs per call and GB/s for programs per SM × stages. If this streams the pattern
markedly faster than the register version, the gate/up phase (~2.6 µs per unit, round 10) is bound by the bytes a
program keeps in flight, and a TMA pipeline is the change for the MoE kernel; if not, the DRAM side is the limit.
"""

from __future__ import annotations

import sys

import torch
from gpu_chunk_bandwidth import CALLS, EXPERTS, HIDDEN, INNER, ROWS, SELECTED, unit_offsets
from gpu_moe_tune import graph_us
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ninfer.bench_synthetic import Clock, copy_bandwidth

BOX = 256  # columns per TMA copy (a box dimension holds at most 256 elements)
SHAPES = [(1, 6, 8), (1, 4, 8), (2, 3, 8), (2, 2, 8), (1, 6, 4)]  # (programs per SM, stages, warps)


@gluon.jit
def _issue(desc, offsets_ptr, unit, units, up_rows, smem, bar, stage, PIECES: gl.constexpr, ROWS: gl.constexpr,
           BOX: gl.constexpr):
    """Start the TMA copies of ``unit``'s gate and up rows into ``stage`` (nothing past the last unit)."""
    valid = unit < units
    row = gl.load(offsets_ptr + gl.minimum(unit, units - 1)).to(gl.int32)
    mbarrier.expect(bar, 2 * PIECES * ROWS * BOX * 2, pred=valid)
    for piece in gl.static_range(PIECES):
        tma.async_copy_global_to_shared(desc, [row, piece * BOX], bar, smem.index(stage * 2 * PIECES + piece),
                                        pred=valid)
        tma.async_copy_global_to_shared(desc, [row + up_rows, piece * BOX], bar,
                                        smem.index(stage * 2 * PIECES + PIECES + piece), pred=valid)


@gluon.jit
def _stream_units_tma(desc, offsets_ptr, out_ptr, units, up_rows, STAGES: gl.constexpr, ROWS: gl.constexpr,
                      COLS: gl.constexpr, BOX: gl.constexpr, WARPS: gl.constexpr):
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    PIECES: gl.constexpr = COLS // BOX
    smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 2 * PIECES, ROWS, BOX], desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(ready.index(stage), count=1)
    fence_async_shared()
    for stage in gl.static_range(STAGES):
        _issue(desc, offsets_ptr, pid + stage * programs, units, up_rows, smem, ready.index(stage), stage, PIECES,
               ROWS, BOX)
    layout: gl.constexpr = gl.BlockedLayout([1, BOX // (32 * (WARPS // ROWS))], [1, 32], [ROWS, WARPS // ROWS], [1, 0])
    acc = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, layout))
    for i in range(gl.cdiv(units - pid, programs)):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        for piece in gl.static_range(2 * PIECES):
            acc += gl.sum(smem.index(slot * 2 * PIECES + piece).load(layout).to(gl.float32), axis=1)
        gl.thread_barrier()  # every warp has read the stage before TMA writes it again
        fence_async_shared()
        _issue(desc, offsets_ptr, pid + (i + STAGES) * programs, units, up_rows, smem, ready.index(slot), slot,
               PIECES, ROWS, BOX)
    gl.store(out_ptr + pid * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout)), acc)


def main() -> int:
    device = torch.device("cuda")
    clock = Clock(device)
    bandwidth = copy_bandwidth(device, clock)
    source = torch.zeros(EXPERTS * 2 * INNER, HIDDEN, dtype=torch.bfloat16, device=device)  # rows of 2048
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor.from_tensor(source, [ROWS, BOX], layout)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    moved = SELECTED * 2 * INNER * HIDDEN * 2
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {moved / 1e6:.1f} MB per call")
    for name in ("experts", "interleaved", "sequential"):
        generator = torch.Generator().manual_seed(0)
        sets = [unit_offsets(name, generator) for _ in range(CALLS)]
        rows = [((offsets // HIDDEN).to(torch.int32).to(device), up_offset // HIDDEN) for offsets, up_offset in sets]
        for per_sm, stages, warps in SHAPES:
            programs = per_sm * sms
            out = torch.empty(programs * ROWS, dtype=torch.float32, device=device)
            calls = [lambda r=r, up=up: _stream_units_tma[(programs,)](
                desc, r, out, r.numel(), up, STAGES=stages, ROWS=ROWS, COLS=HIDDEN, BOX=BOX, WARPS=warps,
                num_warps=warps,
            ) for r, up in rows]
            try:
                us = graph_us(calls, clock)
            except Exception as exc:  # report and go on: one lease, every shape counts
                print(f"  {name:12s} {per_sm}/SM x {stages} stages w{warps}: failed ({exc})")
                continue
            print(f"  {name:12s} {per_sm}/SM x {stages} stages w{warps}: {us:6.2f} us per call, "
                  f"{moved / us / 1e3:5.0f} GB/s ({moved / us * 1e6 / bandwidth:.0%} of copy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
