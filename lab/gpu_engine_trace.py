"""Host and device timeline of decode through the Engine (CUDA only): what a token costs beyond its graph.

Usage (CUDA machine, repo root): ``python scripts/gpu_engine_trace.py OUT_DIR qwen3.6-35b-a3b [...]``.

For each preset (random bf16 weights): an Engine with overlapped decode (the CUDA default), two warm-up requests
(the first captures the decode graph), then one greedy request of ``gpu_engine_decode``'s shape profiled with
torch.profiler (CPU and CUDA). Prints the request's ms per token, the engine's host time and device wait per decode
round (its own clock: the profiler records host ops of the calling thread only, not the engine's), the graph
replays' median span and the work the device runs between replays (``gpu_step_trace.between_graphs``: the sampler,
the copies, the state-update mask and the staging of the next step); writes ``engine_trace_<preset>.json.gz``.
Round 9 measured the Engine's overlapped 35B-A3B token at 2.474 ms against 2.351 ms for the benchmark's loop; the
benchmark's loop spends ~43 µs between replays (round 11).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from gpu_engine_decode import NEW, engine_config, request
from gpu_step_trace import between_graphs, export_trace
from torch.profiler import ProfilerActivity, profile

from ninfer.engine import Engine

PHASES = ("engine_boundary", "program_submit", "program_post", "engine_commit_output", "engine_maintenance")
from ninfer.plugins.qwen3_5.model.synthetic import random_runtime


def trace_engine(name: str, out: Path) -> None:
    runtime = random_runtime(name, device=torch.device("cuda"))
    vocab = runtime.spec.vocab_size
    with Engine(runtime, engine_config(overlap=True)) as engine:
        for seed in (0, 1):
            engine.submit(request(seed, vocab)).result(600)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            outcome = engine.submit(request(2, vocab)).result(600)
    timings = outcome.timings
    per_token_ms = (timings.last_token_at - timings.first_token_at) * 1e3 / (NEW - 1)
    trace = export_trace(prof, out / f"engine_trace_{name}.json")
    print(f"== {name}: {per_token_ms:.3f} ms per token through the Engine (overlapped decode)")
    exposure = timings.host_work
    if exposure is not None:  # the engine thread's own clock (the profiler records host ops of this thread only)
        rounds = max(timings.decode_rounds, 1)
        phases = ", ".join(f"{phase} {seconds * 1e6 / rounds:.0f}" for phase, seconds in zip(PHASES, exposure.phases))
        print(f"host µs per decode round: decode host {exposure.decode_host * 1e6 / rounds:.0f}, device wait "
              f"{exposure.decode_device_wait * 1e6 / rounds:.0f} ({phases}; {rounds} rounds)")
    for line in between_graphs(trace):
        print(line)


def main(out_dir: str, *names: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        trace_engine(name, out)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
