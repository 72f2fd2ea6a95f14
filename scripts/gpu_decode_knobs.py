"""The batch-1 decode step of one preset under launch-shape variants, in one process (CUDA only).

Usage (repo root)::

    python scripts/gpu_decode_knobs.py OUT_DIR qwen3.6-35b-a3b ["gated 8x2048" ...]

Each variant changes one knob of the captured step (graph segments, the Gated DeltaNet value split, the tiles of the
gated out projection, of ``act_gemv``, of the norm-fused entry projections at one row or of the persistent MoE, the
decode attention's split), recaptures the graphs and
measures graphs back to back and the overlapped step (all variants, or those named); ``base`` runs first and
last. Prints a table last; writes ``knobs_<preset>.json``. Tiles found in-step are what the defaults should be
(isolated sweeps miss the overlap with the predecessor under programmatic dependent launch).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import torch

from ninfer.bench_synthetic import Clock, bench_ninfer_decode, copy_bandwidth, step_bytes
from ninfer.kernels.triton import act_gemv, attention, moe_persistent, norm_gemv
from ninfer.kernels.triton.norm_gemv import GemvTiles
from ninfer.plugins.qwen3_5.synthetic import random_runtime

STEPS = 32
PATCHED = (
    (norm_gemv, "default_tiles"), (norm_gemv, "default_gated_tiles"), (act_gemv, "default_act_tiles"),
    (moe_persistent, "default_tiles"), (attention, "decode_split_tokens"),
)
ORIGINAL = {key: getattr(*key) for key in PATCHED}


def decoder_attribute(name: str, value: int) -> Callable[[object], None]:
    """A variant that sets an attribute of the decode runner."""
    return lambda decoder: setattr(decoder, name, value)


def tiles_of(key: tuple, rows: int, block_k: int, warps: int = 4, stages: int = 2) -> Callable[[object], None]:
    """A variant that gives the ``key`` tiles function these tiles at one row."""
    original = ORIGINAL[key]

    def tiles(tokens: int, device: torch.device | str = "cpu", *shape) -> GemvTiles:
        if tokens != 1:
            return original(tokens, device, *shape)
        return GemvTiles(rows=rows, block_k=block_k, warps=warps, stages=stages, pdl=original(tokens, device).pdl)

    return lambda decoder: setattr(*key, tiles)


def moe_tiles(**changes) -> Callable[[object], None]:
    """A variant that changes the persistent MoE block's tiles."""
    original = ORIGINAL[PATCHED[3]]
    return lambda decoder: setattr(moe_persistent, "default_tiles", lambda *a, **k: attrs.evolve(original(*a, **k),
                                                                                                 **changes))


def split_minimum(tokens: int) -> Callable[[object], None]:
    """A variant whose decode attention splits the keys into chunks of at least ``tokens`` (default 64)."""
    original = ORIGINAL[PATCHED[4]]
    return lambda decoder: setattr(attention, "decode_split_tokens", lambda most, **k: original(most, minimum=tokens))


