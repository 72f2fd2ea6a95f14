"""SwiGLU feed-forward blocks: the dense MLP and the routed mixture of experts with a gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(
    x: torch.Tensor, gate_weight: torch.Tensor, up_weight: torch.Tensor, down_weight: torch.Tensor
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with bias-free ``[out, in]`` weights."""
    return F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)


def route_tokens(x: torch.Tensor, router_weight: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax (fp32) over all experts, top-k, renormalised to sum 1: ``(weights [N,k] fp32, experts [N,k] int64)``."""
    probabilities = torch.softmax(F.linear(x, router_weight).float(), dim=-1)
    weights, experts = torch.topk(probabilities, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    *,
    shared_gate: torch.Tensor | None = None,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_expert_gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts (``gate_up [E,2I,H]`` gate rows first, ``down [E,H,I]``) plus the sigmoid-gated shared expert.

    ``x`` is ``[N, H]``; experts accumulate in fp32; the result has ``x.dtype``.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [N, H]; got {tuple(x.shape)}")
    num_experts = gate_up.shape[0]
    weights, experts = route_tokens(x, router_weight, top_k)
    output = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    hits = torch.bincount(experts.reshape(-1), minlength=num_experts)
    for expert in torch.nonzero(hits).flatten().tolist():
        tokens, slot = torch.nonzero(experts == expert, as_tuple=True)
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down[expert])
        output.index_put_((tokens,), expert_out.float() * weights[tokens, slot, None], accumulate=True)
    if shared_gate is not None:
        if shared_up is None or shared_down is None or shared_expert_gate is None:
            raise ValueError("the shared expert needs shared_gate, shared_up, shared_down and shared_expert_gate")
        shared = swiglu(x, shared_gate, shared_up, shared_down)
        output += torch.sigmoid(F.linear(x, shared_expert_gate).float()) * shared.float()
    return output.to(x.dtype)
