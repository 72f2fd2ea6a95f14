"""Where a batch-1 decode step's time goes beyond the bare graph replay, and the prefill TTFT (CUDA only).

Usage (on a CUDA machine):
``python lab/gpu_host_overhead.py OUT_DIR [--ttft-only | --decode-only] [--segments=1,4] qwen3.6-27b [...]``

For each preset (random bf16 weights, no transformers model) and each ``graph_segments`` value it measures, per
decode step at 256 tokens of context:

* ``bench``: the benchmark's step (``ninfer.bench.synthetic``: host-built ForwardBatch, ``runtime.forward``, greedy
  argmax on the GPU, token to the host);
* ``engine``: the same step with the batch's tensors created on the device from Python lists (one transfer per
  tensor; the engine itself builds host tensors, ``ninfer.engine.batching.build_batch``);
* ``replay``: the captured graphs replayed back to back (no host work);
* ``replay+sync``: each replay followed by a device sync (launch latency exposed, no other host work);
* ``launch``: host time of the replay call alone; ``prep``: host time of ``runtime.forward`` (checks, staging,
  launch, logits clone) after a sync.

Then c=8 aggregate throughput and (unless ``--decode-only``) the TTFT of one 8192-token prompt with the prefill's
top kernels.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from ninfer.bench.synthetic import (
    Clock,
    Rows,
    bench_ninfer_decode,
    bench_ninfer_prefill,
    copy_bandwidth,
    profile_prefill,
    step_bytes,
)
from ninfer.core.runtime import ForwardBatch
from ninfer.plugins.qwen3_5.model.synthetic import random_runtime

STEPS = 32
CONTEXT = 256


def engine_like_batch(rows: Rows, token: int, device: torch.device) -> ForwardBatch:
    """One decode row whose tensors are created on the device from Python lists."""
    context = rows.lengths[0]
    table = torch.zeros((1, rows.page_tables.shape[1]), dtype=torch.int32)
    table[0] = torch.tensor(rows.page_tables[0].tolist(), dtype=torch.int32)
    return ForwardBatch(
        token_ids=torch.tensor([token], dtype=torch.int64, device=device),
        positions=torch.tensor([context], dtype=torch.int64, device=device).unsqueeze(0).expand(3, -1).contiguous(),
        query_lens=[1],
        context_lens=[context],
        page_tables=table.to(device),
        state_slots=torch.tensor([0], dtype=torch.int64, device=device),
    )


def host_breakdown(runtime, prompt: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Milliseconds per step of the engine-like loop and of the parts of one step (after warm-up and capture)."""
    rows = Rows(runtime, 1, prompt.shape[0] + 4 * STEPS + 8)
    result: dict[str, float] = {}
    with torch.no_grad():
        token = int(rows.forward([prompt])[0])
        for _ in range(3):
            token = int(rows.forward([torch.tensor([token])])[0])
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(STEPS):
            batch = engine_like_batch(rows, token, device)
            logits = runtime.forward(batch, rows.kv, rows.state).logits
            token = logits.argmax(dim=-1).tolist()[0]
            rows.lengths[0] += 1
        torch.cuda.synchronize()
        result["engine_step_ms"] = (time.perf_counter() - start) * 1e3 / STEPS
        step = runtime.decoder.captured(1)[-1]
        launches, syncs, preps = [], [], []
        for _ in range(STEPS):
            torch.cuda.synchronize()
            began = time.perf_counter()
            step.replay()
            launched = time.perf_counter()
            torch.cuda.synchronize()
            launches.append(launched - began)
            syncs.append(time.perf_counter() - began)
        for _ in range(8):
            batch = ForwardBatch(
                token_ids=torch.tensor([token]), positions=torch.full((3, 1), rows.lengths[0]), query_lens=[1],
                context_lens=[rows.lengths[0]], page_tables=rows.page_tables, state_slots=rows.slots,
            )
            torch.cuda.synchronize()
            began = time.perf_counter()
            runtime.forward(batch, rows.kv, rows.state)
            preps.append(time.perf_counter() - began)
            torch.cuda.synchronize()
            rows.lengths[0] += 1
    result["launch_ms"] = statistics.median(launches) * 1e3
    result["replay_sync_ms"] = statistics.median(syncs) * 1e3
    result["forward_call_ms"] = statistics.median(preps) * 1e3
    return result


