"""Host and device timeline of decode through the Engine (CUDA only): what a token costs beyond its graph.

Usage (CUDA machine, repo root): ``python lab/gpu_engine_trace.py OUT_DIR qwen3.6-35b-a3b [...]``.

For each preset (random bf16 weights): an Engine with overlapped decode (the CUDA default), two warm-up requests
(the first captures the decode graph), then one greedy request (``PROMPT`` tokens of prompt, ``NEW`` new tokens,
end-of-sequence ignored) profiled with torch.profiler (CPU and CUDA). Prints the request's ms per token, the
engine's host time and device wait per decode round (its own clock: the profiler records host ops of the calling
thread only, not the engine's), the graph replays' median span and the work the device runs between replays
(``between_graphs``: the sampler, the copies, the state-update mask and the staging of the next step); writes
``engine_trace_<preset>.json.gz``. The ms per token less the overlapped step of ``lab/gpu_quick.py`` (the
benchmark's loop) is what the Engine adds per token.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ninfer.core.request import GenerationRequest, SamplingParams
from ninfer.engine import Engine, EngineConfig
from ninfer.plugins.qwen3_5.model.synthetic import random_runtime

PROMPT, NEW, ROWS = 256, 64, 8
PHASES = ("engine_boundary", "program_submit", "program_post", "engine_commit_output", "engine_maintenance")


def request(seed: int, vocab: int) -> GenerationRequest:
    """A greedy request of ``PROMPT`` random token ids (seeded) for exactly ``NEW`` tokens."""
    prompt = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()
    return GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))


def engine_config(overlap: bool) -> EngineConfig:
    """Room for ``ROWS`` requests of ``PROMPT + NEW`` tokens, no prefix reuse, no queue timeout."""
    return EngineConfig(max_concurrency=ROWS, max_context=PROMPT + NEW + 16, kv_capacity=ROWS * (PROMPT + NEW + 16),
                        prefix_reuse=False, pending_timeout_ms=None, overlap_decode=overlap)


def export_trace(prof: profile, path: Path) -> dict:
    """The profiler's Chrome trace, written gzipped beside ``path`` (``<path>.gz``) and returned."""
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    with gzip.open(path.with_name(path.name + ".gz"), "wt") as handle:
        json.dump(trace, handle)
    path.unlink()
    return trace


def between_graphs(trace: dict) -> list[str]:
    """What the device runs between consecutive CUDA graph replays (a decode step's work outside its graph) on the
    graphs' stream: the time from one replay's last kernel to the next replay's first, over all boundaries, and for
    the median boundary the operations launched outside any graph in it and the idle time."""
    events = trace["traceEvents"]
    launches = {
        e["args"]["correlation"]
        for e in events
        if e.get("ph") == "X" and e.get("name") == "cudaGraphLaunch" and "correlation" in e.get("args", {})
    }
    operations = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    graph_streams = {e["args"].get("stream") for e in operations if e["args"].get("correlation") in launches}
    device = sorted(  # the graphs' stream only: copies on the side streams overlap it
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"], e["args"].get("correlation"))
        for e in operations
        if e["args"].get("stream") in graph_streams
    )
    replays: dict[int, tuple[float, float]] = {}
    boundaries, pending, graph_end = [], [], None
    for start, end, name, correlation in device:
        if correlation not in launches:
            pending.append((name, end - start))
            continue
        first, last = replays.get(correlation, (start, end))
        replays[correlation] = (min(first, start), max(last, end))
        if graph_end is not None and pending:
            boundaries.append((start - graph_end, sum(duration for _, duration in pending), pending))
        pending = []
        graph_end = end if graph_end is None else max(graph_end, end)
    if not boundaries:
        return ["no two graph replays with work between them"]
    boundaries.sort(key=lambda boundary: boundary[0])
    span, busy, ops = boundaries[len(boundaries) // 2]
    replay_spans = sorted(last - first for first, last in replays.values())
    lines = [
        f"graph replays: {len(replay_spans)}, median span {replay_spans[len(replay_spans) // 2]:.1f} us",
        f"between graph replays: {len(boundaries)} boundaries, median {span:.1f} us (min {boundaries[0][0]:.1f}, "
        f"max {boundaries[-1][0]:.1f}); the median one: {busy:.1f} us of {len(ops)} operations, "
        f"{span - busy:.1f} us idle:"
    ]
    lines += [f"  {duration:7.2f} us  {name[:70]}" for name, duration in ops]
    return lines


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
