"""Does Python's garbage collector cost the benchmark's decode steps time? (CUDA only)

Usage (CUDA machine): ``python scripts/gpu_gc_check.py qwen3.6-27b qwen3.6-35b-a3b``. Per preset (random bf16
weights), the batch-1 benchmark step (``bench_ninfer_decode``, 64 steps, graphs captured) three times each with the
collector as it is, after ``gc.freeze()`` (the objects alive after loading leave the collected generations), and with
the collector disabled; the graph replay back to back beside each.
"""

from __future__ import annotations

import gc
import sys

import torch

from ninfer.bench_synthetic import Clock, bench_ninfer_decode
from ninfer.plugins.qwen3_5.synthetic import random_runtime

STEPS = 64


def main(*names: str) -> int:
    device = torch.device("cuda")
    clock = Clock(device)
    for name in names:
        runtime = random_runtime(name, device=device)
        prompt = torch.randint(0, runtime.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
        print(f"{name}: {len(gc.get_objects())} tracked objects", flush=True)
        for label, setup in (("gc as is", gc.enable), ("gc.freeze()", gc.freeze), ("gc disabled", gc.disable)):
            setup()
            for _ in range(3):
                elapsed, _, replay_ms = bench_ninfer_decode(runtime, prompt, STEPS, clock)
                print(f"  {label:12} step {elapsed / STEPS:.3f} ms, graphs back to back {replay_ms:.3f} ms", flush=True)
        gc.enable()
        gc.unfreeze()
        del runtime
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
