"""The GPU tests of the verify path, then the cost of one speculative MTP round on random weights (issue #10).

Usage (on a CUDA machine, from the repo root):
``python lab/gpu_spec_bench.py OUT_DIR [PRESET ...] [--draft-tokens K] [--rows 1,4] [--parts a,b] [--tests a,b]``
(default preset qwen3.6-27b, K = 3, rows 1 and 4, every part, the tests below; ``--tests ''`` runs none).
Logs and JSON go to OUT_DIR:

* ``tests.log``: ``tests/plugins/qwen3_5/test_verify_graph.py``, ``test_mtp_fused.py``,
  ``tests/bench/test_bench_spec.py`` and the decode-path kernel tests;
* ``spec_<preset>.json`` and the printed tables, for one runtime built once per preset:
  - ``verify_vs_generic`` (always): relative error of one 2-row verify forward (q = K+1) through the CUDA verify
    runner against the generic eager path on the same caches (logits, hidden states, per-token states, final
    caches), next to the same for one decode step through the decode runner (the bf16 noise of the fused path);
  - ``verify_runner``: ``ninfer.bench.spec.spec_bench`` with the CUDA verify runner, ``--rows`` rows;
  - ``lm_head_draft``: the same with the reduced proposal head, batch 1;
  - ``generic_verify``: the verify forward without the verify runner (detached from the runtime), batch 1: through
    the runtime's multi-token path, the Triton traversal that prefill takes;
  - ``round_profile``: device time per kernel of one batch-1 round (verify kernels launched eagerly).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from ninfer.bench.spec import SpecRows, build_spec_runtime, format_spec_table, spec_bench
from ninfer.bench.synthetic import Rows, _top_kernels
from ninfer.core.runtime import ForwardBatch, KVCache, StateCache
from ninfer.plugins.qwen3_5.speculative.mtp_drafter import MTPDrafter

TESTS = [
    "tests/plugins/qwen3_5/test_verify_graph.py",
    "tests/plugins/qwen3_5/test_mtp_fused.py",
    "tests/bench/test_bench_spec.py",
    "tests/kernels/test_triton_kernels.py",
    "tests/plugins/qwen3_5/test_decode_graph.py",
]


def run_tests(out: Path, tests: list[str], log_name: str = "tests.log", timeout: float = 240) -> int:
    """The GPU tests in a child process (log in ``OUT_DIR/log_name``); returns pytest's exit status."""
    if not tests:
        return 0
    started = time.perf_counter()
    with open(out / log_name, "w") as log:
        status = subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], stdout=log,
            stderr=subprocess.STDOUT, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    tail = (out / log_name).read_text().strip().splitlines()[-12:]
    print(f"GPU tests exit {status} ({time.perf_counter() - started:.0f} s)", *tail, sep="\n", flush=True)
    return status


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def verify_vs_generic(runtime: Any, q: int, context: int = 77) -> dict[str, dict[str, float]]:
    """Max relative errors of one verify forward through the verify runner (``verify``) and of one decode step
    through the decode runner (``decode``, q = 1) against the generic eager path (the reference traversal), from the
    same prefilled caches."""
    rows = Rows(runtime, 2, context + q)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        rows.forward(list(torch.randint(0, runtime.config.vocab_size, (2, context), generator=generator)))
    result = {}
    for name, tokens in (("verify", q), ("decode", 1)):
        positions = torch.cat([torch.arange(c, c + tokens) for c in rows.lengths])
        batch = ForwardBatch(
            token_ids=torch.randint(0, runtime.config.vocab_size, (2 * tokens,), generator=generator),
            positions=positions.expand(3, -1), query_lens=[tokens, tokens], context_lens=list(rows.lengths),
            page_tables=rows.page_tables, state_slots=rows.slots, logits="all", capture_states=name == "verify",
            return_hidden=True,
        )
        result[name] = _fused_vs_generic(runtime, batch, rows.kv, rows.state)
    return result


def _fused_vs_generic(runtime: Any, batch: ForwardBatch, kv: KVCache, state: StateCache) -> dict[str, float]:
    """One forward on the runtime's fused path (copies of the caches) against the reference traversal (the caches),
    which the runtime takes with both runners detached."""
    ours_kv = KVCache(kv.page_size, [t.clone() for t in kv.key], [t.clone() for t in kv.value])
    ours_state = StateCache([t.clone() for t in state.conv], [t.clone() for t in state.ssm])
    fused = runtime.verifier if batch.capture_states else runtime.decoder
    assert fused is not None and fused.supports(batch)
    with torch.no_grad():
        ours = runtime.forward(batch, ours_kv, ours_state)
        ours_states = [t.clone() for t in (*ours.states.conv, *ours.states.ssm)] if ours.states else []
        decoder, verifier = runtime.decoder, runtime.verifier
        runtime.decoder = runtime.verifier = None
        try:
            ref = runtime.forward(batch, kv, state)
        finally:
            runtime.decoder, runtime.verifier = decoder, verifier
    errors = {"logits": rel_err(ours.logits, ref.logits), "hidden": rel_err(ours.hidden, ref.hidden)}
    if ours_states:
        errors["token_states"] = max(
            rel_err(a, b) for a, b in zip(ours_states, (*ref.states.conv, *ref.states.ssm))
        )
    errors["caches"] = max(
        rel_err(a, b) for a, b in zip((*ours_kv.key, *ours_state.conv, *ours_state.ssm),
                                       (*kv.key, *state.conv, *state.ssm))
    )
    return errors


