"""Decode speed through the Engine (its executor loop, sampler and commits), with and without overlapped decode.

Usage (CUDA machine, repo root): ``python scripts/gpu_engine_decode.py OUT_DIR qwen3.6-35b-a3b [qwen3.6-27b]``.

For each preset (random bf16 weights on the GPU): one Engine per mode (``overlap_decode`` off, on, off again), a
warm-up request (it captures the decode graphs), then one greedy request of a 256-token prompt and 64 new tokens
(``ignore_eos``; ms per token between its first and last token) and 8 such requests at once (aggregate tok/s). The
single request's tokens of every mode must be the same. Prints a table last; writes ``engine_decode.json`` to OUT_DIR.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

from ninfer.core.engine import Engine, EngineConfig, GenerationRequest, SamplingParams
from ninfer.plugins.qwen3_5.synthetic import random_runtime

PROMPT, NEW, ROWS = 256, 64, 8


def request(seed: int, vocab: int) -> GenerationRequest:
    prompt = torch.randint(0, vocab, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()
    return GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))


def engine_config(overlap: bool) -> EngineConfig:
    """Room for ``ROWS`` requests of ``PROMPT + NEW`` tokens, no prefix reuse, no queue timeout."""
    return EngineConfig(max_concurrency=ROWS, max_context=PROMPT + NEW + 16, kv_capacity=ROWS * (PROMPT + NEW + 16),
                        prefix_reuse=False, pending_timeout_ms=None, overlap_decode=overlap)


def measure(runtime, overlap: bool) -> dict:
    vocab = runtime.spec.vocab_size
    with Engine(runtime, engine_config(overlap)) as engine:
        engine.submit(request(0, vocab)).result(600)
        engine.submit(request(1, vocab)).result(600)  # a second warm-up: the graphs are captured by now
        one = engine.submit(request(2, vocab)).result(600)
        timings = one.timings
        per_token_ms = (timings.last_token_at - timings.first_token_at) * 1e3 / (NEW - 1)
        handles = [engine.submit(request(10 + row, vocab)) for row in range(ROWS)]
        outcomes = [handle.result(600) for handle in handles]
        first = min(o.timings.first_token_at for o in outcomes)
        last = max(o.timings.last_token_at for o in outcomes)
        aggregate = ROWS * (NEW - 1) / (last - first)
    return {"overlap": overlap, "ms_per_token": per_token_ms, "tok_s": 1e3 / per_token_ms, "aggregate_tok_s": aggregate,
            "tokens": [one.output_token_ids, *[o.output_token_ids for o in outcomes]]}


def main(out_dir: str, *names: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in names:
        runtime = random_runtime(name, device=torch.device("cuda"))
        runs = [measure(runtime, overlap) for overlap in (False, True, False)]
        # the single request must match; the 8 at once may differ where the engine admitted them in other rounds
        # (another batch composition: the 35B-A3B MoE kernels' sums differ between one row and several)
        same = all(run["tokens"][0] == runs[0]["tokens"][0] for run in runs)
        same_batch = all(run["tokens"][1:] == runs[0]["tokens"][1:] for run in runs)
        results[name] = {"runs": [{k: v for k, v in run.items() if k != "tokens"} for run in runs], "same_tokens": same,
                         "same_batch_tokens": same_batch}
        print(name, json.dumps(results[name]), flush=True)
        del runtime
        gc.collect()
        torch.cuda.empty_cache()
    (out / "engine_decode.json").write_text(json.dumps(results, indent=2))
    print("| model | overlap | batch-1 ms/token (tok/s) | 8 rows tok/s | same tokens (1 row, 8 rows) |")
    for name, result in results.items():
        for run in result["runs"]:
            print(f"| {name} | {run['overlap']} | {run['ms_per_token']:.3f} ({run['tok_s']:.1f}) | "
                  f"{run['aggregate_tok_s']:.1f} | {result['same_tokens']}, {result['same_batch_tokens']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
