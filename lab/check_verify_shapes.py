"""The CUDA verify runner and the decode runner against the generic eager path at a preset's real per-layer shapes.

Usage: ``python lab/check_verify_shapes.py [PRESET] [--layers N] [--vocab V] [--intermediate I] [--draft-tokens K]
[--dtype D] [--full 1]`` (defaults: qwen3.6-27b, 2 layers = one Gated DeltaNet + one full attention, vocab 4096, the
preset's MLP width, K = 3). Runs on CUDA (bf16 unless ``--dtype``), or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, fp32: its bf16 ``tl.dot`` is not faithful). With ``--layers`` the preset's own layer order is
kept (every fourth layer full attention) unless N is 2.

Two rows are prefilled on the generic path (contexts spanning several KV pages, shuffled pages, page tables of 16
pages, bucketed to 64 by the runners), then from the same caches:

* ``verify``: one verify forward (q = K+1 per row) through ``VerifyGraphRunner`` (eager) against the generic path;
* ``decode``: one decode step through ``DecodeGraphRunner`` (eager) against the generic path — the bf16 baseline;
* ``verify_q1_vs_decode``: the verify runner's traversal with one token per row against the decode runner.

Each gives the relative error of logits and hidden states, of the per-token states and of every layer's cache
(the new tokens' KV in the attention layers, conv windows and SSM states of the recurrent ones), so a wrong layer
stands out: printed
as one line per section (each layer's worst entry), or every entry with ``--full 1``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from ninfer.core.runtime import ForwardBatch, KVCache, StateCache
from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner, DecodeInputs
from ninfer.plugins.qwen3_5.cuda.verify_graph import VerifyGraphRunner
from ninfer.plugins.qwen3_5.model.config import FULL_ATTENTION, LINEAR_ATTENTION
from ninfer.plugins.qwen3_5.model.fused import fuse_model
from ninfer.plugins.qwen3_5.model.presets import preset_config
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.model.synthetic import InMemorySource, build_runtime, random_text_weights

PAGE_SIZE = 16
CONTEXTS = (77, 200)
PAGES_PER_ROW = 16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Caches:
    """Two rows' KV pages (shuffled) and state slots (reversed), cloneable."""

    def __init__(self, runtime: Qwen35Runtime) -> None:
        rows = len(CONTEXTS)
        self.kv = KVCache.allocate(runtime.spec, rows * PAGES_PER_ROW + 3, PAGE_SIZE)
        self.state = StateCache.allocate(runtime.spec, rows + 2)
        order = torch.randperm(rows * PAGES_PER_ROW + 3, generator=torch.Generator().manual_seed(7))
        self.page_tables = order[: rows * PAGES_PER_ROW].view(rows, PAGES_PER_ROW).to(torch.int32)
        self.slots = torch.tensor([2, 0])
        self.lengths = [0] * rows

    def clone(self) -> "Caches":
        copy = object.__new__(Caches)
        copy.kv = KVCache(self.kv.page_size, [t.clone() for t in self.kv.key], [t.clone() for t in self.kv.value])
        copy.state = StateCache([t.clone() for t in self.state.conv], [t.clone() for t in self.state.ssm])
        copy.page_tables, copy.slots, copy.lengths = self.page_tables, self.slots, list(self.lengths)
        return copy

    def batch(self, chunks: list[list[int]], *, verify: bool, logits: str = "last") -> ForwardBatch:
        contexts = list(self.lengths)
        positions = torch.cat([torch.arange(c, c + len(t)) for c, t in zip(contexts, chunks)])
        self.lengths = [c + len(t) for c, t in zip(contexts, chunks)]
        return ForwardBatch(
            token_ids=torch.tensor([t for chunk in chunks for t in chunk]),
            positions=positions.expand(3, -1),
            query_lens=[len(c) for c in chunks],
            context_lens=contexts,
            page_tables=self.page_tables,
            state_slots=self.slots,
            logits="all" if verify else logits,
            capture_states=verify,
            return_hidden=True,
        )