GATED, ACT, ENTRY = PATCHED[1], PATCHED[2], PATCHED[0]
SEGMENTS_1 = decoder_attribute("graph_segments", 1)
VARIANTS: dict[str, tuple[Callable[[object], None], ...]] = {
    "base": (),
    "round 9 defaults": (tiles_of(GATED, 2, 2048), decoder_attribute("graph_segments", 4)),
    "moe 2-row units": (moe_tiles(gate_up_rows=2),),
    "moe 4 programs per SM of 4 warps": (moe_tiles(warps=4, programs_per_sm=4),),
    "moe 3 programs per SM at 80 registers": (
        moe_tiles(programs_per_sm=3, max_registers=80, gate_up_rows=2, down_rows=4),
    ),
    "moe 1 program per SM": (moe_tiles(programs_per_sm=1),),  # room for the next entry projection's programs
    "moe 1 program per SM of 16 warps at 96 registers": (
        moe_tiles(programs_per_sm=1, warps=16, max_registers=96, down_rows=16),
    ),
    "split 16": (split_minimum(16),),
    "split 32": (split_minimum(32),),
    "segments 1": (SEGMENTS_1,),
    "segments 2": (decoder_attribute("graph_segments", 2),),
    "separate norms": (decoder_attribute("norm_gemv_rows", 0),),  # every model folds them at one row since round 19
    "value split 2": (decoder_attribute("gdn_value_split", 2),),
    "value split 8": (decoder_attribute("gdn_value_split", 8),),
    "gated 4x2048": (tiles_of(GATED, 4, 2048),),
    "gated 8x2048": (tiles_of(GATED, 8, 2048),),
    "gated 4x4096": (tiles_of(GATED, 4, 4096),),
    "gated 8x2048 w8": (tiles_of(GATED, 8, 2048, warps=8),),
    "gated 16x2048 w8": (tiles_of(GATED, 16, 2048, warps=8),),
    "gated 4x2048 w8": (tiles_of(GATED, 4, 2048, warps=8),),
    "gated 8x1024": (tiles_of(GATED, 8, 1024),),
    "gated 16x1024 w8": (tiles_of(GATED, 16, 1024, warps=8),),
    "act 8x1024": (tiles_of(ACT, 8, 1024, stages=3),),
    "act 2x2048": (tiles_of(ACT, 2, 2048),),
    "act 4x2048": (tiles_of(ACT, 4, 2048),),
    "act 8x2048 w8": (tiles_of(ACT, 8, 2048, warps=8),),
    "act 4x4096": (tiles_of(ACT, 4, 4096),),
    "act 2x4096": (tiles_of(ACT, 2, 4096),),
    "act 4x4096 w8": (tiles_of(ACT, 4, 4096, warps=8),),
    "act 2x4096 w8": (tiles_of(ACT, 2, 4096, warps=8),),
    "act 4x2048 w8": (tiles_of(ACT, 4, 2048, warps=8),),
    "act 4x1024 s3": (tiles_of(ACT, 4, 1024, stages=3),),
    "entry 4x2048": (tiles_of(ENTRY, 4, 2048),),
    "entry 16x2048 w8": (tiles_of(ENTRY, 16, 2048, warps=8),),
    "entry 8x2048 w8": (tiles_of(ENTRY, 8, 2048, warps=8),),
    "entry 8x1024 s3": (tiles_of(ENTRY, 8, 1024, stages=3),),
    "entry 4x2048 w2": (tiles_of(ENTRY, 4, 2048, warps=2),),
    "gated 8x4096 w8 + segments 1": (tiles_of(GATED, 8, 4096, warps=8), SEGMENTS_1),
    "gated 4x4096 w8 + segments 1": (tiles_of(GATED, 4, 4096, warps=8), SEGMENTS_1),
    "gated 4x4096 + segments 1": (tiles_of(GATED, 4, 4096), SEGMENTS_1),
    "gated 8x2048 w8 + act 4x2048 + segments 1": (
        tiles_of(GATED, 8, 2048, warps=8), tiles_of(ACT, 4, 2048), SEGMENTS_1,
    ),
}


def main(out_dir: str, preset: str, *names: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    clock = Clock(device)
    bandwidth = copy_bandwidth(device, clock)
    runtime = random_runtime(preset, device=device)
    decoder = runtime.decoder
    defaults = {name: getattr(decoder, name) for name in ("graph_segments", "gdn_value_split", "norm_gemv_rows")}
    roofline_ms = step_bytes(runtime, 1, 256 + 4) / bandwidth * 1e3
    prompt = torch.randint(0, runtime.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    results: list[dict] = []
    for name in ["base", *(names or list(VARIANTS)[1:]), "base"]:
        for key, original in ORIGINAL.items():
            setattr(*key, original)
        for attribute, value in defaults.items():
            setattr(decoder, attribute, value)
        for change in VARIANTS[name]:
            change(decoder)
        decoder.reset()
        torch.cuda.synchronize()
        elapsed, tokens, replay = bench_ninfer_decode(runtime, prompt, STEPS, clock)
        overlapped, _, _ = bench_ninfer_decode(runtime, prompt, STEPS, clock, overlap=True)
        results.append({"variant": name, "graphs_ms": replay, "step_ms": elapsed / STEPS,
                        "overlapped_ms": overlapped / STEPS, "tokens": tokens})
        print(name, f"{replay:.3f} {overlapped / STEPS:.3f}", flush=True)
    (out / f"knobs_{preset}.json").write_text(json.dumps({"roofline_ms": roofline_ms, "runs": results}))
    print(f"\n{preset} roofline {roofline_ms:.3f} ms ({bandwidth / 1e9:.0f} GB/s copy)")
    print("| variant | graphs ms (of roofline) | overlapped step ms (of roofline) | same tokens |")
    for run in results:
        print(f"| {run['variant']} | {run['graphs_ms']:.3f} ({roofline_ms / run['graphs_ms']:.1%}) | "
              f"{run['overlapped_ms']:.3f} ({roofline_ms / run['overlapped_ms']:.1%}) | "
              f"{run['tokens'] == results[0]['tokens']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
