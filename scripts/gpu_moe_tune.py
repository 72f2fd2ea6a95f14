"""Issue #9 on a CUDA machine: test, tune and compare the 35B-A3B decode kernels (MoE block, gated delta step).

Usage: ``python scripts/gpu_moe_tune.py OUT_DIR [--skip-tests] [--skip-step] [--skip-micro]`` (about 5 minutes).

1. The GPU tests of these kernels and of the decode step (pytest).
2. Each kernel alone at 35B-A3B shapes for 1 and 8 rows, ``CALLS`` distinct inputs captured in one CUDA graph and
   replayed (µs per call, weight/state bytes per second): the MoE block today (entry GEMM, routing, expert GEMVs,
   SiLU·mul, combine), round 3's two-launch block, the grouped block with several tile sets, the grouped block's
   three kernels one by one; the gated delta step with 1 (today), 2, 4 and 8 programs per value head. Expert weights
   rotate over ``WEIGHT_SETS`` copies so consecutive calls do not find them in L2 (a real step never does).
3. The whole captured decode step of ``qwen3.6-35b-a3b`` (random bf16 weights) at 1 and 8 rows, today's path and
   the new ones in one process (``DecodeGraphRunner.grouped_moe_rows`` / ``gdn_value_split``, the grouped kernels
   with the tiles tuned in 2.), graphs back to back, and the kernel profile of the fastest batch-1 variant.

Prints the tables last; writes ``moe_tune.json`` (and the test log) to OUT_DIR.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable

import attrs
import torch
import torch.nn.functional as F

from ninfer.bench_synthetic import Clock, bench_ninfer_decode, copy_bandwidth, step_bytes
from ninfer.kernels.moe import route_tokens
from ninfer.kernels.triton.gated_delta import fused_recurrent_gated_delta
from ninfer.kernels.triton.moe import combine_experts, expert_gemv, route_top_k
from ninfer.kernels.triton import moe_grouped
from ninfer.kernels.triton.moe_grouped import (
    MoETiles,
    default_tiles,
    grouped_down,
    grouped_gate_up,
    grouped_moe_decode,
    moe_workspace,
    route_experts,
)
from ninfer.kernels.triton.norms import silu_mul
from ninfer.plugins.qwen3_5.synthetic import random_runtime

PRESET = "qwen3.6-35b-a3b"
CALLS = 40
WEIGHT_SETS = 4
ROWS = (1, 8)
TESTS = [
    "tests/test_moe_decode_kernels.py", "tests/test_decode_kernel_variants.py", "tests/test_moe_triton.py",
    "tests/test_triton_kernels.py", "tests/test_decode_graph.py",
]
HIDDEN, INNER, SHARED, EXPERTS, TOP_K = 2048, 512, 512, 256, 8
KEY_HEADS, VALUE_HEADS, HEAD_DIM = 16, 32, 128


def run_tests(out: Path) -> str:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], capture_output=True, text=True
    )
    (out / "tests.log").write_text(result.stdout + result.stderr)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith("FAILED")]
    summary = (lines[-1] if lines else "no output") + f" ({time.perf_counter() - started:.0f} s)"
    print("tests:", summary, *failed, sep="\n  ", flush=True)
    return summary


def graph_us(calls: list[Callable[[], object]], clock: Clock, repeats: int = 7) -> float:
    """Microseconds per call: all calls captured in one graph (after an eager warm-up), median of replays."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    return statistics.median(clock.measure(graph.replay) for _ in range(repeats)) * 1e3 / len(calls)


@attrs.define
class MoELayer:
    fused: torch.Tensor  # [router | shared gate | shared up | shared expert gate] rows, like the decode path
    gate_up: torch.Tensor
    down: torch.Tensor
    shared_down: torch.Tensor

    @classmethod
    def random(cls, device: torch.device) -> "MoELayer":
        def draw(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=torch.bfloat16) * 0.02

        return cls(draw(EXPERTS + 2 * SHARED + 1, HIDDEN), draw(EXPERTS, 2 * INNER, HIDDEN),
                   draw(EXPERTS, HIDDEN, INNER), draw(HIDDEN, SHARED))

    def views(self) -> dict[str, torch.Tensor]:
        return {"router": self.fused[:EXPERTS], "shared_gate_up": self.fused[EXPERTS : EXPERTS + 2 * SHARED],
                "shared_expert_gate": self.fused[EXPERTS + 2 * SHARED :]}


