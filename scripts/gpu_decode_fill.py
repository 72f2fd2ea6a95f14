"""How much of the benchmark's batch-1 decode time is the pipeline's fill (CUDA only).

Usage (repo root): ``python scripts/gpu_decode_fill.py OUT_DIR qwen3.6-35b-a3b [STEPS ...]``

Runs ``bench_ninfer_decode(overlap=True)`` for each step count (alternating, twice) with a clock that puts three
CUDA events on the stream: before the loop (where the clock started before round 19: the device idles until the host
has launched the first step), after the first step and after the last. Prints per step: the time
from the loop's start (first event to last over all steps) and the steady state that ``bench_ninfer_decode`` times
since round 19 (second event to last over the steps after the first), and the same for the captured graphs
replayed back to back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ninfer.bench_synthetic import Clock, bench_ninfer_decode
from ninfer.plugins.qwen3_5.synthetic import random_runtime

CONTEXT = 256


class StartAndMarkClock(Clock):
    """``measure_from_mark`` that also keeps the milliseconds from before ``work`` starts (``from_start``)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cuda"))
        self.from_start: list[float] = []

    def measure_from_mark(self, work) -> float:
        start, mark, stop = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        start.record()
        work(mark.record)
        stop.record()
        torch.cuda.synchronize()
        self.from_start.append(start.elapsed_time(stop))
        return mark.elapsed_time(stop)


def main(out_dir: str, preset: str, *counts: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runtime = random_runtime(preset, device=torch.device("cuda"))
    prompt = torch.randint(0, runtime.config.vocab_size, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    clock = StartAndMarkClock()
    results = []
    for _ in range(2):
        for steps in [int(c) for c in counts] or [32, 128]:
            steady, _, replay_steady = bench_ninfer_decode(runtime, prompt, steps, clock, overlap=True)
            overlapped_total, replay_total = clock.from_start[-2:]  # steps + 1 steps each
            results.append({
                "steps": steps, "overlapped_ms": overlapped_total / (steps + 1), "overlapped_steady_ms": steady / steps,
                "graphs_ms": replay_total / (steps + 1), "graphs_steady_ms": replay_steady,
            })
            print(json.dumps(results[-1]), flush=True)
    (out / f"fill_{preset}.json").write_text(json.dumps(results))
    print("| steps | overlapped ms/step from the start | steady after the first | graphs from the start | steady |")
    for r in results:
        print(f"| {r['steps']} | {r['overlapped_ms']:.4f} | {r['overlapped_steady_ms']:.4f} | {r['graphs_ms']:.4f} | "
              f"{r['graphs_steady_ms']:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
