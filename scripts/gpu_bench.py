"""Run the synthetic benchmark for several presets in one process and keep each result as JSON.

Usage (on a CUDA machine): ``python scripts/gpu_bench.py OUT_DIR qwen3.6-27b qwen3.6-35b-a3b``
"""

from __future__ import annotations

import gc
import json
import sys
import traceback
from pathlib import Path

import torch

from ninfer.bench_synthetic import format_table, run_synthetic_bench


def main(out_dir: str, *names: str) -> int:
    failures = 0
    for name in names:
        try:
            result = run_synthetic_bench(name, profile=True, echo=lambda text: None)
        except Exception:  # keep going: one preset's failure must not hide the others' numbers
            traceback.print_exc()
            failures += 1
            continue
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        Path(out_dir, f"bench_{name}.json").write_text(json.dumps(result, indent=2))
        print(format_table(result), flush=True)
        for title in ("decode_profile", "prefill_profile"):
            print(title, flush=True)
            for row in result.get(title, [])[:12]:
                print(f"  {row['total_us']:9.1f} us  x{row['calls']:<5} {row['kernel'][:90]}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
