"""H200 check of the cheap speculative round (issue #10): the GPU tests of the MTP draft graphs and the rollback
kernel, then the round table at 27B shapes.

Usage (CUDA machine, repo root): ``python scripts/gpu_mtp_check.py OUT_DIR [PRESET] [--draft-tokens K] [--no-tests]``
(default qwen3.6-27b, K = 3; sized to finish within about 200 s on the H200). Prints and writes to OUT_DIR:

* ``mtp_tests.log``: ``tests/test_mtp_fused.py``, ``tests/test_mtp_tails.py`` and
  ``tests/test_speculative_rollback.py`` (CUDA graphs included);
* the round table of ``ninfer.bench_spec.spec_bench`` at batch 1, with the full proposal head and with
  ``--lm-head-draft`` (target: round / plain <= 1.25 at K = 3);
* ``draft_agreement``: for every tail length 1..K+1 and for mixed tails (and counts) padded with ``pad_tails``, the
  fused CUDA-graph draft against the generic MTP forward on the same states (bf16): the share of equal proposals, the
  relative error of the MTP KV written, and for mixed tails the draft time with and without ``pad_tails``;
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

TESTS = ["tests/test_mtp_fused.py", "tests/test_mtp_tails.py", "tests/test_speculative_rollback.py"]
PAGE_SIZE = 16


def draft_agreement(
    runtime: Qwen35Runtime, k: int, rows: int = 2, context: int = 160, repeats: int = 5
) -> dict[str, dict[str, Any]]:
    """Per tail pattern: proposals of the captured fused draft (``pad_tails`` on) equal to the generic drafter's, and
    the relative error of the MTP KV the two hold at each row's real positions, from the same trunk hidden states
    (two sets of rows: the first draft of a shape runs eagerly and captures, the second replays on new contents).

    Patterns: every uniform tail length q (key ``"q"``), then mixed tails (key ``"mixed t1,t2 counts c1,c2"``, padded
    to the longest), one with mixed draft counts. For the mixed ones also ``draft_ms`` (the padded graph's draft) and
    ``unpadded_draft_ms`` (the path without ``pad_tails``: tails on the generic MTP forward, then the fused chain),
    median wall time of one ``draft`` call over ``repeats`` replays."""
    assert runtime.mtp is not None
    generic = Qwen35Runtime(runtime.model, Qwen35MTP(runtime.model, runtime.mtp.weights))  # no decoder: generic MTP
    drafters = [MTPDrafter(runtime, k), MTPDrafter(generic, k), MTPDrafter(runtime, k, pad_tails=False)]
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

    def with_tails(drafter: MTPDrafter, prefilled: list, tails: tuple[int, ...]) -> None:
        """The MTP KV of all but each row's last ``tails[r]`` positions written, those positions as its tail."""
        for (seq, hidden), tail in zip(prefilled, tails):
            written = seq.prompt_len - tail
            drafter.forget(seq)
            drafter.observe(seq, 0, hidden[:written])
            drafter._write_tail([seq], [drafter._rows[id(seq)]], keep_last=False)
            drafter.observe(seq, written, hidden[written:])

    def timed_ms(drafter: MTPDrafter, prefilled: list, tails: tuple[int, ...], counts: list[int]) -> float:
        times = []
        for _ in range(repeats):
            with_tails(drafter, prefilled, tails)
            torch.cuda.synchronize()
            started = time.perf_counter()
            drafter.draft([seq for seq, _ in prefilled], counts)  # returns host lists: synchronised
            times.append((time.perf_counter() - started) * 1e3)
        return sorted(times)[len(times) // 2]

    def real_kv_error(seqs: list, counts: tuple[int, ...]) -> float:
        """Relative error of the fused MTP KV of each row's real entries: its committed positions (the tail just
        written) and its own chained drafts (a row of fewer drafts than the chain's also writes scratch entries)."""
        slots = [(page, position % PAGE_SIZE) for seq, count in zip(seqs, counts)
                 for position in range(seq.fed + count - 1) for page in (seq.pages[position // PAGE_SIZE],)]
        pages, offsets = torch.tensor(slots).T
        return rel_err(drafters[0]._kv.key[0][pages, offsets], drafters[1]._kv.key[0][pages, offsets])

    def cycled(values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(values[r % len(values)] for r in range(rows))

    patterns = [(str(q), (q,) * rows, (k,) * rows) for q in range(1, k + 2)]
    for tails, counts in (((1, k + 1), (k,)), ((k + 1, 2), (k,)), ((2, 1), (k,)), ((1, k + 1), (max(k - 2, 1), k))):
        tails, counts = cycled(tails), cycled(counts)
        patterns.append((f"mixed {','.join(map(str, tails))} counts {','.join(map(str, counts))}", tails, counts))
    result: dict[str, dict[str, Any]] = {}
    runner = drafters[0].fused_runner
    for label, tails, counts in patterns:
        equal = total = 0
        errors = []
        for prefilled in sets:
            for drafter in drafters[:2]:
                with_tails(drafter, prefilled, tails)
            seqs = [seq for seq, _ in prefilled]
            fused, reference = (drafter.draft(seqs, list(counts)) for drafter in drafters[:2])
            equal += sum(a == b for f, r in zip(fused, reference) for a, b in zip(f.tokens, r.tokens))
            total += sum(counts)
            errors.append(real_kv_error(seqs, counts))
        padded = len(set(tails)) > 1
        shape = (rows, max(tails), max(counts))
        result[label] = {"equal_proposals": equal / total, "kv_rel_err": max(errors),
                         "captured": runner is not None and shape in runner.captured(padded=padded)}
        if label.startswith("mixed"):
            result[label]["draft_ms"] = timed_ms(drafters[0], sets[1], tails, list(counts))
            result[label]["unpadded_draft_ms"] = timed_ms(drafters[2], sets[1], tails, list(counts))
        print(f"draft tails {label}: {json.dumps(result[label])}", flush=True)
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
    status = run_tests(out, TESTS, "mtp_tests.log", timeout=160) if tests else 0
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