def profile_round(runtime: Any, draft_tokens: int, context: int = 256, top: int = 25) -> list[dict[str, Any]]:
    """Device time per kernel of one batch-1 round at zero acceptance, verify kernels launched without graphs."""
    from torch.profiler import ProfilerActivity, profile

    prompts = torch.randint(0, runtime.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(3))
    rows = SpecRows(runtime, MTPDrafter(runtime, draft_tokens), prompts, rounds=8)
    verifier, graphs = runtime.verifier, runtime.verifier is not None and runtime.verifier.use_graphs
    try:
        if verifier is not None:
            verifier.use_graphs = False
        for _ in range(2):
            rows.run_round("zero", instrumented=False)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            rows.run_round("zero", instrumented=False)
    finally:
        if verifier is not None:
            verifier.use_graphs = graphs
        rows.close()
    return _top_kernels(prof, top)


PARTS = ("verify_runner", "lm_head_draft", "generic_verify", "round_profile")


def run_preset(
    name: str, draft_tokens: int, out: Path, rows: tuple[int, ...] = (1, 4), parts: tuple[str, ...] = PARTS
) -> dict[str, Any]:
    started = time.perf_counter()
    runtime = build_spec_runtime(name)
    print(f"{name}: built in {time.perf_counter() - started:.0f} s", flush=True)
    result: dict[str, Any] = {}
    try:
        errors = result["verify_vs_generic"] = verify_vs_generic(runtime, draft_tokens + 1)
        for path, values in errors.items():
            # the decode runner's errors are the bf16 noise of the fused path: the verify runner should be alike
            print(f"{path} runner vs generic path, relative errors: {json.dumps(values)}", flush=True)
    except Exception:
        traceback.print_exc()
    variants = [
        ("verify_runner", dict(concurrency=rows)),
        ("lm_head_draft", dict(concurrency=(1,), lm_head_draft=True)),
        ("generic_verify", dict(concurrency=(1,))),
    ]
    for label, options in variants:
        if label not in parts:
            continue
        verifier = runtime.verifier
        if label == "generic_verify":
            runtime.verifier = None
        try:
            result[label] = spec_bench(runtime, name, draft_tokens=draft_tokens, **options)
        except Exception:  # keep going: one lease, every number counts
            traceback.print_exc()
            continue
        finally:
            runtime.verifier = verifier
        print(f"== {label} ({time.perf_counter() - started:.0f} s)", format_spec_table(result[label]), sep="\n",
              flush=True)
        (out / f"spec_{name}.json").write_text(json.dumps(result, indent=2))
    try:
        if "round_profile" in parts:
            result["round_profile"] = profile_round(runtime, draft_tokens)
            print("== device time per kernel, one batch-1 round (zero acceptance, verify without graphs)")
            for row in result["round_profile"]:
                print(f"  {row['total_us']:9.1f} us  x{row['calls']:<5} {row['kernel'][:100]}", flush=True)
    except Exception:
        traceback.print_exc()
    (out / f"spec_{name}.json").write_text(json.dumps(result, indent=2))
    del runtime
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(out_dir: str, *args: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names, draft_tokens, rows, parts, tests = [], 3, (1, 4), PARTS, TESTS
    arguments = iter(args)
    for arg in arguments:
        if arg == "--draft-tokens":
            draft_tokens = int(next(arguments))
        elif arg == "--rows":
            rows = tuple(int(n) for n in next(arguments).split(","))
        elif arg == "--parts":
            parts = tuple(next(arguments).split(","))
            unknown = set(parts) - set(PARTS)
            if unknown:
                raise SystemExit(f"unknown --parts {sorted(unknown)}; expected some of {list(PARTS)}")
        elif arg == "--tests":
            tests = [path for path in next(arguments).split(",") if path]
        else:
            names.append(arg)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    status = run_tests(out, tests)
    for name in names or ["qwen3.6-27b"]:
        run_preset(name, draft_tokens, out, rows, parts)
    return status


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
