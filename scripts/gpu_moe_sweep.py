"""Tile sweep of the batch-1 grouped MoE block as the decode step runs it, then the 35B-A3B step with the winner.

Usage (CUDA machine, repo root): ``python scripts/gpu_moe_sweep.py OUT_DIR`` (about 4 minutes).

1. The block as the decode step calls it (``grouped_moe_decode_add_norm``: router with the residual add and norm,
   grouped gate/up, grouped down; programmatic dependent launch on), ``CALLS`` blocks over rotating weight sets in one
   CUDA graph, so each block's kernels overlap the previous block's as they overlap the mixer's in a step. Tiles are
   swept one kernel at a time (gate/up, then down, then router), each keeping the best so far.
2. The whole ``qwen3.6-35b-a3b`` batch-1 step (random bf16 weights; benchmark step and graphs back to back) with
   the default tiles and with the winner, and a host/device trace of the winner (``gpu_step_trace``).

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
from ninfer.kernels.triton import moe_grouped
from ninfer.kernels.triton.moe_grouped import MoETiles, grouped_moe_decode_add_norm, moe_workspace
from ninfer.plugins.qwen3_5.synthetic import random_runtime

PRESET = "qwen3.6-35b-a3b"
DEFAULT_TILES = moe_grouped.default_tiles

SWEEP: dict[str, list[dict]] = {  # per kernel: tile changes tried on top of the best so far (the first: as is)
    "gate_up": [
        {}, *(dict(gate_up_rows=r, gate_up_block_k=k, gate_up_warps=w, gate_up_stages=s)
              for r, k, w, s in [(8, 2048, 8, 3), (2, 2048, 2, 3), (4, 2048, 8, 3), (8, 1024, 4, 3),
                                 (4, 1024, 4, 3), (16, 512, 4, 4)]),
    ],
    "down": [
        {}, *(dict(down_rows=r, down_warps=w, down_stages=s) for r, w, s in [(32, 4, 3), (8, 4, 3), (8, 2, 3)]),
    ],
    "router": [
        {}, *(dict(router_rows=r, router_split=s, router_block_k=k, router_warps=w)
              for r, s, k, w in [(16, 4, 512, 1), (8, 4, 512, 2), (4, 8, 256, 1), (8, 16, 128, 1), (16, 8, 256, 2),
                                 (32, 2, 1024, 4)]),
    ],
}


def block_sweep(device: torch.device, clock: Clock) -> tuple[dict, MoETiles]:
    layers = [MoELayer.random(device) for _ in range(WEIGHT_SETS)]
    workspace = moe_workspace(HIDDEN, device)
    norm_weight = torch.randn(HIDDEN, device=device, dtype=torch.bfloat16) * 0.1
    inputs = [(layers[i % WEIGHT_SETS], torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16),
               torch.randn(1, HIDDEN, device=device, dtype=torch.bfloat16)) for i in range(CALLS)]
    moved = sum(moe_bytes(layer, x + p) for layer, x, p in inputs) / CALLS

    def measure(tiles: MoETiles) -> float:
        calls = [
            lambda layer=layer, x=x, p=p: grouped_moe_decode_add_norm(
                x, p, norm_weight, 1e-6, gate_up=layer.gate_up, down=layer.down, top_k=TOP_K,
                shared_down=layer.shared_down, workspace=workspace, tiles=tiles, **layer.views())
            for layer, x, p in inputs
        ]
        return graph_us(calls, clock)

    best = DEFAULT_TILES(1, device)
    best_us = measure(best)
    table: dict = {"bytes_per_block": moved, "default_us": best_us}
    print(f"MoE block, default tiles: {best_us:.2f} us ({moved / best_us / 1e3:.0f} GB/s)", flush=True)
    for kind, changes in SWEEP.items():
        for change in changes[1:]:
            tiles = attrs.evolve(best, **change)
            try:
                us = measure(tiles)
            except Exception:
                traceback.print_exc()
                continue
            table[f"{kind} {json.dumps(change)}"] = us
            print(f"  {kind} {change}: {us:.2f} us ({moved / us / 1e3:.0f} GB/s)", flush=True)
            if us < best_us:
                best, best_us = tiles, us
    table["best_us"] = best_us
    table["best"] = attrs.asdict(best)
    return table, best


def step_variants(device: torch.device, clock: Clock, best: MoETiles, out: Path) -> dict:
    bandwidth = copy_bandwidth(device, clock)
    runtime = random_runtime(PRESET, device=device)
    config = runtime.config
    roofline_ms = step_bytes(runtime, 1, 256 + 4) / bandwidth * 1e3
    prompt = torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    result: dict = {"copy_bandwidth_gb_s": bandwidth / 1e9, "roofline_ms": roofline_ms}
    for label, tiles in (("default", None), ("best", best), ("default again", None)):
        moe_grouped.default_tiles = DEFAULT_TILES if tiles is None else (lambda rows, dev="cpu", t=tiles: (
            t if rows == 1 else DEFAULT_TILES(rows, dev)))
        runtime.decoder._graphs.clear()
        runtime.decoder._pool = None
        elapsed, _, replay_ms = bench_ninfer_decode(runtime, prompt, 32, clock)
        entry = {"step_ms": elapsed / 32, "replay_ms": replay_ms, "step_of_roofline": roofline_ms / (elapsed / 32),
                 "replay_of_roofline": roofline_ms / replay_ms}
        result[label] = entry
        print(f"step {label}: " + json.dumps({k: round(v, 4) for k, v in entry.items()}), flush=True)
    moe_grouped.default_tiles = lambda rows, dev="cpu": best if rows == 1 else DEFAULT_TILES(rows, dev)
    runtime.decoder._graphs.clear()
    runtime.decoder._pool = None
    trace_runtime(runtime, PRESET, out)
    moe_grouped.default_tiles = DEFAULT_TILES
    return result


def main(out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    clock = Clock(device)
    block, best = block_sweep(device, clock)
    result = {"block": block}
    (out / "moe_sweep.json").write_text(json.dumps(result, indent=2))
    result["step"] = step_variants(device, clock, best, out)
    (out / "moe_sweep.json").write_text(json.dumps(result, indent=2))
    print("\n==== summary ====")
    print(f"MoE block: default {block['default_us']:.2f} us -> best {block['best_us']:.2f} us; best tiles "
          f"{json.dumps(block['best'])}")
    step = result["step"]
    print(f"35B-A3B roofline {step['roofline_ms']:.3f} ms ({step['copy_bandwidth_gb_s']:.0f} GB/s copy)")
    for label in ("default", "best", "default again"):
        entry = step[label]
        print(f"| {label} | step {entry['step_ms']:.3f} ms ({entry['step_of_roofline']:.1%}) | graphs back to back "
              f"{entry['replay_ms']:.3f} ms ({entry['replay_of_roofline']:.1%}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