def moe_bytes(layer: MoELayer, x: torch.Tensor) -> int:
    """Weight bytes one MoE block must read for ``x``: entry rows, shared down, every distinct selected expert."""
    _, chosen = route_tokens(x, layer.views()["router"], TOP_K)
    distinct = len(set(chosen.flatten().tolist()))
    expert = (layer.gate_up[0].numel() + layer.down[0].numel()) * 2
    return (layer.fused.numel() + layer.shared_down.numel()) * 2 + distinct * expert


def moe_micro(device: torch.device, clock: Clock) -> dict:
    """The MoE block alone (today, round 3, grouped) and the grouped kernels alone; picks tuned tiles per batch."""
    layers = [MoELayer.random(device) for _ in range(WEIGHT_SETS)]
    workspace = moe_workspace(HIDDEN, device)
    result: dict = {"tuned": {}}
    for rows in ROWS:
        xs = [torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16) for _ in range(CALLS)]
        pairs = [(layers[i % WEIGHT_SETS], xs[i]) for i in range(CALLS)]
        moved = statistics.mean(moe_bytes(layer, x) for layer, x in pairs)
        kernels, tuned = moe_kernel_sweep(pairs, workspace, attrs.evolve(default_tiles(rows, device), pdl=False), clock)
        result[f"kernels_{rows}"] = kernels
        result["tuned"][rows] = attrs.asdict(tuned)

        def today(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
            entry = F.linear(x, layer.fused)
            weights, chosen = route_top_k(entry[:, :EXPERTS], TOP_K)
            shared = F.linear(silu_mul(entry[:, EXPERTS : EXPERTS + 2 * SHARED]), layer.shared_down)
            act = silu_mul(expert_gemv(x, layer.gate_up, chosen, pairs_per_x=TOP_K))
            out = expert_gemv(act, layer.down, chosen, pairs_per_x=1)
            return combine_experts(out, weights, shared, entry[:, EXPERTS + 2 * SHARED :])

        def grouped(tiles: MoETiles) -> Callable[[MoELayer, torch.Tensor], torch.Tensor]:
            def block(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
                return grouped_moe_decode(x, gate_up=layer.gate_up, down=layer.down, top_k=TOP_K,
                                          shared_down=layer.shared_down, workspace=workspace, tiles=tiles,
                                          **layer.views())
            return block

        variants: dict[str, Callable] = {
            "today (separate launches)": today,
            "grouped default tiles": grouped(default_tiles(rows, device)), "grouped tuned": grouped(tuned),
            "grouped tuned + PDL": grouped(attrs.evolve(tuned, pdl=True)),
        }
        table = {}
        for label, block in variants.items():
            try:
                us = graph_us([lambda layer=layer, x=x, block=block: block(layer, x) for layer, x in pairs], clock)
            except Exception:
                traceback.print_exc()
                continue
            table[label] = {"us": us, "gb_s": moved / us / 1e3}
            print(f"MoE block rows={rows} {label}: {us:.1f} us, {moved / us / 1e3:.0f} GB/s", flush=True)
        result[f"block_{rows}"] = {"bytes_per_call": moved, "variants": table}
    return result


def kernel_tile_sets(rows: int) -> dict[str, dict[str, dict]]:
    """Per grouped kernel: labelled changes to the default tiles (empty: the default)."""
    if rows == 1:  # the first of each list is the default
        router = [(8, 8, 256, 1), (16, 8, 256, 1), (8, 8, 256, 2), (8, 4, 512, 1), (4, 8, 256, 1), (8, 16, 128, 1)]
        gate_up = [(4, 2048, 4, 3), (8, 1024, 4, 3), (2, 2048, 2, 3), (4, 2048, 8, 3), (8, 2048, 8, 3)]
        down = [(16, 4, 3), (8, 4, 3), (32, 4, 3), (16, 8, 3), (8, 2, 3)]
    else:
        router = [(16, 4, 256, 4), (16, 2, 256, 2), (16, 4, 256, 2), (32, 4, 256, 4)]
        gate_up = [(32, 256, 4, 3), (64, 256, 4, 3), (32, 128, 4, 4), (32, 512, 4, 2), (16, 512, 4, 3)]
        down = [(32, 4, 2), (64, 4, 2), (16, 4, 3), (32, 8, 2)]
    return {
        "router": {f"{r} rows, split {s}, k {k}, w{w}": dict(router_rows=r, router_split=s, router_block_k=k,
                                                             router_warps=w) for r, s, k, w in router},
        "gate_up": {f"{r} rows, k {k}, w{w}, s{st}": dict(gate_up_rows=r, gate_up_block_k=k, gate_up_warps=w,
                                                          gate_up_stages=st) for r, k, w, st in gate_up},
        "down": {f"{r} rows, w{w}, s{st}": dict(down_rows=r, down_warps=w, down_stages=st) for r, w, st in down},
    }


def moe_kernel_sweep(pairs, workspace: torch.Tensor, base: MoETiles, clock: Clock) -> tuple[dict, MoETiles]:
    """The three grouped kernels alone over precomputed inputs, each with its tile sets; the fastest of each."""
    rows = pairs[0][1].shape[0]
    staged = []
    for layer, x in pairs:
        views = layer.views()
        routing = route_experts(x, views["router"], TOP_K, shared_expert_gate=views["shared_expert_gate"],
                                workspace=workspace, tiles=base)
        act, shared_act = grouped_gate_up(x, layer.gate_up, routing, shared_gate_up=views["shared_gate_up"],
                                          tiles=base)
        staged.append((layer, x, routing, act, shared_act))
    launches = {
        "router": lambda t, s: route_experts(
            s[1], s[0].views()["router"], TOP_K, shared_expert_gate=s[0].views()["shared_expert_gate"],
            workspace=workspace, tiles=t),
        "gate_up": lambda t, s: grouped_gate_up(
            s[1], s[0].gate_up, s[2], shared_gate_up=s[0].views()["shared_gate_up"], tiles=t),
        "down": lambda t, s: grouped_down(
            s[3], s[0].down, s[2], shared_act=s[4], shared_down=s[0].shared_down, workspace=workspace, tiles=t),
    }
    result: dict = {}
    best: dict = {}
    for kind, sets in kernel_tile_sets(rows).items():
        fastest = None
        for label, changes in sets.items():
            tiles = attrs.evolve(base, **changes)
            try:
                us = graph_us([lambda s=s, t=tiles: launches[kind](t, s) for s in staged], clock)
            except Exception:
                traceback.print_exc()
                continue
            result[f"{kind}: {label}"] = us
            print(f"  rows={rows} {kind} {label}: {us:.1f} us", flush=True)
            if fastest is None or us < fastest[0]:
                fastest = (us, changes)
        if fastest is not None:
            best.update(fastest[1])
    return result, attrs.evolve(base, **best)


def gated_delta_micro(device: torch.device, clock: Clock) -> dict:
    result: dict = {}
    qkv_width = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM
    for rows in ROWS:
        cache = torch.randn(CALLS * rows, VALUE_HEADS, HEAD_DIM, HEAD_DIM, device=device) * 0.1
        projections = [torch.randn(rows, qkv_width + VALUE_HEADS * HEAD_DIM + 2 * VALUE_HEADS, device=device,
                                   dtype=torch.bfloat16) for _ in range(CALLS)]
        decay = -torch.empty(VALUE_HEADS, device=device).uniform_(1, 16)
        dt_bias, norm = torch.zeros(VALUE_HEADS, device=device), torch.ones(HEAD_DIM, device=device)
        moved = rows * VALUE_HEADS * HEAD_DIM * HEAD_DIM * 4 * 2  # the fp32 state read and written
        table = {}
        slots = [torch.arange(i * rows, (i + 1) * rows, device=device) for i in range(CALLS)]  # not in the step:
        for split in (1, 2, 4, 8):  # the kernel reads its slots before its predecessor wait
            def step(i: int, split: int = split) -> None:
                p = projections[i]
                z = p[:, qkv_width : qkv_width + VALUE_HEADS * HEAD_DIM]
                b = p[:, qkv_width + VALUE_HEADS * HEAD_DIM : qkv_width + VALUE_HEADS * HEAD_DIM + VALUE_HEADS]
                a = p[:, qkv_width + VALUE_HEADS * HEAD_DIM + VALUE_HEADS :]
                fused_recurrent_gated_delta(p[:, :qkv_width], a, b, decay, dt_bias, cache, slots[i],
                                            key_heads=KEY_HEADS, z=z, norm_weight=norm, value_split=split)
            us = graph_us([lambda i=i: step(i) for i in range(CALLS)], clock)
            table[f"value_split {split}"] = {"us": us, "gb_s": moved / us / 1e3}
            print(f"gated delta rows={rows} value_split={split}: {us:.2f} us ({moved / us / 1e3:.0f} GB/s)", flush=True)
        result[f"rows_{rows}"] = table
    return result


STEP_VARIANTS = {  # DecodeGraphRunner settings; "pdl": the grouped kernels' programmatic dependent launch
    "today": dict(grouped_moe_rows=0, gdn_value_split=1, pdl=False),
    "today + GDN split 4": dict(grouped_moe_rows=0, gdn_value_split=4, pdl=False),
    "grouped MoE (no PDL) + GDN split 4": dict(grouped_moe_rows=64, gdn_value_split=4, pdl=False),
    "grouped MoE + GDN split 4": dict(grouped_moe_rows=64, gdn_value_split=4, pdl=True),
}


def use_tiles(tuned: dict, pdl: bool) -> None:
    """Make the tuned tiles (per batch size measured, else the defaults) what the decode path's calls get."""
    measured = {int(rows): MoETiles(**fields) for rows, fields in tuned.items()}

    def tiles(tokens: int, device: torch.device | str = "cpu") -> MoETiles:
        chosen = measured.get(1) if tokens == 1 else measured.get(max(ROWS))  # one row: FMA tiles, else dot tiles
        return attrs.evolve(chosen or ORIGINAL_DEFAULT_TILES(tokens, device), pdl=pdl)

    moe_grouped.default_tiles = tiles


ORIGINAL_DEFAULT_TILES = moe_grouped.default_tiles


def whole_step(device: torch.device, clock: Clock, tuned: dict) -> dict:
    bandwidth = copy_bandwidth(device, clock)
    runtime = random_runtime(PRESET, device=device)
    config = runtime.config
    prompts = torch.randint(0, config.vocab_size, (max(ROWS), 256), generator=torch.Generator().manual_seed(0))
    decoder = runtime.decoder
    result: dict = {"copy_bandwidth_gb_s": bandwidth / 1e9, "tiles": tuned}

    def configure(settings: dict) -> None:
        decoder.grouped_moe_rows, decoder.gdn_value_split = settings["grouped_moe_rows"], settings["gdn_value_split"]
        use_tiles(tuned, settings["pdl"])
        decoder.reset()  # recapture with these kernels, in a fresh memory pool

    for rows in ROWS:
        roofline_ms = step_bytes(runtime, rows, 256 + 4) / bandwidth * 1e3
        result[f"roofline_ms_{rows}"] = roofline_ms
        for label, settings in STEP_VARIANTS.items():
            configure(settings)
            try:
                elapsed, _, replay_ms = bench_ninfer_decode(runtime, prompts[:rows], 32, clock)
            except Exception:
                traceback.print_exc()
                continue
            entry = {"step_ms": elapsed / 32, "replay_ms": replay_ms, "replay_of_roofline": roofline_ms / replay_ms}
            result[f"{label} rows={rows}"] = entry
            print(f"step rows={rows} {label}: " + json.dumps({k: round(v, 4) for k, v in entry.items()}), flush=True)
    best = min((k for k in result if k.endswith("rows=1") and isinstance(result[k], dict)),
               key=lambda k: result[k]["replay_ms"], default=None)
    if best is not None:
        configure(STEP_VARIANTS[best.rsplit(" rows=", 1)[0]])
        result["profile_rows_1"] = {"variant": best, "kernels": profile_step(runtime, 1)}
    moe_grouped.default_tiles = ORIGINAL_DEFAULT_TILES
    return result


def profile_step(runtime, rows_count: int, replays: int = 20) -> list[dict]:
    """Device µs per step of each kernel of the captured decode step (torch.profiler over graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    bench_ninfer_decode(runtime, torch.randint(0, 1000, (rows_count, 64)), 2, Clock(torch.device("cuda")))
    steps = runtime.decoder.captured(rows_count)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            for step in steps[-1:]:
                step.replay()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]][0] += event.device_time / replays
            totals[event.name[:90]][1] += 1 / replays
    table = [{"kernel": k, "us": v[0], "calls": v[1]} for k, v in totals.items()]
    return sorted(table, key=lambda row: -row["us"])


def print_tables(result: dict) -> None:
    print("\n==== summary ====")
    if "tests" in result:
        print("tests:", result["tests"])
    for rows in ROWS:
        block = result.get("moe", {}).get(f"block_{rows}")
        if block:
            print(f"MoE block alone, rows={rows} ({block['bytes_per_call'] / 1e6:.1f} MB of weights per call):")
            for label, entry in block["variants"].items():
                print(f"  {label:<36} {entry['us']:8.1f} us {entry['gb_s']:7.0f} GB/s")
        kernels = result.get("moe", {}).get(f"kernels_{rows}")
        if kernels:
            print("  grouped kernels alone (us):")
            for label, us in kernels.items():
                print(f"    {label:<44} {us:7.1f}")
        tuned = result.get("moe", {}).get("tuned", {}).get(rows)
        if tuned:
            print("  tuned tiles:", json.dumps(tuned))
        gdn = result.get("gated_delta", {}).get(f"rows_{rows}")
        if gdn:
            print(f"gated delta step, rows={rows}: " + ", ".join(f"{k} {v['us']:.2f} us" for k, v in gdn.items()))
    step = result.get("step", {})
    for rows in ROWS:
        print_step_variants(f"decode step rows={rows}", step, rows, STEP_VARIANTS, width=28)
    print_kernel_profile(step, top=14)


def print_step_variants(heading: str, step: dict, rows: int, labels: Iterable[str], width: int) -> None:
    """The ``whole_step`` timings of the step variants ``labels`` at ``rows`` rows, if measured."""
    if f"roofline_ms_{rows}" not in step:
        return
    print(f"{heading} (roofline {step[f'roofline_ms_{rows}']:.3f} ms):")
    for label in labels:
        entry = step.get(f"{label} rows={rows}")
        if entry:
            print(f"  {label:<{width}} graphs back to back {entry['replay_ms']:.3f} ms "
                  f"({entry['replay_of_roofline']:.1%} of roofline), bench step {entry['step_ms']:.3f} ms")


def print_kernel_profile(step: dict, top: int) -> None:
    """The ``top`` kernels of ``whole_step``'s batch-1 profile, if taken."""
    profile_entry = step.get("profile_rows_1")
    if profile_entry:
        kernels = profile_entry["kernels"]
        print(f"kernels of one batch-1 step ({profile_entry['variant']}), {sum(k['us'] for k in kernels):.0f} us:")
        for row in kernels[:top]:
            print(f"  {row['us']:7.1f} us x{row['calls']:<4.0f} {row['kernel'][:70]}")


def main(out_dir: str, *flags: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    clock = Clock(device)
    result: dict = {"device": torch.cuda.get_device_name(device)}
    sections = [
        ("tests", "--skip-tests", lambda: run_tests(out)),
        ("moe", "--skip-micro", lambda: moe_micro(device, clock)),
        ("gated_delta", "--skip-micro", lambda: gated_delta_micro(device, clock)),
        ("step", "--skip-step", lambda: whole_step(device, clock, result.get("moe", {}).get("tuned", {}))),
    ]
    for name, skip_flag, section in sections:
        if skip_flag in flags:
            continue
        started = time.perf_counter()
        try:
            with torch.no_grad():
                result[name] = section()
        except Exception:
            traceback.print_exc()
        print(f"[{name}: {time.perf_counter() - started:.0f} s]", flush=True)
        torch.cuda.empty_cache()
        (out / "moe_tune.json").write_text(json.dumps(result, indent=2))
    print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
