"""Device time per kernel of one captured batch-1 decode step (CUDA graph replays under torch.profiler).

Usage (CUDA machine): ``python lab/gpu_profile.py OUT_DIR qwen3.6-35b-a3b [rows ...]``. Prints, per preset and
batch size, the kernels sorted by device time per step and the sum, and writes ``profile_<preset>_<rows>.json``.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ninfer.bench.synthetic import Rows
from ninfer.plugins.qwen3_5.model.presets import preset_config
from ninfer.plugins.qwen3_5.model.synthetic import InMemorySource, build_runtime, random_text_weights

REPLAYS = 20


def profile_replays(runtime, rows_count: int, context: int = 256) -> list[dict]:
    """Kernels of the captured decode step of ``rows_count`` rows, device µs per step, largest first."""
    vocab = runtime.config.vocab_size
    rows = Rows(runtime, rows_count, context + 16)
    with torch.no_grad():
        tokens = rows.forward([torch.randint(0, vocab, (context,)) for _ in range(rows_count)])
        for _ in range(3):
            tokens = rows.forward(list(tokens[:, None]))
        steps = runtime.decoder.captured(rows_count)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                for step in steps:
                    step.replay()
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals[event.name[:110]]
            entry[0] += event.device_time
            entry[1] += 1
    table = [{"kernel": k, "us_per_step": v[0] / REPLAYS, "calls_per_step": v[1] / REPLAYS} for k, v in totals.items()]
    table.sort(key=lambda row: row["us_per_step"], reverse=True)
    return table


def main(out_dir: str, name: str, *row_counts: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    config = preset_config(name)
    tensors = random_text_weights(config, device=device, dtype=torch.bfloat16, seed=0)
    runtime = build_runtime(InMemorySource(name, config, tensors), dtype=torch.bfloat16, device=device)
    del tensors
    for count in [int(c) for c in row_counts] or [1]:
        table = profile_replays(runtime, count)
        (out / f"profile_{name}_{count}.json").write_text(json.dumps(table, indent=2))
        total = sum(row["us_per_step"] for row in table)
        print(f"{name} rows={count}: {total:.1f} us of kernels per step")
        for row in table[:28]:
            print(f"  {row['us_per_step']:9.1f} us  x{row['calls_per_step']:<6.0f} {row['kernel']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
