"""Host and device timeline of one benchmark prefill (CUDA only): where TTFT goes beyond the kernels.

Usage (repo root): ``python lab/gpu_prefill_trace.py OUT_DIR qwen3.6-27b [prompt_len]``. Builds the preset with
random bf16 weights, warms up as ``bench_ninfer_prefill`` does, then profiles one prefill of ``prompt_len`` tokens
(default 8192) into fresh caches with torch.profiler (CPU and CUDA) and prints the host ops by self CPU time, the
wall time against the device's busy time, the host time before the first kernel and after the last, and the
longest idle gaps on the device with the host op running when each began. Writes ``prefill_trace_<preset>.json.gz``.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ninfer.bench.synthetic import Rows
from ninfer.plugins.qwen3_5.model.synthetic import random_runtime

MARK = "prefill"
GAPS = 20


def export_trace(prof: profile, path: Path) -> dict:
    """The profiler's Chrome trace, written gzipped beside ``path`` (``<path>.gz``) and returned."""
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    with gzip.open(path.with_name(path.name + ".gz"), "wt") as handle:
        json.dump(trace, handle)
    path.unlink()
    return trace


def device_intervals(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel, memcpy and memset on the device, in start order."""
    return sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )


def host_ops(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every host op, runtime and driver call and annotation, in start order."""
    return sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
    )


def timeline(trace: dict) -> list[str]:
    events = trace["traceEvents"]
    mark = next(e for e in events if e.get("name") == MARK and e.get("cat") == "user_annotation")
    start, stop = mark["ts"], mark["ts"] + mark["dur"]
    device = [span for span in device_intervals(events) if start <= span[0] <= stop + 5000]
    host = host_ops(events)
    busy, cursor, gaps = 0.0, device[0][0], []
    for a, b, name in device:
        if a > cursor:
            running = [n for ha, hb, n in host if ha <= cursor <= hb and n != MARK]
            gaps.append((a - cursor, cursor - start, name[:50], running[-1][:60] if running else "-"))
        busy += max(0.0, b - max(a, cursor))
        cursor = max(cursor, b)
    idle = sum(gap[0] for gap in gaps)
    lines = [
        f"wall {stop - start:.0f} us, device busy {busy:.0f} us over {len(device)} ops, idle {idle:.0f} us in"
        f" {len(gaps)} gaps; host before the first op {device[0][0] - start:.0f} us, after the last"
        f" {stop - cursor:.0f} us",
    ]
    for length, offset, name, running in sorted(gaps, reverse=True)[:GAPS]:
        lines.append(f"  gap {length:8.1f} us at +{offset:9.1f} us before {name!r}; host in {running!r}")
    return lines


def main(out_dir: str, preset: str, prompt_len: str = "8192") -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runtime = random_runtime(preset, device=torch.device("cuda"))
    length = int(prompt_len)
    prompt = torch.randint(0, runtime.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        Rows(runtime, 1, 512).forward([prompt[:512]])
        Rows(runtime, 1, length).forward([prompt])
        rows = Rows(runtime, 1, length)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with torch.profiler.record_function(MARK):
                rows.forward([prompt])
    trace = export_trace(prof, out / f"prefill_trace_{preset}.json")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    for line in timeline(trace):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
