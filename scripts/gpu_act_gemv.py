"""``act_gemv`` against cuBLAS at batch 1, alone and in the decode step (CUDA only).

Usage (CUDA machine, repo root): ``python scripts/gpu_act_gemv.py OUT_DIR [qwen3.6-27b qwen3.6-35b-a3b]``.

1. Micro, one row, each shape's calls over rotating weight copies captured in one CUDA graph (µs per call, weight
   GB/s): the 27B dense down projection (SiLU·mul + cuBLAS GEMV vs one ``act_gemv``), the 27B mixer output
   projections and the 35B-A3B attention output projection (cuBLAS vs ``act_gemv``), ``act_gemv`` over tile sets.
2. The batch-1 decode step of each preset (random bf16 weights; benchmark step and graphs back to back) with the
   projections on cuBLAS, with ``act_gemv`` for the down projection only, and for the output projections too (the
   default tiles, then the tiles fastest on the 27B down projection).

Prints the tables last; writes ``act_gemv.json`` to OUT_DIR.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from gpu_moe_tune import graph_us

from ninfer.bench_synthetic import Clock, bench_ninfer_decode, copy_bandwidth, step_bytes
from ninfer.kernels.triton import act_gemv as act_gemv_module
from ninfer.kernels.triton.act_gemv import act_gemv
from ninfer.kernels.triton.norms import silu_mul
from ninfer.plugins.qwen3_5.synthetic import random_runtime

DEFAULT_TILES = act_gemv_module.default_act_tiles
SHAPES = {  # label: (K, out rows, SiLU·mul input)
    "27B down (SiLU·mul)": (17408, 5120, True),
    "27B mixer out": (6144, 5120, False),
    "35B-A3B attention out": (4096, 2048, False),
}
TILE_SETS = [(4, 512, 4, 4), (8, 512, 4, 4), (2, 1024, 4, 3), (4, 1024, 4, 3), (8, 256, 4, 4), (16, 256, 8, 4),
             (4, 2048, 4, 2), (8, 1024, 8, 3)]
STEP_VARIANTS = {"cuBLAS": (0, 0), "act_gemv down": (1, 0), "act_gemv down + out": (1, 1)}


def micro(device: torch.device, clock: Clock) -> dict:
    result: dict = {}
    for label, (width, rows, silu) in SHAPES.items():
        copies = max(4, int(4e8 // (width * rows * 2)))
        weights = [torch.randn(rows, width, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, 2 * width if silu else width, device=device, dtype=torch.bfloat16)
        moved = rows * width * 2
        calls = 2 * copies
        table = {}

        def cublas(w: torch.Tensor) -> torch.Tensor:
            return F.linear(silu_mul(x) if silu else x, w)

        variants = {"cuBLAS": cublas}
        tiles_of = {f"act_gemv {tile}": tile for tile in TILE_SETS}
        for tile in TILE_SETS:
            tiles = attrs.evolve(DEFAULT_TILES(1, device), rows=tile[0], block_k=tile[1], warps=tile[2],
                                 stages=tile[3])
            variants[f"act_gemv {tile}"] = lambda w, t=tiles: act_gemv(x, w, silu_mul=silu, tiles=t)
        for name, call in variants.items():
            try:
                us = graph_us([lambda i=i, call=call, ws=weights: call(ws[i % copies]) for i in range(calls)], clock)
            except Exception:
                traceback.print_exc()
                continue
            table[name] = {"us": us, "gb_s": moved / us / 1e3, "tiles": tiles_of.get(name)}
            print(f"{label} {name}: {us:.2f} us ({moved / us / 1e3:.0f} GB/s)", flush=True)
        result[label] = table
        weights.clear()
        torch.cuda.empty_cache()
    return result


def best_tiles(table: dict) -> tuple[int, ...] | None:
    """(rows, block_k, warps, stages) of the fastest ``act_gemv`` in one shape's table."""
    measured = [(entry["us"], tuple(entry["tiles"])) for entry in table.values() if entry["tiles"]]
    return min(measured)[1] if measured else None


def step(name: str, device: torch.device, clock: Clock, tuned: tuple[int, ...] | None) -> dict:
    bandwidth = copy_bandwidth(device, clock)
    runtime = random_runtime(name, device=device)
    config = runtime.config
    roofline_ms = step_bytes(runtime, 1, 256 + 4) / bandwidth * 1e3
    prompt = torch.randint(0, config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    decoder = runtime.decoder
    result: dict = {"roofline_ms": roofline_ms, "copy_bandwidth_gb_s": bandwidth / 1e9}
    runs = [(label, rows, None) for label, rows in STEP_VARIANTS.items()]
    if tuned is not None:
        runs.append((f"act_gemv down + out, tiles {tuned}", (1, 1), tuned))
    runs.append(("cuBLAS again", (0, 0), None))
    for label, (down_rows, out_rows), tile in runs:
        decoder.down_gemv_rows, decoder.out_gemv_rows = down_rows, out_rows
        act_gemv_module.default_act_tiles = DEFAULT_TILES if tile is None else (
            lambda tokens, dev="cpu", silu_mul=False, t=tile: attrs.evolve(
                DEFAULT_TILES(tokens, dev, silu_mul), rows=t[0], block_k=t[1], warps=t[2], stages=t[3]
            ) if tokens == 1 else DEFAULT_TILES(tokens, dev, silu_mul))
        decoder.reset()
        try:
            elapsed, _, replay_ms = bench_ninfer_decode(runtime, prompt, 32, clock)
        except Exception:
            traceback.print_exc()
            continue
        entry = {"step_ms": elapsed / 32, "replay_ms": replay_ms, "step_of_roofline": roofline_ms / (elapsed / 32),
                 "replay_of_roofline": roofline_ms / replay_ms}
        result[label] = entry
        print(f"{name} step {label}: " + json.dumps({k: round(v, 4) for k, v in entry.items()}), flush=True)
    act_gemv_module.default_act_tiles = DEFAULT_TILES
    del runtime
    torch.cuda.empty_cache()
    return result


def main(out_dir: str, *names: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    clock = Clock(device)
    result: dict = {"micro": micro(device, clock)}
    tuned = best_tiles(result["micro"]["27B down (SiLU·mul)"])
    for name in names or ("qwen3.6-27b", "qwen3.6-35b-a3b"):
        result[name] = step(name, device, clock, tuned)
        (out / "act_gemv.json").write_text(json.dumps(result, indent=2))
    print("\n==== summary ====")
    for label, table in result["micro"].items():
        print(f"{label}: " + ", ".join(f"{k} {v['us']:.1f} us" for k, v in table.items()))
    for name in names or ("qwen3.6-27b", "qwen3.6-35b-a3b"):
        print(f"{name}: roofline {result[name]['roofline_ms']:.3f} ms")
        for label, entry in result[name].items():
            if isinstance(entry, dict):
                print(f"| {label} | step {entry['step_ms']:.3f} ms ({entry['step_of_roofline']:.1%}) | graphs "
                      f"{entry['replay_ms']:.3f} ms ({entry['replay_of_roofline']:.1%}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
