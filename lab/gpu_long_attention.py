"""One layer's prefill attention at long contexts, per backend (CUDA only): where a chunked prompt's attention goes.

Usage (repo root): ``python lab/gpu_long_attention.py PRESET [chunk] [contexts...]``.
For each context C: a ``chunk``-token continuation chunk after C cached tokens through the Triton paged kernel and
``split_paged_attention`` on cuDNN and on flash, and the whole ``C + chunk`` prompt at root in one call (SDPA as
one-chunk prefill runs it, and cuDNN). Each candidate is checked against split flash (relative error) and timed
(median of CUDA-event repeats); the table gives ms and TFLOP/s.
"""

from __future__ import annotations

import sys
import time

import torch

from ninfer.kernels.reference.prefill import (
    cudnn_attention,
    flash_attention,
    sdpa_paged_attention,
    split_paged_attention,
)
from ninfer.kernels.triton.prefill_attention import paged_prefill_attention
from ninfer.plugins.qwen3_5.model.config import Qwen35TextConfig
from ninfer.plugins.qwen3_5.model.presets import preset_config

PAGE = 16


def cuda_ms(work, repeats: int = 5) -> float:  # type: ignore[no-untyped-def]
    work()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def main() -> None:
    preset = sys.argv[1]
    chunk = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    contexts = [int(c) for c in sys.argv[3:]] or [7168, 31744, 130048, 238976]
    config = Qwen35TextConfig.from_hf(preset_config(preset))
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    scale = dim**-0.5
    print(f"{preset}: {heads} query heads, {kv_heads} KV heads, head dim {dim}, chunk {chunk}")
    rows = []
    for context in contexts:
        total = context + chunk
        pages = -(-total // PAGE)
        keys = torch.randn(pages, PAGE, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        table = torch.randperm(pages, device="cuda", dtype=torch.int32)[None]
        query = torch.randn(chunk, heads, dim, device="cuda", dtype=torch.bfloat16)
        args = (query, keys, values, table, [chunk], [context])
        continuation_flops = 4 * chunk * (context + chunk / 2) * heads * dim
        reference = split_paged_attention(*args, scale=scale, attend=flash_attention)
        candidates = {
            "triton": lambda: paged_prefill_attention(*args, scale=scale),
            "split-flash": lambda: split_paged_attention(*args, scale=scale, attend=flash_attention),
            "split-cudnn": lambda: split_paged_attention(*args, scale=scale, attend=cudnn_attention),
        }
        if context <= 32768:
            candidates["sdpa-mask"] = lambda: sdpa_paged_attention(*args, scale=scale)

        for name, work in candidates.items():
            try:
                error = ((work().float() - reference.float()).norm() / reference.float().norm()).item()
                ms = cuda_ms(work)
                rows.append((f"continuation ctx={context}", name, ms, continuation_flops / ms / 1e9, error))
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run this shape is reported, not fatal
                rows.append((f"continuation ctx={context}", name, float("nan"), float("nan"), float("nan")))
                print(f"{name} at ctx={context}: {type(exc).__name__}: {str(exc)[:200]}")
        if total <= 140000:
            whole = torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16)
            root_args = (whole, keys, values, table, [total], [0])
            root_flops = 2 * total * total * heads * dim
            ms = cuda_ms(lambda: sdpa_paged_attention(*root_args, scale=scale), repeats=3)
            rows.append((f"one chunk len={total}", "sdpa", ms, root_flops / ms / 1e9, 0.0))
            ms = cuda_ms(lambda: split_paged_attention(*root_args, scale=scale, attend=cudnn_attention), repeats=3)
            rows.append((f"one chunk len={total}", "cudnn", ms, root_flops / ms / 1e9, 0.0))
            del whole
        del keys, values
        torch.cuda.empty_cache()
    for context in (7189, 9001, 15013, 30011):  # shapes never run before: what a first call at a new length costs
        total = context + 1000
        pages = -(-total // PAGE)
        keys = torch.randn(pages, PAGE, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        table = torch.arange(pages, device="cuda", dtype=torch.int32)[None]
        query = torch.randn(1000, heads, dim, device="cuda", dtype=torch.bfloat16)
        args = (query, keys, values, table, [1000], [context])
        for name, work in (
            ("triton", lambda: paged_prefill_attention(*args, scale=scale)),
            ("split-flash", lambda: split_paged_attention(*args, scale=scale, attend=flash_attention)),
            ("split-cudnn", lambda: split_paged_attention(*args, scale=scale, attend=cudnn_attention)),
        ):
            torch.cuda.synchronize()
            began = time.perf_counter()
            work()
            torch.cuda.synchronize()
            first = (time.perf_counter() - began) * 1e3
            rows.append((f"first call ctx={context}", name, first, float("nan"), float("nan")))
    print(f"{'shape':<28} {'backend':<12} {'ms':>9} {'TFLOP/s':>8} {'rel err':>9}")
    for shape, name, ms, tflops, error in rows:
        print(f"{shape:<28} {name:<12} {ms:>9.3f} {tflops:>8.1f} {error:>9.2e}")


if __name__ == "__main__":
    main()