def cache_errors(got: Caches, expected: Caches, kinds: tuple[str, ...], before: list[int]) -> dict[str, float]:
    """Per layer: the KV of the tokens after ``before[row]`` in attention layers (the prefilled context is the same
    on both sides), the conv window and SSM state of recurrent ones."""
    slots = torch.tensor([
        int(got.page_tables[row, position // PAGE_SIZE]) * PAGE_SIZE + position % PAGE_SIZE
        for row, start in enumerate(before)
        for position in range(start, got.lengths[row])
    ])
    errors: dict[str, float] = {}
    attention = recurrent = 0
    for layer, kind in enumerate(kinds):
        if kind == FULL_ATTENTION:
            pairs = (("key", got.kv.key, expected.kv.key), ("value", got.kv.value, expected.kv.value))
            for name, ours, theirs in pairs:
                new = [t.flatten(0, 1)[slots.to(t.device)] for t in (ours[attention], theirs[attention])]
                errors[f"L{layer} {name}"] = rel_err(*new)
            attention += 1
        else:
            errors[f"L{layer} conv"] = rel_err(got.state.conv[recurrent], expected.state.conv[recurrent])
            errors[f"L{layer} ssm"] = rel_err(got.state.ssm[recurrent], expected.state.ssm[recurrent])
            recurrent += 1
    return errors


def build(preset: str, layers: int, vocab: int, intermediate: int, dtype: torch.dtype, device: torch.device):
    config = {**preset_config(preset), "num_hidden_layers": layers, "vocab_size": vocab}
    if intermediate:
        config["intermediate_size"] = intermediate
    if layers == 2:
        config["layer_types"] = [LINEAR_ATTENTION, FULL_ATTENTION]
    tensors = random_text_weights(config, device=device, dtype=dtype, seed=3)
    with torch.no_grad():  # move norms and gates away from their init values so every weight matters
        for name, tensor in tensors.items():
            if "norm" in name or "dt_bias" in name:
                tensor.add_(torch.randn_like(tensor.float()).to(tensor.dtype) * 0.2)
    source = InMemorySource(preset, config, tensors)
    del tensors  # the source's copy is emptied once loaded: the unfused weights are freed while fusing
    runtime = build_runtime(source, dtype=dtype, device=device, cuda_graphs=False)
    model = runtime.model
    if runtime.decoder is None:
        model, fused = fuse_model(model)
    else:
        fused = runtime.decoder.fused
    return Qwen35Runtime(model, None, None), model, fused


def check(
    preset: str, layers: int, vocab: int, intermediate: int, draft_tokens: int, dtype: torch.dtype
) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    reference, model, fused = build(preset, layers, vocab, intermediate, dtype, device)
    kinds = model.config.layer_types
    caches = Caches(reference)
    with torch.no_grad():
        prompts = [torch.randint(0, vocab, (n,)).tolist() for n in CONTEXTS]
        reference.forward(caches.batch(prompts, verify=False), caches.kv, caches.state)
    result: dict[str, Any] = {"preset": preset, "layers": layers, "dtype": str(dtype), "device": str(device)}
    verifier = VerifyGraphRunner(model, fused, use_graphs=False)
    decoder = DecodeGraphRunner(model, fused, use_graphs=False)

    q = draft_tokens + 1
    drafts = [torch.randint(0, vocab, (q,)).tolist() for _ in CONTEXTS]
    expected, ours = caches.clone(), caches.clone()
    with torch.no_grad():
        want = reference.forward(expected.batch(drafts, verify=True), expected.kv, expected.state)
        batch = ours.batch(drafts, verify=True)
        assert verifier.supports(batch)
        got = verifier.forward(batch, ours.kv, ours.state)
    token_states: dict[str, float] = {}
    recurrent = [i for i, kind in enumerate(kinds) if kind != FULL_ATTENTION]
    for index, layer in enumerate(recurrent):
        token_states[f"L{layer} conv"] = rel_err(got.states.conv[index], want.states.conv[index])
        token_states[f"L{layer} ssm"] = rel_err(got.states.ssm[index], want.states.ssm[index])
    result["verify"] = {
        "logits": rel_err(got.logits, want.logits),
        "hidden": rel_err(got.hidden, want.hidden),
        "token_states": token_states,
        "caches": cache_errors(ours, expected, kinds, caches.lengths),
    }

    step = [[int(t)] for t in torch.randint(0, vocab, (len(CONTEXTS),))]
    expected, ours, single = caches.clone(), caches.clone(), caches.clone()
    with torch.no_grad():
        want = reference.forward(expected.batch(step, verify=False), expected.kv, expected.state)
        got = decoder.forward(ours.batch(step, verify=False), ours.kv, ours.state)
        result["decode"] = {
            "logits": rel_err(got.logits, want.logits),
            "hidden": rel_err(got.hidden, want.hidden),
            "caches": cache_errors(ours, expected, kinds, caches.lengths),
        }
        inputs = DecodeInputs(len(CONTEXTS), PAGES_PER_ROW, device, q=1)
        inputs.load(single.batch(step, verify=True))
        buffers = verifier._state_buffers(single.state, len(CONTEXTS))
        hidden, logits = verifier.verify_step(inputs, single.kv, single.state, buffers, None, {})
    result["verify_q1_vs_decode"] = {
        "logits": rel_err(logits, got.logits),
        "hidden": rel_err(hidden, got.hidden),
        "caches": cache_errors(single, ours, kinds, caches.lengths),
    }
    return result


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per section: logits and hidden errors, the worst per-layer entry, and each layer's worst entry in one line."""
    short: dict[str, Any] = {key: value for key, value in result.items() if not isinstance(value, dict)}
    for section, errors in result.items():
        if not isinstance(errors, dict):
            continue
        per_layer: dict[str, float] = {}
        for group in ("token_states", "caches"):
            for name, value in errors.get(group, {}).items():
                layer = name.split()[0]
                per_layer[layer] = max(per_layer.get(layer, 0.0), value)
        worst = max(per_layer.items(), key=lambda item: item[1])
        short[section] = {
            "logits": f"{errors['logits']:.3g}",
            "hidden": f"{errors['hidden']:.3g}",
            "worst layer": f"{worst[0]} {worst[1]:.3g}",
            "per layer": " ".join(
                f"{layer}:{per_layer[layer]:.2g}" for layer in sorted(per_layer, key=lambda name: int(name[1:]))
            ),
        }
    return short


def main(*args: str) -> int:
    options = {
        "--layers": "2", "--vocab": "4096", "--intermediate": "0", "--draft-tokens": "3", "--dtype": "", "--full": "0"
    }
    names = []
    arguments = iter(args)
    for arg in arguments:
        if arg in options:
            options[arg] = next(arguments)
        else:
            names.append(arg)
    dtype_name = options["--dtype"] or ("bfloat16" if torch.cuda.is_available() else "float32")
    result = check(
        names[0] if names else "qwen3.6-27b", int(options["--layers"]), int(options["--vocab"]),
        int(options["--intermediate"]), int(options["--draft-tokens"]), getattr(torch, dtype_name),
    )
    print(json.dumps(summary(result) if options["--full"] != "1" else result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
