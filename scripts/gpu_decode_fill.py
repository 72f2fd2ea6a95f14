"""How much of the benchmark's batch-1 decode time is the pipeline's fill (CUDA only).

Usage (repo root): ``python scripts/gpu_decode_fill.py OUT_DIR qwen3.6-35b-a3b [STEPS ...]``

Runs the overlapped decode loop of ``bench_ninfer_decode(overlap=True)`` for each step count (alternating, twice)
with three CUDA events on the stream: before the loop (where the clock started before round 19: the device idles
until the host has launched the first step), after the first step and after the last. Prints per step: the time
from the loop's start (first event to last over all steps) and the steady state that ``bench_ninfer_decode`` times
since round 19 (second event to last over the steps after the first), and the same for the captured graphs
replayed back to back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ninfer.bench_synthetic import Rows
from ninfer.core.engine.transfer import HostCopy
from ninfer.plugins.qwen3_5.synthetic import random_runtime

CONTEXT, WARMUP = 256, 8


def timed(work_first, work_rest) -> tuple[float, float]:
    """(ms from the start to the end, ms from the end of ``work_first`` to the end) of the stream's work."""
    start, first, stop = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    torch.cuda.synchronize()
    start.record()
    state = work_first()
    first.record()
    work_rest(state)
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop), first.elapsed_time(stop)


def overlapped(runtime, prompt: torch.Tensor, steps: int) -> tuple[float, float]:
    rows = Rows(runtime, 1, CONTEXT + WARMUP + steps + 4)
    with torch.no_grad():
        ids = rows.forward([prompt]).to(runtime.model.device)
        for _ in range(WARMUP):
            ids = rows.forward_ahead(ids)
        host = ids.cpu()

        def first():
            return rows.forward_ahead(host.to(runtime.model.device))

        def rest(ids):
            for _ in range(steps - 1):
                copy = HostCopy(ids)
                following = rows.forward_ahead(ids)
                copy.wait()
                ids = following
            ids.cpu()

        return timed(first, rest)


def replays(runtime, steps: int) -> tuple[float, float]:
    step = runtime.decoder.captured(1)[-1]
    return timed(step.replay, lambda _: [step.replay() for _ in range(steps - 1)])


def main(out_dir: str, preset: str, *counts: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runtime = random_runtime(preset, device=torch.device("cuda"))
    prompt = torch.randint(0, runtime.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0))
    results = []
    for _ in range(2):
        for steps in [int(c) for c in counts] or [32, 128]:
            total, after_first = overlapped(runtime, prompt, steps)
            replay_total, replay_after = replays(runtime, steps)
            results.append({
                "steps": steps, "overlapped_ms": total / steps, "overlapped_steady_ms": after_first / (steps - 1),
                "graphs_ms": replay_total / steps, "graphs_steady_ms": replay_after / (steps - 1),
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
