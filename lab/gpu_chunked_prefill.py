"""Chunked against one-chunk prefill of one prompt on random weights (CUDA only): where the chunks' time goes.

Usage (repo root): ``python lab/gpu_chunked_prefill.py OUT_DIR PRESET [prompt_len] [chunk]``.
1. The attention of one layer at the preset's head layout: a ``chunk``-token continuation chunk after
   ``prompt_len - chunk`` cached tokens and the whole prompt in one chunk, through SDPA (gathered prefix) and the
   Triton paged kernel at a few tile configurations.
2. The prompt in one chunk and in chunks of ``chunk`` (default 1024) into fresh caches (each warmed once, then the
   best of two) with each attention backend; each chunk's time.
3. One chunked prefill (default backend) under torch.profiler: the device kernels by total CUDA time.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import ninfer.plugins.qwen3_5.model.layers as layers
from ninfer.bench.synthetic import Rows
from ninfer.kernels.reference.prefill import sdpa_paged_attention
from ninfer.kernels.triton.prefill_attention import paged_prefill_attention
from ninfer.plugins.qwen3_5.model.synthetic import random_runtime

PAGE = 16
CONFIGS = [(64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3), (128, 32, 8, 2)]


def cuda_ms(work, repeats: int = 5) -> float:  # type: ignore[no-untyped-def]
    work()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        work()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / repeats


def attention_table(config, length: int, chunk: int) -> None:  # type: ignore[no-untyped-def]
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    pages = -(-length // PAGE)
    keys = torch.randn(pages, PAGE, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32)[None]
    for label, q_len, context in (("continuation", chunk, length - chunk), ("one chunk", length, 0)):
        query = torch.randn(q_len, heads, dim, device="cuda", dtype=torch.bfloat16)
        args = (query, keys, values, table, [q_len], [context])
        reference = sdpa_paged_attention(*args, scale=dim**-0.5)
        sdpa_ms = cuda_ms(lambda: sdpa_paged_attention(*args, scale=dim**-0.5))
        line = [f"attention {label} q={q_len} ctx={context}: sdpa {sdpa_ms:.3f} ms"]
        for block_m, block_n, warps, stages in CONFIGS:
            def run():  # type: ignore[no-untyped-def]
                return paged_prefill_attention(*args, scale=dim**-0.5, block_m=block_m, block_n=block_n,
                                               num_warps=warps, num_stages=stages)
            try:
                error = float((run().float() - reference.float()).norm() / reference.float().norm())
                line.append(f"triton {block_m}x{block_n} w{warps} s{stages} {cuda_ms(run):.3f} ms (err {error:.1e})")
            except Exception as exc:  # a tile configuration that does not fit (shared memory) is reported, not fatal
                line.append(f"triton {block_m}x{block_n} w{warps} s{stages} failed: {type(exc).__name__}")
        print("; ".join(line))


def prefill(runtime, prompt: torch.Tensor, chunk: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Milliseconds of each chunk of one prefill into fresh caches."""
    rows = Rows(runtime, 1, len(prompt) + 16)
    times = []
    for start in range(0, len(prompt), chunk):
        torch.cuda.synchronize()
        began = time.perf_counter()
        rows.forward([prompt[start : start + chunk]])
        torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
    return times


@contextlib.contextmanager
def attention_backend(name: str):  # type: ignore[no-untyped-def]
    original = layers.prefill_attention
    if name == "sdpa":
        layers.prefill_attention = sdpa_paged_attention
    try:
        yield
    finally:
        layers.prefill_attention = original


def main(out_dir: str, preset: str, prompt_len: str = "8192", chunk: str = "1024") -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runtime = random_runtime(preset, device=torch.device("cuda"))
    length, size = int(prompt_len), int(chunk)
    with torch.no_grad():
        attention_table(runtime.config, length, size)
        prompt = torch.randint(0, runtime.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
        results = {}
        for backend in ("triton", "sdpa"):
            with attention_backend(backend):
                for label, step in (("one chunk", length), (f"chunks of {size}", size)):
                    prefill(runtime, prompt, step)
                    runs = [prefill(runtime, prompt, step) for _ in range(2)]
                    results[backend, label] = min(runs, key=sum)
        for (backend, label), times in results.items():
            print(f"{preset} {length} tokens, {backend}, {label}: {sum(times):.1f} ms; per chunk "
                  + " ".join(f"{t:.1f}" for t in times))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            prefill(runtime, prompt, size)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
