"""H200 check of the cheap speculative round (issue #10): the GPU tests of the MTP draft graphs and the rollback
kernel, then the round table at 27B shapes.

Usage (CUDA machine, repo root): ``python scripts/gpu_mtp_check.py OUT_DIR [PRESET] [--draft-tokens K] [--no-tests]``
(default qwen3.6-27b, K = 3; sized to finish within 120 s on the H200). Prints and writes to OUT_DIR:

* ``mtp_tests.log``: ``tests/test_mtp_fused.py`` and ``tests/test_speculative_rollback.py`` (CUDA graphs included);
* the round table of ``ninfer.bench_spec.spec_bench`` at batch 1, with the full proposal head and with
  ``--lm-head-draft`` (target: round / plain <= 1.25 at K = 3);
* ``draft_agreement``: for every tail length 1..K+1, the fused CUDA-graph draft against the generic MTP forward on the
  same states (bf16): the share of equal proposals and the relative error of the MTP KV written;
* ``rollback_us``: device time of restoring one row's recurrent state, one ``RowCopy`` launch against the per-layer
  copies it replaced.

``mtp_check_<preset>.json`` holds every number.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from gpu_spec_bench import rel_err, run_tests

from ninfer.bench_spec import bench_sequence, build_spec_runtime, format_spec_table, spec_bench
from ninfer.core.engine.batching import build_batch
from ninfer.core.engine.commit import commit_sampled
from ninfer.core.engine.speculative import StateRollback
from ninfer.core.runtime import CapturedStates, KVCache, StateCache
from ninfer.plugins.qwen3_5.mtp import Qwen35MTP
from ninfer.plugins.qwen3_5.mtp_drafter import MTPDrafter
from ninfer.plugins.qwen3_5.runtime import Qwen35Runtime

TESTS = ["tests/test_mtp_fused.py", "tests/test_speculative_rollback.py"]
PAGE_SIZE = 16


def draft_agreement(runtime: Qwen35Runtime, k: int, rows: int = 2, context: int = 160) -> dict[str, dict[str, Any]]:
    """Per tail length q: proposals of the captured fused draft equal to the generic drafter's, and the relative error
    of the MTP KV the two wrote, from the same trunk hidden states (two sets of rows: the first draft of a shape runs
    eagerly and captures, the second replays on new contents)."""
    assert runtime.mtp is not None
    generic = Qwen35Runtime(runtime.model, Qwen35MTP(runtime.model, runtime.mtp.weights))  # no decoder: generic MTP
    drafters = [MTPDrafter(runtime, k), MTPDrafter(generic, k)]
    pages_per_row = (context + 7 * rows + k + 2) // PAGE_SIZE + 1
    for drafter in drafters:
        drafter.bind(2 * rows * pages_per_row, PAGE_SIZE)
    kv = KVCache.allocate(runtime.spec, 2 * rows * pages_per_row, PAGE_SIZE)
    state = StateCache.allocate(runtime.spec, 2 * rows)
    generator = torch.Generator().manual_seed(5)
    sets = []  # two sets of prefilled rows, each row with the trunk hidden states of its prompt
    for first in (0, rows):
        prefilled = []
        for row in range(first, first + rows):
            prompt = torch.randint(0, runtime.config.vocab_size, (context + 7 * row,), generator=generator)
            pages = list(range(row * pages_per_row, (row + 1) * pages_per_row))
            seq = bench_sequence(row, prompt.tolist(), 8, row, pages, runtime, k)
            with torch.no_grad():
                hidden = runtime.forward(build_batch([seq], [seq.tokens], "none", return_hidden=True), kv,
                                         state).hidden
            seq.fed = seq.prompt_len
            commit_sampled(seq, int(runtime.model.logits(hidden[-1:])[0].argmax()), time.monotonic())
            prefilled.append((seq, hidden))
        sets.append(prefilled)
    result: dict[str, dict[str, Any]] = {}
    for q in range(1, k + 2):
        equal = total = 0
        errors = []
        for prefilled in sets:
            for seq, hidden in prefilled:  # the MTP KV of all but the last q positions, those q as the tail
                written = seq.prompt_len - q
                for drafter in drafters:
                    drafter.forget(seq)
                    drafter.observe(seq, 0, hidden[:written])
                    drafter._write_tail([seq], [drafter._rows[id(seq)]], keep_last=False)
                    drafter.observe(seq, written, hidden[written:])
            seqs = [seq for seq, _ in prefilled]
            fused, reference = (drafter.draft(seqs, [k] * rows) for drafter in drafters)
            equal += sum(a == b for f, r in zip(fused, reference) for a, b in zip(f.tokens, r.tokens))
            total += rows * k
            errors.append(rel_err(drafters[0]._kv.key[0], drafters[1]._kv.key[0]))
        runner = drafters[0].fused_runner
        result[str(q)] = {"equal_proposals": equal / total, "kv_rel_err": max(errors),
                          "captured": runner is not None and (rows, q, k) in runner.captured()}
        print(f"draft tail q={q}: {json.dumps(result[str(q)])}", flush=True)
    return result


def rollback_us(runtime: Qwen35Runtime, tokens: int, repeats: int = 50) -> dict[str, float]:
    """Device microseconds of restoring one row's state from per-token captures: ``StateRollback`` (one launch)
    against one ``copy_`` per layer and kind."""
    state = StateCache.allocate(runtime.spec, 2)
    captures = StateCache.allocate(runtime.spec, tokens)  # the shape of a verify runner's per-token buffers
    states = CapturedStates(captures.conv, captures.ssm)
    rollback = StateRollback(state)

    def kernel() -> None:
        rollback.restore(states, tokens - 2, 1)

    def per_layer() -> None:
        for destination, source in zip((*state.conv, *state.ssm), (*states.conv, *states.ssm)):
            destination[1].copy_(source[tokens - 2])

    result = {}
    for label, work in (("row_copy_kernel", kernel), ("per_layer_copies", per_layer)):
        work()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = time.perf_counter()
        start.record()
        for _ in range(repeats):
            work()
        end.record()
        host = (time.perf_counter() - host) * 1e6 / repeats
        torch.cuda.synchronize()
        result[label] = start.elapsed_time(end) * 1e3 / repeats
        result[f"{label}_host"] = host
    result["state_mib"] = runtime.spec.state_image_bytes() / 2**20
    print(f"rollback of one row: {json.dumps(result)}", flush=True)
    return result


def main(out_dir: str, *args: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name, k, tests = "qwen3.6-27b", 3, True
    arguments = iter(args)
    for arg in arguments:
        if arg == "--draft-tokens":
            k = int(next(arguments))
        elif arg == "--no-tests":
            tests = False
        else:
            name = arg
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    status = run_tests(out, TESTS, "mtp_tests.log", timeout=100) if tests else 0
    started = time.perf_counter()
    runtime = build_spec_runtime(name)
    print(f"{name}: built in {time.perf_counter() - started:.0f} s", flush=True)
    result: dict[str, Any] = {}
    steps = [  # the headline first
        ("round", lambda: spec_bench(runtime, name, draft_tokens=k, concurrency=(1,))),
        ("round_lm_head_draft", lambda: spec_bench(runtime, name, draft_tokens=k, concurrency=(1,),
                                                   lm_head_draft=True)),
        ("draft_agreement", lambda: draft_agreement(runtime, k)),
        ("rollback_us", lambda: rollback_us(runtime, k + 1)),
    ]
    for label, step in steps:
        try:
            result[label] = step()
        except Exception:  # keep going: one lease, every number counts
            traceback.print_exc()
            continue
        if label.startswith("round"):
            print(f"== {label} ({time.perf_counter() - started:.0f} s)", format_spec_table(result[label]), sep="\n",
                  flush=True)
        (out / f"mtp_check_{name}.json").write_text(json.dumps(result, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