def run_preset(
    name: str, segments_options: list[int], out: Path, *, decode: bool = True, prefill: bool = True
) -> dict:
    device = torch.device("cuda")
    clock = Clock(device)
    bandwidth = copy_bandwidth(device, clock)
    runtime = random_runtime(name, device=device)
    config = runtime.config
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, config.vocab_size, (8, CONTEXT), generator=generator)
    roofline_1 = 1 / (step_bytes(runtime, 1, CONTEXT + 4) / bandwidth)
    roofline_8 = 8 / (step_bytes(runtime, 8, CONTEXT + 4) / bandwidth)
    result: dict = {"model": name, "copy_bandwidth_gb_s": bandwidth / 1e9, "roofline_tok_s_1": roofline_1,
                    "roofline_tok_s_8": roofline_8, "decode_1": {}}
    decoder = runtime.decoder
    default_segments = decoder.graph_segments
    for segments in segments_options if decode else []:
        decoder.graph_segments = segments
        decoder.reset()  # recapture with the new segmentation, in a fresh memory pool
        try:
            elapsed, _, replay_ms = bench_ninfer_decode(runtime, prompts[:1], STEPS, clock)
            entry = {"bench_step_ms": elapsed / STEPS, "replay_ms": replay_ms}
            entry.update(host_breakdown(runtime, prompts[0], device))
        except Exception:  # report and go on to the next variant: one lease, every number counts
            traceback.print_exc()
            continue
        entry["bench_of_roofline"] = 1e3 / entry["bench_step_ms"] / roofline_1
        entry["engine_of_roofline"] = 1e3 / entry["engine_step_ms"] / roofline_1
        entry["replay_of_roofline"] = 1e3 / replay_ms / roofline_1
        result["decode_1"][str(segments)] = entry
        print(name, "segments", segments, json.dumps({k: round(v, 4) for k, v in entry.items()}), flush=True)
    if decode:
        decoder.graph_segments = default_segments
        decoder.reset()
        elapsed, _, replay_8 = bench_ninfer_decode(runtime, prompts, STEPS, clock)
        result["decode_8"] = {"tok_s": 8 * STEPS / (elapsed / 1e3), "replay_ms": replay_8}
        result["decode_8"]["of_roofline"] = result["decode_8"]["tok_s"] / roofline_8
        print(name, "decode_8", json.dumps(result["decode_8"]), flush=True)
    (out / f"host_{name}.json").write_text(json.dumps(result, indent=2))
    if prefill:
        long_prompt = torch.randint(0, config.vocab_size, (8192,), generator=generator)
        result["ttft_8192_ms"] = bench_ninfer_prefill(runtime, long_prompt, clock, 2)
        print(name, "TTFT 8192 ms", round(result["ttft_8192_ms"], 1), flush=True)
        result["prefill_profile"] = profile_prefill(runtime, long_prompt, top=15)
        for row in result["prefill_profile"]:
            print(f"  {row['total_us']:10.1f} us  x{row['calls']:<6} {row['kernel'][:90]}", flush=True)
    print_table(result)
    (out / f"host_{name}.json").write_text(json.dumps(result, indent=2))
    del runtime
    gc.collect()
    torch.cuda.empty_cache()
    return result


def print_table(result: dict) -> None:
    """One line per measured batch-1 decode variant."""
    print(f"{result['model']}: roofline {result['roofline_tok_s_1']:.1f} tok/s at batch 1 "
          f"({result['copy_bandwidth_gb_s']:.0f} GB/s copy)")
    print("| segments | bench step ms | tok/s | of roofline | engine-built ms | graphs back to back ms | of roofline |")
    for label, entry in result["decode_1"].items():
        print(f"| {label} | {entry['bench_step_ms']:.3f} | {1e3 / entry['bench_step_ms']:.1f} | "
              f"{entry['bench_of_roofline']:.1%} | {entry['engine_step_ms']:.3f} | {entry['replay_ms']:.3f} | "
              f"{entry['replay_of_roofline']:.1%} |")
    if "decode_8" in result:
        entry = result["decode_8"]
        print(f"decode_8: {entry['tok_s']:.1f} tok/s ({entry['of_roofline']:.1%} of roofline), "
              f"graphs back to back {entry['replay_ms']:.3f} ms")


def main(out_dir: str, *names: str) -> int:
    """``names`` are presets and flags: ``--ttft-only``, ``--decode-only``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flags = {n for n in names if n.startswith("--")}
    segments = [int(n) for flag in flags if flag.startswith("--segments=") for n in flag.split("=", 1)[1].split(",")]
    for name in (n for n in names if not n.startswith("--")):
        run_preset(name, segments or [1, 4], out, decode="--ttft-only" not in flags,
                   prefill="--decode-only" not in flags)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
