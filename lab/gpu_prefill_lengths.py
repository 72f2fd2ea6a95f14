"""One prompt prefilled in one chunk and in chunks, at several lengths, on random weights (CUDA only).

Usage (repo root): ``python lab/gpu_prefill_lengths.py PRESET CHUNK LENGTH...``. A warm-up prefill of 8,192 tokens
in one chunk and in CHUNK-token chunks, then for each length one timed prefill of each kind into fresh caches; the
table gives total ms, prefill tok/s and the chunked/one-chunk ratio.
"""

from __future__ import annotations

import sys
import time

import torch

from ninfer.bench.synthetic import Rows
from ninfer.plugins.qwen3_5.model.synthetic import random_runtime


def prefill_ms(runtime, prompt: torch.Tensor, chunk: int) -> float:  # type: ignore[no-untyped-def]
    rows = Rows(runtime, 1, len(prompt) + 16)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for start in range(0, len(prompt), chunk):
        rows.forward([prompt[start : start + chunk]])
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - began) * 1e3
    del rows
    torch.cuda.empty_cache()
    return elapsed


def main() -> None:
    preset, chunk, lengths = sys.argv[1], int(sys.argv[2]), [int(value) for value in sys.argv[3:]]
    runtime = random_runtime(preset, device=torch.device("cuda"))
    generator = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        warm = torch.randint(0, runtime.config.vocab_size, (8192,), generator=generator)
        prefill_ms(runtime, warm, 8192)
        prefill_ms(runtime, warm, chunk)
        for length in lengths:
            prompt = torch.randint(0, runtime.config.vocab_size, (length,), generator=generator)
            whole = prefill_ms(runtime, prompt, length)
            chunked = prefill_ms(runtime, prompt, chunk)
            rows.append((length, whole, chunked))
            print(f"{length}: one chunk {whole:.0f} ms, chunks of {chunk} {chunked:.0f} ms", flush=True)
    print(f"{'tokens':>8} {'one chunk ms':>13} {'tok/s':>8} {'chunked ms':>11} {'tok/s':>8} {'ratio':>6}")
    for length, whole, chunked in rows:
        print(f"{length:>8} {whole:>13.0f} {length / whole * 1e3:>8.0f} {chunked:>11.0f} "
              f"{length / chunked * 1e3:>8.0f} {chunked / whole:>6.3f}")


if __name__ == "__main__":
    main()
