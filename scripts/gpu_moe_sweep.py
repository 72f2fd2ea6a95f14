"""The batch-1 MoE block: the grouped kernels (three launches) against the persistent kernel (one launch, grid
barriers) and a sweep of the persistent kernel's tiles, then the 35B-A3B step with each.

Usage (CUDA machine, repo root): ``python scripts/gpu_moe_sweep.py OUT_DIR`` (about 3 minutes).

1. The block as the decode step calls it (residual add and norm inside, programmatic dependent launch on), ``CALLS``
   blocks over rotating weight sets in one CUDA graph, so each block's kernels overlap the previous block's as they
   overlap the mixer's in a step. Every persistent variant's output is checked against the grouped kernels' first.
2. Where the fastest variant's time goes: each program's SM clock at the kernel's ``TRACE_POINTS`` (``trace``), per
   phase the median and the slowest program's duration, the span of a block and the gap between blocks.
3. The whole ``qwen3.6-35b-a3b`` batch-1 step (random bf16 weights; benchmark step and graphs back to back) with the
   grouped block, the persistent block's default tiles and the fastest variant, and a host/device trace of the
   fastest (``gpu_step_trace``).

Prints the tables last; writes ``moe_sweep.json`` to OUT_DIR.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import attrs
import torch
from gpu_moe_tune import CALLS, HIDDEN, TOP_K, WEIGHT_SETS, MoELayer, graph_us, moe_bytes
from gpu_step_trace import trace_runtime

from ninfer.bench_synthetic import Clock, bench_ninfer_decode, copy_bandwidth, step_bytes
from ninfer.kernels.triton import moe_persistent
from ninfer.kernels.triton.moe_grouped import grouped_moe_decode_add_norm, moe_workspace
from ninfer.kernels.triton.moe_persistent import (
    TRACE_POINTS, TRACE_SLOTS, PersistentTiles, default_programs, persistent_moe_decode,
)
from ninfer.plugins.qwen3_5.synthetic import random_runtime

PRESET = "qwen3.6-35b-a3b"
DEFAULT_TILES = moe_persistent.default_tiles
VARIANTS = [  # changes of the persistent kernel's tiles, each on top of the default
    {}, dict(gate_up_rows=2), dict(warps=16, programs_per_sm=1, max_registers=None, down_rows=8),
]


@attrs.define
class Blocks:
    """``CALLS`` MoE blocks over rotating weight sets, as the decode step calls them."""

    inputs: list
    norm_weight: torch.Tensor
    workspace: torch.Tensor
    moved: float  # weight bytes per block

    @classmethod
    def random(cls, device: torch.device) -> "Blocks":
        layers = [MoELayer.random(device) for _ in range(WEIGHT_SETS)]
        inputs = [(layers[i % WEIGHT_SETS], torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16),
                   torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16)) for i in range(CALLS)]
        moved = sum(moe_bytes(layer, x + p) for layer, x, p in inputs) / CALLS
        norm_weight = torch.randn(HIDDEN, device=device, dtype=torch.bfloat16) * 0.1
        return cls(inputs, norm_weight, moe_workspace(HIDDEN, device), moved)

    def grouped(self, index: int) -> torch.Tensor:
        layer, x, p = self.inputs[index]
        return grouped_moe_decode_add_norm(x, p, self.norm_weight, 1e-6, gate_up=layer.gate_up, down=layer.down,
                                           top_k=TOP_K, shared_down=layer.shared_down, workspace=self.workspace,
                                           **layer.views())[0]

    def persistent(self, index: int, tiles: PersistentTiles, trace: torch.Tensor | None = None) -> torch.Tensor:
        layer, x, p = self.inputs[index]
        return persistent_moe_decode(x, p, self.norm_weight, 1e-6, gate_up=layer.gate_up, down=layer.down,
                                     top_k=TOP_K, shared_down=layer.shared_down, workspace=self.workspace,
                                     tiles=tiles, trace=trace, **layer.views())[0]


def block_sweep(blocks: Blocks, clock: Clock) -> tuple[dict, PersistentTiles]:
    device = blocks.norm_weight.device
    moved = blocks.moved
    reference = blocks.grouped(0)
    grouped_us = graph_us([lambda i=i: blocks.grouped(i) for i in range(CALLS)], clock)
    table: dict = {"bytes_per_block": moved, "grouped_us": grouped_us, "variants": {}}
    print(f"MoE block, grouped: {grouped_us:.2f} us ({moved / grouped_us / 1e3:.0f} GB/s)", flush=True)
    best, best_us = None, float("inf")
    for change in VARIANTS:
        tiles = attrs.evolve(DEFAULT_TILES(device), **change)
        try:
            out = blocks.persistent(0, tiles)
            error = float((out.float() - reference.float()).norm() / reference.float().norm())
            us = graph_us([lambda i=i: blocks.persistent(i, tiles) for i in range(CALLS)], clock)
        except Exception:
            traceback.print_exc()
            continue
        table["variants"][json.dumps(change)] = {"us": us, "rel_err_vs_grouped": error}
        print(f"  persistent {change}: {us:.2f} us ({moved / us / 1e3:.0f} GB/s), rel err {error:.1e}", flush=True)
        if us < best_us and error < 1e-2:
            best, best_us = tiles, us
    table["best_us"] = best_us
    table["best"] = attrs.asdict(best) if best is not None else None
    assert not blocks.workspace.any()
    return table, best


def phase_spans(stamps: torch.Tensor, points: int) -> tuple[float, dict[int, tuple[float, float]]]:
    """From trace stamps ``[calls, programs, TRACE_SLOTS]`` with ``points`` clock points: the SM clock's cycles per
    ns and, per phase ``k`` (point ``k - 1`` to ``k``), the median over calls of the median and of the slowest
    program's microseconds."""
    cycles_per_ns = ((stamps[:, :, points - 1] - stamps[:, :, 0]) / (stamps[:, :, 15] - stamps[:, :, 14])).median()
    spans = {}
    for k in range(1, points):
        us = (stamps[:, :, k] - stamps[:, :, k - 1]) / cycles_per_ns / 1e3
        spans[k] = (float(us.median(dim=1).values.median()), float(us.max(dim=1).values.median()))
    return float(cycles_per_ns), spans


