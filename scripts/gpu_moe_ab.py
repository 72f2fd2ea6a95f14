"""The persistent MoE kernel of this tree against other revisions of ``moe_persistent.py``, in one process.

Usage (CUDA machine, repo root)::

    mkdir -p scratch && git show main:ninfer/kernels/triton/moe_persistent.py > scratch/moe_main.py
    python scripts/gpu_moe_ab.py OUT_DIR scratch/moe_main.py [more revisions ...]

(an untracked file in the tree travels to the device machine with it).

For each variant (this tree's module as ``tree``, then each file by its stem): the block alone (``CALLS`` blocks over
rotating weights in one CUDA graph, ``gpu_moe_sweep``'s inputs, relative error against the grouped kernels) and its
phase profile (median and slowest program per ``TRACE_POINTS`` phase); then the ``qwen3.6-35b-a3b`` batch-1 step
with the decode runner calling each variant in turn, twice over (graphs back to back, benchmark step, overlapped
step, and whether the greedy tokens equal the first variant's). Prints a table last; writes ``moe_ab.json``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import torch
from gpu_moe_sweep import Blocks, phase_spans
from gpu_moe_tune import CALLS, TOP_K, graph_us

from ninfer.bench_synthetic import Clock, bench_ninfer_decode, copy_bandwidth, step_bytes
from ninfer.kernels.triton import moe_persistent
from ninfer.plugins.qwen3_5 import decode_graph
from ninfer.plugins.qwen3_5.synthetic import random_runtime

STEPS = 32


def load(path: str):
    spec = importlib.util.spec_from_file_location(f"moe_variant_{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def block_profile(module, blocks: Blocks, clock: Clock, reference: torch.Tensor) -> dict:
    """Microseconds per block, error against the grouped kernels, and the phase profile of ``module``'s kernel."""
    device = blocks.norm_weight.device

    def call(index: int, trace: torch.Tensor | None = None) -> torch.Tensor:
        layer, x, pending = blocks.inputs[index]
        return module.persistent_moe_decode(
            x, pending, blocks.norm_weight, 1e-6, gate_up=layer.gate_up, down=layer.down, top_k=TOP_K,
            shared_down=layer.shared_down, workspace=blocks.workspace, trace=trace, **layer.views(),
        )[0]

    out = call(0)
    error = float((out.float() - reference.float()).norm() / reference.float().norm())
    us = graph_us([lambda i=i: call(i) for i in range(CALLS)], clock)
    programs = module.default_programs(device)
    traces = [torch.zeros(programs, module.TRACE_SLOTS, dtype=torch.int64, device=device) for _ in range(CALLS)]
    graph_us([lambda i=i: call(i, traces[i]) for i in range(CALLS)], clock)
    _, spans = phase_spans(torch.stack(traces).double().cpu(), len(module.TRACE_POINTS))
    phases = {module.TRACE_POINTS[k]: (round(median, 2), round(slowest, 2)) for k, (median, slowest) in spans.items()}
    return {"us": us, "rel_err_vs_grouped": error, "phases": phases}


def main(out_dir: str, *paths: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    clock = Clock(device)
    variants = {"tree": moe_persistent, **{Path(path).stem: load(path) for path in paths}}
    blocks = Blocks.random(device)
    reference = blocks.grouped(0)
    result: dict = {"blocks": {}, "steps": {}}
    for name, module in variants.items():
        result["blocks"][name] = block_profile(module, blocks, clock, reference)
        print(name, json.dumps(result["blocks"][name]), flush=True)
    assert not blocks.workspace.any()
    del blocks
    torch.cuda.empty_cache()
    bandwidth = copy_bandwidth(device, clock)
    runtime = random_runtime("qwen3.6-35b-a3b", device=device)
    roofline_ms = step_bytes(runtime, 1, 256 + 4) / bandwidth * 1e3
    prompt = torch.randint(0, runtime.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    for name in list(variants) * 2:
        decode_graph.persistent_moe_decode = variants[name].persistent_moe_decode
        runtime.decoder.reset()
        torch.cuda.synchronize()
        elapsed, tokens, replay = bench_ninfer_decode(runtime, prompt, STEPS, clock)
        overlapped, _, _ = bench_ninfer_decode(runtime, prompt, STEPS, clock, overlap=True)
        result["steps"].setdefault(name, []).append(
            {"graphs_ms": replay, "step_ms": elapsed / STEPS, "overlapped_ms": overlapped / STEPS, "tokens": tokens}
        )
        print("step", name, json.dumps(result["steps"][name][-1]["graphs_ms"]), flush=True)
    decode_graph.persistent_moe_decode = moe_persistent.persistent_moe_decode
    result["roofline_ms"] = roofline_ms
    (out / "moe_ab.json").write_text(json.dumps(result, indent=2))
    first = result["steps"][next(iter(variants))][0]["tokens"]
    print(f"\n35B-A3B roofline {roofline_ms:.3f} ms ({bandwidth / 1e9:.0f} GB/s copy)")
    print("| variant | block µs | graphs ms (of roofline) | overlapped step ms (of roofline) | same tokens |")
    for name in variants:
        runs = result["steps"][name]
        graphs = " / ".join(f"{r['graphs_ms']:.3f} ({roofline_ms / r['graphs_ms']:.1%})" for r in runs)
        ahead = " / ".join(f"{r['overlapped_ms']:.3f} ({roofline_ms / r['overlapped_ms']:.1%})" for r in runs)
        print(f"| {name} | {result['blocks'][name]['us']:.2f} | {graphs} | {ahead} | {runs[0]['tokens'] == first} |")
    for name in variants:
        print(name, result["blocks"][name]["phases"])
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
