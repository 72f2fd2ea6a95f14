"""The norm-fused decode GEMVs on a CUDA machine: each kernel against what it replaces, then the decode step.

Usage: ``python scripts/gpu_norm_gemv.py OUT_DIR [--skip-micro] [--skip-step]`` (about 2.5 minutes on an H200).

1. Each new kernel alone at the 35B-A3B and 27B per-layer shapes for 1 and 8 rows, 24..256 distinct inputs
   captured in one CUDA graph and replayed (µs per call; weights rotate over copies, >= 256 MB per replay, so
   that no call finds its weights in L2), against the launches it replaces, with a few tile sets each:
   ``add_norm_gemv`` (mixer input projections, the MoE entry of the separate-launch block, the dense gate/up) vs
   ``add_rms_norm`` + cuBLAS; ``gated_norm_gemv`` (GDN out projection) vs ``gated_rms_norm`` + cuBLAS;
   ``route_experts_add_norm`` vs ``add_rms_norm`` + ``route_experts``. New kernels use PDL (back to back, as in the
   step: each call's weights stream while the previous call drains).
2. The captured decode step of ``qwen3.6-35b-a3b`` and ``qwen3.6-27b`` (random bf16 weights) at 1 and 8 rows with
   ``DecodeGraphRunner.norm_gemv_rows`` off and on (with the tiles fastest in 1., summed over the model's layers;
   with and without the post-attention fold ``norm_gemv_ffn``), graphs back to back, all in one process; the
   kernel profile of the fastest 35B-A3B batch-1 variant.

Prints the tables last; writes ``norm_gemv.json`` to OUT_DIR.
"""

from __future__ import annotations

import gc
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import attrs
import torch
import torch.nn.functional as F
from gpu_moe_tune import graph_us, print_kernel_profile, print_step_variants, profile_step

from ninfer.bench_synthetic import Clock, bench_ninfer_decode, copy_bandwidth, step_bytes
from ninfer.kernels.triton import moe_grouped, norm_gemv
from ninfer.kernels.triton.moe_grouped import moe_workspace, route_experts, route_experts_add_norm
from ninfer.kernels.triton.norm_gemv import GemvTiles, add_norm_gemv, gated_norm_gemv
from ninfer.kernels.triton.norms import add_rms_norm, gated_rms_norm
from ninfer.plugins.qwen3_5.config import Qwen35TextConfig
from ninfer.plugins.qwen3_5.presets import preset_config
from ninfer.plugins.qwen3_5.synthetic import random_runtime

MODELS = ("qwen3.6-35b-a3b", "qwen3.6-27b")
ROWS = (1, 8)
MIN_CALLS, MAX_CALLS = 24, 256  # distinct inputs per measurement
L2_DEFEAT_BYTES = 256 << 20  # weight copies per shape: at least this many bytes in rotation (L2 is 50 MB)
STEPS, CONTEXT = 32, 256
EPS = 1e-6
ORIGINAL_TILES = (norm_gemv.default_tiles, norm_gemv.default_gated_tiles, moe_grouped.default_tiles)

# labelled tile sets per (kernel, rows); the first is the default
ADD_NORM_TILES = {
    1: {"4 rows, k 2048, w4": GemvTiles(4, 2048, 4, 2), "8 rows, k 2048, w4": GemvTiles(8, 2048, 4, 2),
        "2 rows, k 2048, w2": GemvTiles(2, 2048, 2, 2), "4 rows, k 1024, w4, s3": GemvTiles(4, 1024, 4, 3)},
    8: {"32 rows, k 256, w4": GemvTiles(32, 256, 4, 3), "16 rows, k 256, w4": GemvTiles(16, 256, 4, 3),
        "32 rows, k 512, w4, s2": GemvTiles(32, 512, 4, 2), "64 rows, k 128, w4": GemvTiles(64, 128, 4, 3)},
}
GATED_TILES = {
    1: {"4 rows, 8 heads, w4": GemvTiles(4, 1024, 4, 2), "8 rows, 4 heads, w4": GemvTiles(8, 512, 4, 2),
        "2 rows, 16 heads, w4": GemvTiles(2, 2048, 4, 2)},
    8: {"32 rows, 2 heads, w4": GemvTiles(32, 256, 4, 3), "16 rows, 2 heads, w4": GemvTiles(16, 256, 4, 3),
        "32 rows, 4 heads, w4, s2": GemvTiles(32, 512, 4, 2)},
}
ROUTER_TILES = {  # changes to the grouped MoE defaults
    1: {"split 8 (default)": {}, "split 4": dict(router_split=4), "split 2, w2": dict(router_split=2, router_warps=2)},
    8: {"split 4 (default)": {}, "split 2": dict(router_split=2), "split 1": dict(router_split=1)},
}


