"""How fast programs that hold weight rows in registers stream the persistent MoE's gate/up units (CUDA only).

Usage (repo root): ``python scripts/gpu_stream_sweep.py``. One Triton kernel streams units the way the persistent
MoE's gate/up phase does (unit ``u`` on program ``u % programs``; a unit is ``rows`` gate rows and as many up rows of
an expert, 2 MB apart, each multiplied with an input row and reduced to ``rows`` values that are stored), with
``ahead`` later units loading while a unit is reduced. For each launch shape (programs per SM, warps, register cap,
rows, ahead) it prints the registers and spills, then

* ``steady``: one launch over 40 blocks' units (1.5 GB): the pattern's sustained bandwidth;
* ``block``: 40 launches of one block's units each (37.7 MB: eight routed experts and the shared one), replayed
  in one graph: what a block's gate/up phase can get, ramp and tail included.

Round 12 asks whether the gate/up phase (~2.6 µs per iteration at two 8-warp programs per SM, one unit ahead) is
bound by the bytes each SM keeps in flight (then more units ahead or programs per SM raise ``steady``) or by each
phase's ramp and tail (then only ``block`` suffers).
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from gpu_moe_tune import graph_us

from ninfer.bench_synthetic import Clock, copy_bandwidth

HIDDEN, INNER, EXPERTS, SELECTED = 2048, 512, 256, 9
BLOCKS = 40
SHAPES = (  # (programs per SM, warps, register cap, rows per unit, units ahead)
    (2, 8, 128, 4, 1),  # the persistent MoE's gate/up phase today
    (2, 8, 128, 2, 1),
    (2, 8, 128, 2, 2),
    (2, 8, 128, 2, 3),
    (3, 8, 80, 2, 1),
    (1, 8, 255, 4, 2),
    (1, 8, 255, 4, 3),
    (1, 16, 128, 4, 1),
    (4, 4, 128, 2, 1),
    (4, 4, 128, 1, 2),
)


@triton.jit
def _load_unit(src_ptr, seed, unit, units, up_offset, tile):
    """The unit's tiles; unit ``u`` is block ``u % blocks`` of expert ``(u // blocks * 37 + seed) % 256`` (arithmetic,
    as the MoE's units come from the routing in registers: no dependent load before the tiles')."""
    valid = unit < units
    blocks = up_offset // tile.shape[1] // tile.shape[0]
    expert = ((unit // blocks) * 37 + seed) % 256
    offset = expert.to(tl.int64) * 2 * up_offset + (unit % blocks).to(tl.int64) * (tile.shape[0] * tile.shape[1])
    mask = (tile >= 0) & valid
    gate = tl.load(src_ptr + offset + tile, mask=mask, other=0.0)
    return gate, tl.load(src_ptr + offset + up_offset + tile, mask=mask, other=0.0)


@triton.jit
def _reduce_store(gate, up, x, out_ptr, unit, ROWS: tl.constexpr):
    g = tl.sum(gate.to(tl.float32) * x[None, :], axis=1)
    u = tl.sum(up.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + unit * ROWS + tl.arange(0, ROWS), (g * tl.sigmoid(g) * u).to(tl.bfloat16))


@triton.jit
def _stream_units(
    src_ptr, seed, x_ptr, out_ptr, units, up_offset, ROWS: tl.constexpr, COLS: tl.constexpr,
    AHEAD: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, COLS)
    tile = tl.arange(0, ROWS)[:, None] * COLS + cols[None, :]
    x = tl.load(x_ptr + cols).to(tl.float32)
    g0, u0 = _load_unit(src_ptr, seed, pid, units, up_offset, tile)
    if AHEAD == 1:
        for unit in range(pid, units, programs):
            g1, u1 = _load_unit(src_ptr, seed, unit + programs, units, up_offset, tile)
            _reduce_store(g0, u0, x, out_ptr, unit, ROWS)
            g0, u0 = g1, u1
    elif AHEAD == 2:
        g1, u1 = _load_unit(src_ptr, seed, pid + programs, units, up_offset, tile)
        for unit in range(pid, units, programs):
            g2, u2 = _load_unit(src_ptr, seed, unit + 2 * programs, units, up_offset, tile)
            _reduce_store(g0, u0, x, out_ptr, unit, ROWS)
            g0, u0, g1, u1 = g1, u1, g2, u2
    else:
        g1, u1 = _load_unit(src_ptr, seed, pid + programs, units, up_offset, tile)
        g2, u2 = _load_unit(src_ptr, seed, pid + 2 * programs, units, up_offset, tile)
        for unit in range(pid, units, programs):
            g3, u3 = _load_unit(src_ptr, seed, unit + 3 * programs, units, up_offset, tile)
            _reduce_store(g0, u0, x, out_ptr, unit, ROWS)
            g0, u0, g1, u1, g2, u2 = g1, u1, g2, u2, g3, u3


def main() -> int:
    device = torch.device("cuda")
    clock = Clock(device)
    bandwidth = copy_bandwidth(device, clock)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    source = torch.randn(EXPERTS * 2 * INNER * HIDDEN, dtype=torch.bfloat16, device=device) * 0.02
    x = torch.randn(HIDDEN, dtype=torch.bfloat16, device=device)
    block_bytes = SELECTED * 2 * INNER * HIDDEN * 2
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {block_bytes / 1e6:.1f} MB per block")
    table = []
    for per_sm, warps, registers, rows, ahead in SHAPES:
        programs = per_sm * sms
        units = SELECTED * INNER // rows
        out = torch.empty(BLOCKS * units * rows, dtype=torch.bfloat16, device=device)

        def launch(seed: int, blocks: int = 1):
            return _stream_units[(programs,)](
                source, seed, x, out, blocks * units, INNER * HIDDEN, ROWS=rows, COLS=HIDDEN, AHEAD=ahead,
                num_warps=warps, maxnreg=registers,
            )

        kernel = launch(0, BLOCKS)
        torch.cuda.synchronize()
        steady = min(clock.measure(lambda: launch(0, BLOCKS)) for _ in range(5)) * 1e3 / BLOCKS
        block = graph_us([lambda seed=seed: launch(seed * 9 * 37) for seed in range(BLOCKS)], clock)
        name = f"{per_sm}/SM x{warps}w r{registers} rows{rows} ahead{ahead}"
        regs = f"{kernel.n_regs} regs, {kernel.n_spills} spills"
        table.append((name, regs, steady, block))
        print(f"  {name:32s} {regs:20s} steady {steady:6.2f} us per block "
              f"({block_bytes / steady / 1e3:5.0f} GB/s), block {block:6.2f} us", flush=True)
    print("\n| shape | registers | steady µs per block (GB/s, of copy) | one block per launch µs |")
    for name, regs, steady, block in table:
        print(f"| {name} | {regs} | {steady:.2f} ({block_bytes / steady / 1e3:.0f}, "
              f"{block_bytes / steady * 1e6 / bandwidth:.0%}) | {block:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
