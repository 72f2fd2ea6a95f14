"""How well a MoE layer's routing is predicted from the residual stream before its mixer (CUDA only).

Usage (repo root): ``python scripts/gpu_route_prediction.py [PRESET]`` (default ``qwen3.6-35b-a3b``, random weights).
Prefills 256 random tokens through the Triton traversal and records, per MoE layer, the residual stream ``h`` that
enters the layer and the block input ``x = rms_norm(h + mixer(h)) * (1 + w)``. The actual routing is the top-k of
``x @ router^T``; the prediction the top-k of ``(h * (1 + w)) @ router^T`` (the same norm weight; the norm's scale
does not change a top-k). Prints, per layer and overall, the mean share of the actual experts that the prediction
holds (what a block could start loading before its own router ran).
"""

from __future__ import annotations

import sys

import attrs
import torch

from ninfer.bench_synthetic import Rows
from ninfer.plugins.qwen3_5 import model as model_module
from ninfer.plugins.qwen3_5.synthetic import random_runtime


def main(preset: str = "qwen3.6-35b-a3b") -> int:
    runtime = random_runtime(preset, device=torch.device("cuda"))
    config = runtime.config
    recorded: list[torch.Tensor] = []  # per layer: h (the input norm's sum), then x (the post-mixer norm's output)
    original = model_module.TRITON_OPS

    def add_norm(pending, hidden, weight, eps):
        summed, normed = original.add_norm(pending, hidden, weight, eps)
        recorded.append(summed.float() if len(recorded) % 2 == 0 else normed.float())
        return summed, normed

    model_module.TRITON_OPS = attrs.evolve(original, add_norm=add_norm)
    try:
        prompt = torch.randint(0, config.vocab_size, (256,), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            Rows(runtime, 1, 300).forward([prompt])
    finally:
        model_module.TRITON_OPS = original
    top_k = config.num_experts_per_tok
    shares = []
    for index, layer in enumerate(runtime.model.layers):
        h, x = recorded[2 * index], recorded[2 * index + 1]
        router = layer.mlp.router.float()
        weight = 1.0 + layer.post_attention_layernorm.float()
        actual = (x @ router.T).topk(top_k, dim=-1).indices
        predicted = ((h * weight) @ router.T).topk(top_k, dim=-1).indices
        held = (actual[:, :, None] == predicted[:, None, :]).any(-1).float().mean().item()
        shares.append(held)
        print(f"layer {index:2d} ({config.layer_types[index]}): {held:.1%} of the actual experts predicted")
    print(f"{preset}: mean {sum(shares) / len(shares):.1%} over {len(shares)} layers, {top_k} of "
          f"{runtime.model.layers[0].mlp.router.shape[0]} experts, 256 tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
