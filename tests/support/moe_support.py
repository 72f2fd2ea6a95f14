"""What the MoE decode kernel tests share: a random block of weights and the block output for a given routing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernel_support import rel_err

from ninfer.kernels.reference.moe import moe_forward, route_tokens


def make_block(hidden: int, inner: int, shared_inner: int, experts: int, device, dtype) -> dict[str, torch.Tensor]:
    """Random expert, shared-expert and router weights, plus ``fused``: the decode path's fused entry rows
    ``[router | shared gate | shared up | shared expert gate]``."""

    def randn(*shape, scale):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    w = {
        "router": randn(experts, hidden, scale=0.5),
        "gate_up": randn(experts, 2 * inner, hidden, scale=0.05),
        "down": randn(experts, hidden, inner, scale=0.05),
        "shared_gate": randn(shared_inner, hidden, scale=0.05),
        "shared_up": randn(shared_inner, hidden, scale=0.05),
        "shared_down": randn(hidden, shared_inner, scale=0.05),
        "shared_expert_gate": randn(1, hidden, scale=0.5),
    }
    w["fused"] = torch.cat([w["router"], w["shared_gate"], w["shared_up"], w["shared_expert_gate"]])
    return w


def fused_views(w: dict[str, torch.Tensor], experts: int, shared_inner: int) -> dict[str, torch.Tensor]:
    """The kernels' router / shared gate-up / shared expert gate arguments as views of the fused entry rows."""
    fused = w["fused"]
    return {
        "router": fused[:experts],
        "shared_gate_up": fused[experts : experts + 2 * shared_inner],
        "shared_expert_gate": fused[experts + 2 * shared_inner :],
    }


def experts_with_routing(x, weights, chosen, w, shared: bool) -> torch.Tensor:
    """The block output for a given routing: each selected expert run with plain torch, rounded like the twin."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for row in range(x.shape[0]):
        for slot, expert in enumerate(chosen[row].tolist()):
            gate, up = F.linear(x[row : row + 1], w["gate_up"][expert]).chunk(2, dim=-1)
            expert_out = F.linear(F.silu(gate) * up, w["down"][expert])
            out[row] += weights[row, slot] * expert_out[0].float()
    if shared:
        gate_logit = F.linear(x, w["shared_expert_gate"]).float()
        shared_out = F.linear(F.silu(F.linear(x, w["shared_gate"])) * F.linear(x, w["shared_up"]), w["shared_down"])
        out += torch.sigmoid(gate_logit) * shared_out.float()
    return out.to(x.dtype)


def check_against_twin(out: torch.Tensor, x: torch.Tensor, w: dict, top_k: int, chosen: torch.Tensor, tol: float):
    """``out`` matches ``moe_forward`` whenever the kernel's selection ``chosen [N, k]`` is the twin's; otherwise the
    two differ by a tie between bf16 router logits, where any of the tied experts is a right answer."""
    _, twin_experts = route_tokens(x, w["router"], top_k)
    if torch.equal(twin_experts.sort(dim=-1).values, chosen.long().sort(dim=-1).values):
        twin = moe_forward(
            x, w["router"], w["gate_up"], w["down"], top_k, shared_gate=w["shared_gate"], shared_up=w["shared_up"],
            shared_down=w["shared_down"], shared_expert_gate=w["shared_expert_gate"],
        )
        assert rel_err(out, twin) < tol
    else:
        assert x.dtype == torch.bfloat16