def phase_profile(blocks: Blocks, clock: Clock, tiles: PersistentTiles) -> dict:
    """Per phase of the persistent kernel: median over blocks of the median and the slowest program's microseconds;
    the span of a block (first start to last end) and the gap from one block's last end to the next one's first
    start."""
    device = blocks.norm_weight.device
    programs = default_programs(device, tiles)
    traces = [torch.zeros(programs, TRACE_SLOTS, dtype=torch.int64, device=device) for _ in range(CALLS)]
    graph_us([lambda i=i: blocks.persistent(i, tiles, traces[i]) for i in range(CALLS)], clock)
    stamps = torch.stack(traces).double().cpu()  # [calls, programs, slots]
    cycles_per_ns, spans = phase_spans(stamps, len(TRACE_POINTS))
    profile: dict = {"cycles_per_ns": cycles_per_ns}
    for k, (median_us, slowest_us) in spans.items():
        profile[f"{TRACE_POINTS[k - 1]} -> {TRACE_POINTS[k]}"] = {"median_us": median_us, "slowest_us": slowest_us}
    starts, ends = stamps[:, :, 14], stamps[:, :, 15]
    profile["block_span_us"] = float(((ends.max(dim=1).values - starts.min(dim=1).values) / 1e3).median())
    profile["gap_us"] = float(((starts.min(dim=1).values[1:] - ends.max(dim=1).values[:-1]) / 1e3).median())
    for name, value in profile.items():
        print(f"  {name}: {json.dumps(value)}", flush=True)
    return profile


def step_variants(device: torch.device, clock: Clock, best: PersistentTiles | None, out: Path) -> dict:
    bandwidth = copy_bandwidth(device, clock)
    runtime = random_runtime(PRESET, device=device)
    config = runtime.config
    roofline_ms = step_bytes(runtime, 1, 256 + 4) / bandwidth * 1e3
    prompt = torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    result: dict = {"copy_bandwidth_gb_s": bandwidth / 1e9, "roofline_ms": roofline_ms}
    decoder = runtime.decoder
    variants = [("grouped", False, None), ("persistent default", True, None), ("persistent best", True, best),
                ("grouped again", False, None)]
    for label, persistent, tiles in variants:
        moe_persistent.default_tiles = DEFAULT_TILES if tiles is None else (lambda dev="cpu", t=tiles: t)
        decoder.persistent_moe = persistent
        decoder.reset()
        elapsed, _, replay_ms = bench_ninfer_decode(runtime, prompt, 32, clock)
        entry = {"step_ms": elapsed / 32, "replay_ms": replay_ms, "step_of_roofline": roofline_ms / (elapsed / 32),
                 "replay_of_roofline": roofline_ms / replay_ms}
        result[label] = entry
        print(f"step {label}: " + json.dumps({k: round(v, 4) for k, v in entry.items()}), flush=True)
    moe_persistent.default_tiles = DEFAULT_TILES if best is None else (lambda dev="cpu": best)
    decoder.persistent_moe = True
    decoder.reset()
    trace_runtime(runtime, PRESET, out)
    moe_persistent.default_tiles = DEFAULT_TILES
    return result


def main(out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    clock = Clock(device)
    blocks = Blocks.random(device)
    block, best = block_sweep(blocks, clock)
    result = {"block": block, "phases": phase_profile(blocks, clock, best or DEFAULT_TILES(device))}
    del blocks
    (out / "moe_sweep.json").write_text(json.dumps(result, indent=2))
    result["step"] = step_variants(device, clock, best, out)
    (out / "moe_sweep.json").write_text(json.dumps(result, indent=2))
    print("\n==== summary ====")
    print(f"MoE block: grouped {block['grouped_us']:.2f} us, persistent best {block['best_us']:.2f} us "
          f"{json.dumps(block['best'])}")
    for change, entry in block["variants"].items():
        print(f"  {change}: {entry['us']:.2f} us")
    for name, value in result["phases"].items():
        print(f"  phase {name}: {json.dumps(value)}")
    step = result["step"]
    print(f"35B-A3B roofline {step['roofline_ms']:.3f} ms ({step['copy_bandwidth_gb_s']:.0f} GB/s copy)")
    for label in ("grouped", "persistent default", "persistent best", "grouped again"):
        entry = step[label]
        print(f"| {label} | step {entry['step_ms']:.3f} ms ({entry['step_of_roofline']:.1%}) | graphs back to back "
              f"{entry['replay_ms']:.3f} ms ({entry['replay_of_roofline']:.1%}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
