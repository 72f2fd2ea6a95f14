"""Host and device timeline of batch-1 benchmark decode steps (CUDA only): where the time outside the graphs goes.

Usage (CUDA machine): ``python scripts/gpu_step_trace.py OUT_DIR [--overlap] qwen3.6-35b-a3b [...]``. For each
preset (random bf16 weights) it runs the benchmark's decode loop (``Rows.forward``: ``runtime.forward`` on the
captured graphs, greedy argmax, token to the host; with ``--overlap`` the overlapped loop of
``bench_ninfer_decode(overlap=True)``: each step launched on the previous step's ids while they are still on the
device, the host waiting only for their copy), then profiles ``STEPS`` steps with torch.profiler (CPU and CUDA) and
prints:

* the host ops by self CPU time per step;
* per step: wall time, the device busy time (union of kernel intervals) and the idle gaps on the device longer than
  5 µs with the host op running when each began;
* each kernel's share of one step (``critical_path``) and the work between graph replays (``between_graphs``).

``trace_<preset>.json.gz`` is the Chrome trace of those steps.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ninfer.bench_synthetic import Rows
from ninfer.core.engine.transfer import HostCopy
from ninfer.plugins.qwen3_5.synthetic import random_runtime

STEPS = 6
CONTEXT = 256


def export_trace(prof: profile, path: Path) -> dict:
    """The profiler's Chrome trace, written gzipped beside ``path`` (``<path>.gz``) and returned."""
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    with gzip.open(path.with_name(path.name + ".gz"), "wt") as handle:
        json.dump(trace, handle)
    path.unlink()
    return trace


def device_intervals(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel and memcpy on the device, in start order."""
    spans = [
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(spans)


def host_ops(events: list[dict]) -> list[tuple[float, float, str]]:
    return sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
    )


def analyse(trace: dict, steps: int) -> list[str]:
    events = trace["traceEvents"]
    marks = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("bench_step"))
    device = device_intervals(events)
    host = host_ops(events)
    lines = []
    for index, (start, stop) in enumerate(marks):
        inside = [(a, b, n) for a, b, n in device if a >= start and a < stop + 5000]
        busy, cursor, gaps = 0.0, start, []
        for a, b, name in inside:
            if a - cursor > 5:
                running = [n for ha, hb, n in host if ha <= cursor <= hb]
                gaps.append((cursor - start, a - cursor, name[:40], running[-1][:50] if running else "-"))
            busy += max(0.0, b - max(a, cursor))
            cursor = max(cursor, b)
        lines.append(
            f"step {index}: wall {stop - start:8.1f} us, device busy {busy:8.1f} us, "
            f"{len(inside)} device ops, first at +{(inside[0][0] - start) if inside else 0:.1f} us"
        )
        for offset, length, next_op, running in gaps:
            lines.append(f"    gap at +{offset:8.1f} us: {length:7.1f} us before {next_op!r}; host in {running!r}")
    return lines


def critical_path(trace: dict, step: str = "bench_step_3", top: int = 20) -> list[str]:
    """Device time of one step per kernel name, each kernel charged only for the time after every earlier kernel
    ended (kernels overlap under PDL), largest first; and the device's idle time inside the step."""
    events = trace["traceEvents"]
    marks = [e for e in events if e.get("name") == step and e.get("cat") == "user_annotation"]
    if not marks:
        return []
    start, stop = marks[0]["ts"], marks[0]["ts"] + marks[0]["dur"]
    device = [(a, b, n) for a, b, n in device_intervals(events) if start <= a <= stop]
    if not device:
        return []
    charged: dict[str, float] = {}
    counts: dict[str, int] = {}
    cursor, idle = device[0][0], 0.0
    for a, b, name in device:
        idle += max(0.0, a - cursor)
        charged[name[:60]] = charged.get(name[:60], 0.0) + max(0.0, b - max(a, cursor))
        counts[name[:60]] = counts.get(name[:60], 0) + 1
        cursor = max(cursor, b)
    lines = [f"{step}: device span {cursor - device[0][0]:.1f} us, idle {idle:.1f} us; critical path per kernel:"]
    for name, us in sorted(charged.items(), key=lambda item: -item[1])[:top]:
        lines.append(f"  {us:8.1f} us x{counts[name]:<4} {name}")
    return lines


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


def overlapped_step(rows: Rows, ids: torch.Tensor) -> torch.Tensor:
    """One overlapped benchmark step: the next step launched on ``ids`` (still on the device), then the host waits
    only for their copy; returns the next step's ids."""
    copy = HostCopy(ids)
    following = rows.forward_ahead(ids)
    copy.wait()
    return following


def run(name: str, out: Path, overlap: bool = False) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    runtime = random_runtime(name, device=device)
    trace_runtime(runtime, name, out, overlap)


def trace_runtime(runtime, name: str, out: Path, overlap: bool = False) -> None:
    """Profile ``STEPS`` benchmark steps of ``runtime`` (``overlap``: overlapped ones); print the tables, write
    ``trace_<name>.json.gz``."""
    device = runtime.model.device
    vocab = runtime.config.vocab_size
    rows = Rows(runtime, 1, CONTEXT + STEPS + 16)
    with torch.no_grad():
        tokens = rows.forward([torch.randint(0, vocab, (CONTEXT,))])
        for _ in range(4):
            tokens = rows.forward(list(tokens[:, None]))
        if device.type == "cuda":
            torch.cuda.synchronize()
        ids = tokens.to(device)
        for _ in range(4 if overlap else 0):  # the first overlapped steps allocate pinned buffers
            ids = overlapped_step(rows, ids)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for step in range(STEPS):
                with torch.profiler.record_function(f"bench_step_{step}"):
                    if overlap:
                        ids = overlapped_step(rows, ids)
                    else:
                        tokens = rows.forward(list(tokens[:, None]))
    trace = export_trace(prof, out / f"trace_{name}.json")
    print(f"== {name}: host ops by self CPU time ({STEPS} steps)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    for line in analyse(trace, STEPS):
        print(line)
    for line in critical_path(trace):
        print(line)
    for line in between_graphs(trace):
        print(line)


def main(out_dir: str, *args: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    overlap = "--overlap" in args
    for name in (arg for arg in args if arg != "--overlap"):
        run(name, out, overlap)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
