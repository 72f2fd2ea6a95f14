"""The headline numbers of the given presets in one short pass on a CUDA machine (decode, TTFT, prefill kernels).

Batch-1 and 8-row decode, the batch-1 step overlapped as the engine's ``overlap_decode`` runs it, TTFT at 8192 (the
runtime's default CUDA traversal, the Triton one) and the prefill's top kernels.

Usage (CUDA machine): ``python lab/gpu_quick.py OUT qwen3.6-27b qwen3.6-35b-a3b``. Random bf16 weights, no
transformers model; same protocol as ``lab/gpu_host_overhead.py`` (256 tokens of context, 32 timed steps).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from ninfer.bench.synthetic import (
    Clock,
    bench_ninfer_decode,
    bench_ninfer_prefill,
    copy_bandwidth,
    profile_prefill,
    step_bytes,
)
from ninfer.plugins.qwen3_5.model.synthetic import random_runtime

STEPS, CONTEXT = 32, 256


def run(name: str, out: Path) -> dict:
    device = torch.device("cuda")
    clock = Clock(device)
    bandwidth = copy_bandwidth(device, clock)
    runtime = random_runtime(name, device=device)
    config = runtime.config
    prompts = torch.randint(0, config.vocab_size, (8, CONTEXT), generator=torch.Generator().manual_seed(0))
    result: dict = {"model": name, "copy_bandwidth_gb_s": bandwidth / 1e9}
    for rows in (1, 8):
        roofline = rows / (step_bytes(runtime, rows, CONTEXT + 4) / bandwidth)
        elapsed, _, replay = bench_ninfer_decode(runtime, prompts[:rows], STEPS, clock)
        tok_s = rows * STEPS / (elapsed / 1e3)
        result[f"decode_{rows}"] = {"tok_s": tok_s, "roofline_tok_s": roofline, "of_roofline": tok_s / roofline,
                                    "step_ms": elapsed / STEPS, "replay_ms": replay,
                                    "replay_of_roofline": rows / (replay / 1e3) / roofline if replay else None}
        print(name, f"decode rows={rows}", json.dumps(result[f"decode_{rows}"]), flush=True)
    elapsed, _, _ = bench_ninfer_decode(runtime, prompts[:1], STEPS, clock, overlap=True)
    roofline = 1 / (step_bytes(runtime, 1, CONTEXT + 4) / bandwidth)
    tok_s = STEPS / (elapsed / 1e3)
    result["decode_1_overlapped"] = {"tok_s": tok_s, "of_roofline": tok_s / roofline, "step_ms": elapsed / STEPS}
    print(name, "decode rows=1 overlapped", json.dumps(result["decode_1_overlapped"]), flush=True)
    long_prompt = torch.randint(0, config.vocab_size, (8192,), generator=torch.Generator().manual_seed(1))
    result["ttft_8192_ms"] = bench_ninfer_prefill(runtime, long_prompt, clock, 2)
    print(name, "TTFT 8192 ms", round(result["ttft_8192_ms"], 1), flush=True)
    result["prefill_profile"] = profile_prefill(runtime, long_prompt, top=14)
    for row in result["prefill_profile"]:
        print(f"  {row['total_us'] / 1e3:8.1f} ms  x{row['calls']:<6} {row['kernel'][:90]}", flush=True)
    (out / f"quick_{name}.json").write_text(json.dumps(result, indent=2))
    del runtime
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(out_dir: str, *names: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = [run(name, out) for name in names]
    print("| model | b1 tok/s (of roofline) | b1 overlapped | graphs b2b of roofline | 8 rows tok/s (of roofline) | "
          "TTFT 8192 ms |")
    for r in results:
        d1, d8, ahead = r["decode_1"], r["decode_8"], r["decode_1_overlapped"]
        print(f"| {r['model']} | {d1['tok_s']:.1f} ({d1['of_roofline']:.1%}) | {ahead['tok_s']:.1f} "
              f"({ahead['of_roofline']:.1%}) | {d1['replay_of_roofline'] or 0:.1%} | "
              f"{d8['tok_s']:.1f} ({d8['of_roofline']:.1%}) | {r['ttft_8192_ms']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