@attrs.frozen
class Shape:
    """One GEMV of a model's decode step: ``width`` inputs, ``out_rows`` outputs, in ``layers`` layers."""

    model: str
    label: str
    kernel: str  # "add_norm", "gated" or "router"
    layers: int
    width: int
    out_rows: int
    heads: int = 0  # gated: value heads of ``width / heads`` each
    rows: tuple[int, ...] = ROWS  # batch sizes at which the step uses it


def model_shapes(name: str) -> list[Shape]:
    config = Qwen35TextConfig.from_hf(preset_config(name))
    hidden = config.hidden_size
    recurrent, attention = len(config.linear_attention_layers), len(config.full_attention_layers)
    attention_rows = (2 * config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    gdn_rows = config.conv_dim + config.linear_value_dim + 2 * config.linear_num_value_heads
    shapes = [
        Shape(name, "GDN in", "add_norm", recurrent, hidden, gdn_rows),
        Shape(name, "attention in", "add_norm", attention, hidden, attention_rows),
        Shape(name, "GDN out", "gated", recurrent, config.linear_value_dim, hidden, config.linear_num_value_heads),
    ]
    layers = recurrent + attention
    if config.is_moe:
        entry = config.num_experts + 2 * config.shared_expert_intermediate_size + 1
        # the decode runner takes the grouped MoE block at batch 1, the separate launches at 8 rows
        shapes += [Shape(name, "MoE entry (separate-launch MoE)", "add_norm", layers, hidden, entry, rows=(8,)),
                   Shape(name, "router (grouped MoE)", "router", layers, hidden, config.num_experts)]
    else:
        shapes.append(Shape(name, "dense gate/up", "add_norm", layers, hidden, 2 * config.intermediate_size))
    return shapes


def draw(*shape: int, scale: float = 0.02) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * scale


def weight_copies(shape: tuple[int, ...]) -> tuple[int, list[torch.Tensor]]:
    """``(calls, copies)``: enough copies of a weight, one call after the other each reading the next, that the
    calls of one graph replay read at least ``L2_DEFEAT_BYTES`` (small weights: more calls)."""
    count = max(2, math.ceil(L2_DEFEAT_BYTES / (math.prod(shape) * 2)))
    calls = min(max(MIN_CALLS, count), MAX_CALLS)
    return calls, [draw(*shape) for _ in range(min(count, calls))]


def time_variants(calls: int, variants: dict[str, Callable[[int], object]], clock: Clock) -> dict[str, float]:
    """µs per call of each variant (``call(i)`` runs input ``i``), ``calls`` calls in one graph."""
    table = {}
    for label, call in variants.items():
        try:
            table[label] = graph_us([lambda i=i, call=call: call(i) for i in range(calls)], clock)
        except Exception:
            traceback.print_exc()
    return table


def add_norm_variants(shape: Shape, rows: int) -> tuple[int, dict[str, Callable[[int], object]]]:
    calls, weights = weight_copies((shape.out_rows, shape.width))
    norm = draw(shape.width, scale=0.3)
    hidden = [draw(rows, shape.width, scale=1.0) for _ in range(calls)]
    pending = [draw(rows, shape.width, scale=1.0) for _ in range(calls)]
    keep = shape.label.startswith("MoE entry")  # the separate-launch MoE block also reads the normed rows

    def replaced(i: int) -> object:
        _, normed = add_rms_norm(pending[i], hidden[i], norm, EPS)
        return F.linear(normed, weights[i % len(weights)])

    variants: dict[str, Callable[[int], object]] = {"replaced: add_rms_norm + cuBLAS": replaced}
    for label, tiles in ADD_NORM_TILES[rows].items():
        tiles = attrs.evolve(tiles, pdl=True)
        variants[label] = lambda i, tiles=tiles: add_norm_gemv(
            hidden[i], pending[i], norm, weights[i % len(weights)], EPS, keep_normed=keep, tiles=tiles
        )
    return calls, variants


def gated_variants(shape: Shape, rows: int) -> tuple[int, dict[str, Callable[[int], object]]]:
    dim = shape.width // shape.heads
    calls, weights = weight_copies((shape.out_rows, shape.width))
    norm = draw(dim, scale=0.3) + 1
    core = [draw(rows, shape.heads, dim, scale=1.0) for _ in range(calls)]
    z = [draw(rows, 3 * shape.width, scale=1.0)[:, shape.width : 2 * shape.width] for _ in range(calls)]

    def replaced(i: int) -> object:
        gated = gated_rms_norm(core[i], z[i].view(rows, shape.heads, dim), norm, EPS)
        return F.linear(gated.view(rows, shape.width), weights[i % len(weights)])

    variants: dict[str, Callable[[int], object]] = {"replaced: gated_rms_norm + cuBLAS": replaced}
    for label, tiles in GATED_TILES[rows].items():
        tiles = attrs.evolve(tiles, pdl=True)
        variants[label] = lambda i, tiles=tiles: gated_norm_gemv(
            core[i], z[i], norm, weights[i % len(weights)], EPS, tiles=tiles
        )
    return calls, variants


def router_variants(shape: Shape, rows: int) -> tuple[int, dict[str, Callable[[int], object]]]:
    calls, routers = weight_copies((shape.out_rows + 1, shape.width))  # router rows, the shared expert's gate row
    norm = draw(shape.width, scale=0.3)
    hidden = [draw(rows, shape.width, scale=1.0) for _ in range(calls)]
    pending = [draw(rows, shape.width, scale=1.0) for _ in range(calls)]
    workspace = moe_workspace(shape.width, "cuda")
    top_k = 8
    base = attrs.evolve(ORIGINAL_TILES[2](rows, "cuda"), pdl=True)

    def replaced(i: int) -> object:
        router = routers[i % len(routers)]
        _, normed = add_rms_norm(pending[i], hidden[i], norm, EPS)
        return route_experts(normed, router[:-1], top_k, shared_expert_gate=router[-1:], workspace=workspace,
                             tiles=base)

    variants: dict[str, Callable[[int], object]] = {"replaced: add_rms_norm + route_experts": replaced}
    for label, changes in ROUTER_TILES[rows].items():
        tiles = attrs.evolve(base, **changes)
        variants[label] = lambda i, tiles=tiles: route_experts_add_norm(
            hidden[i], pending[i], norm, EPS, routers[i % len(routers)][:-1], top_k,
            shared_expert_gate=routers[i % len(routers)][-1:], workspace=workspace, tiles=tiles,
        )
    return calls, variants


VARIANTS = {"add_norm": add_norm_variants, "gated": gated_variants, "router": router_variants}


def micro(clock: Clock) -> dict:
    """Every shape of every model at every batch size: {model: {rows: {shape label: {variant: µs}}}}."""
    result: dict = {}
    for name in MODELS:
        for shape in model_shapes(name):
            for rows in shape.rows:
                table = time_variants(*VARIANTS[shape.kernel](shape, rows), clock)
                result.setdefault(name, {}).setdefault(str(rows), {})[shape.label] = {
                    "kernel": shape.kernel, "layers": shape.layers, "us": table,
                }
                print(f"{name} rows={rows} {shape.label}: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in table.items()), flush=True)
                gc.collect()
                torch.cuda.empty_cache()
    return result


def tuned_tiles(micro_result: dict, name: str) -> dict:
    """Per kernel and batch size, the tile set with the least step time over the model's layers."""
    choice: dict = {}
    for rows, shapes in micro_result.get(name, {}).items():
        totals: dict[tuple[str, str], float] = {}
        for entry in shapes.values():
            for label, us in entry["us"].items():
                if not label.startswith("replaced"):
                    key = (entry["kernel"], label)
                    totals[key] = totals.get(key, 0.0) + us * entry["layers"]
        for kernel in VARIANTS:
            candidates = {label: total for (k, label), total in totals.items() if k == kernel}
            if candidates:
                choice.setdefault(kernel, {})[rows] = min(candidates, key=candidates.get)
    return choice


def use_tiles(choice: dict | None) -> None:
    """Make the chosen tile sets (None: the defaults) what the decode path's calls get."""
    norm_gemv.default_tiles, norm_gemv.default_gated_tiles, moe_grouped.default_tiles = ORIGINAL_TILES
    if not choice:
        return

    def picker(kernel: str, table: dict, original: Callable) -> Callable:
        def tiles(tokens: int, device: torch.device | str = "cpu", *width: int):
            label = choice.get(kernel, {}).get("1" if tokens == 1 else "8")
            default = original(tokens, device, *width)
            if label is None:
                return default
            chosen = table[1 if tokens == 1 else 8][label]
            if kernel == "router":
                return attrs.evolve(default, **chosen)
            return attrs.evolve(chosen, pdl=default.pdl)
        return tiles

    norm_gemv.default_tiles = picker("add_norm", ADD_NORM_TILES, ORIGINAL_TILES[0])
    norm_gemv.default_gated_tiles = picker("gated", GATED_TILES, ORIGINAL_TILES[1])
    moe_grouped.default_tiles = picker("router", ROUTER_TILES, ORIGINAL_TILES[2])


STEP_VARIANTS = {  # label: (norm_gemv_rows, norm_gemv_ffn, tuned tiles)
    "separate norms": (0, True, False),
    "folded, tuned tiles": (8, True, True),
    "folded (not the FFN norm), tuned tiles": (8, False, True),
}


def whole_step(name: str, clock: Clock, choice: dict, profile: bool) -> dict:
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device, clock)
    runtime = random_runtime(name, device=device)
    config = runtime.config
    prompts = torch.randint(0, config.vocab_size, (max(ROWS), CONTEXT), generator=torch.Generator().manual_seed(0))
    decoder = runtime.decoder
    result: dict = {"copy_bandwidth_gb_s": bandwidth / 1e9, "tiles": choice}

    def configure(label: str) -> None:
        rows_limit, ffn, tuned = STEP_VARIANTS[label]
        decoder.norm_gemv_rows, decoder.norm_gemv_ffn = rows_limit, ffn
        use_tiles(choice if tuned else None)
        decoder.reset()  # recapture with these kernels, in a fresh memory pool

    for rows in ROWS:
        roofline_ms = step_bytes(runtime, rows, CONTEXT + 4) / bandwidth * 1e3
        result[f"roofline_ms_{rows}"] = roofline_ms
        for label in STEP_VARIANTS:
            configure(label)
            try:
                elapsed, _, replay_ms = bench_ninfer_decode(runtime, prompts[:rows], STEPS, clock)
            except Exception:
                traceback.print_exc()
                continue
            entry = {"step_ms": elapsed / STEPS, "replay_ms": replay_ms, "replay_of_roofline": roofline_ms / replay_ms}
            result[f"{label} rows={rows}"] = entry
            print(f"{name} step rows={rows} {label}: " + json.dumps({k: round(v, 4) for k, v in entry.items()}),
                  flush=True)
    if profile:
        best = min((k for k in result if k.endswith("rows=1") and isinstance(result[k], dict)),
                   key=lambda k: result[k]["replay_ms"], default=None)
        if best is not None:
            configure(best.rsplit(" rows=", 1)[0])
            result["profile_rows_1"] = {"variant": best, "kernels": profile_step(runtime, 1)}
    use_tiles(None)
    return result


def print_tables(result: dict) -> None:
    print("\n==== summary ====")
    for name, by_rows in result.get("micro", {}).items():
        for rows, shapes in by_rows.items():
            print(f"{name}, {rows} row(s), µs per call (graph-replayed, weights out of L2):")
            for label, entry in shapes.items():
                print(f"  {label} (x{entry['layers']} layers)")
                for variant, us in entry["us"].items():
                    print(f"    {variant:<44} {us:8.2f}")
    for name in MODELS:
        step = result.get("step", {}).get(name, {})
        for rows in ROWS:
            print_step_variants(f"{name} decode step, {rows} row(s)", step, rows, STEP_VARIANTS, width=40)
        if step.get("tiles"):
            print(f"  tuned tiles: {json.dumps(step['tiles'])}")
        print_kernel_profile(step, top=16)


def main(out_dir: str, *flags: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    clock = Clock(device)
    result: dict = {"device": torch.cuda.get_device_name(device)}

    def save() -> None:
        (out / "norm_gemv.json").write_text(json.dumps(result, indent=2))

    with torch.no_grad():
        if "--skip-micro" not in flags:
            started = time.perf_counter()
            try:
                result["micro"] = micro(clock)
            except Exception:
                traceback.print_exc()
            print(f"[micro: {time.perf_counter() - started:.0f} s]", flush=True)
            save()
        if "--skip-step" not in flags:
            for index, name in enumerate(MODELS):
                started = time.perf_counter()
                try:
                    choice = tuned_tiles(result.get("micro", {}), name)
                    result.setdefault("step", {})[name] = whole_step(name, clock, choice, profile=index == 0)
                except Exception:
                    traceback.print_exc()
                gc.collect()  # the model's weights go before the next one's
                torch.cuda.empty_cache()
                print(f"[step {name}: {time.perf_counter() - started:.0f} s]", flush=True)
                save()
    print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
