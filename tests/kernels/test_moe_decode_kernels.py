"""The grouped MoE decode kernels (``moe_grouped``) against ``moe_forward`` and plain-torch experts.

Runs on CUDA (bf16, the 35B-A3B shape and an odd one); without a GPU it runs in Triton's CPU interpreter when
``TRITON_INTERPRET=1`` (fp32, toy shapes), otherwise it is skipped. Batches of 1, 3 and 8 rows, rows that share
experts, with and without the shared expert, plain and programmatic dependent launches in a CUDA graph. In bf16
two router logits can round to a tie, so the block output is checked against experts run with the kernel's own
routing, and that routing against ``torch.topk`` of the kernel's logits (which are checked against ``F.linear``);
whenever the routings agree (always in fp32), also against ``moe_forward``.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
import moe_support
from kernel_support import (
    CUDA,
    DEVICE,
    DTYPE,
    assert_pdl_graph_matches_plain,
    needs_gpu_pdl,
    rel_err,
    seed_each_test,
    skip_module_without_triton,
)
from moe_support import check_against_twin, experts_with_routing, fused_views

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.kernels.triton.moe_grouped import (  # noqa: E402
    MAX_TOKENS,
    default_tiles,
    grouped_down,
    grouped_gate_up,
    grouped_moe_decode,
    moe_workspace,
    route_experts,
)

TOL = 1e-2 if DTYPE == torch.bfloat16 else 1e-5
# (hidden, inner, shared inner, experts, top_k): the 35B-A3B shape, sizes that are not powers of two, the tiny
# test model of tests/test_qwen35_model.py
SHAPES = [(2048, 512, 512, 256, 8), (1000, 200, 136, 24, 6), (64, 32, 32, 8, 2)] if CUDA else [(40, 12, 20, 16, 4)]


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(DTYPE)


def make_block(hidden: int, inner: int, shared_inner: int, experts: int) -> dict[str, torch.Tensor]:
    return moe_support.make_block(hidden, inner, shared_inner, experts, DEVICE, DTYPE)


def inputs(tokens: int, hidden: int) -> torch.Tensor:
    """Random rows; with more than 4, the last rows repeat the first ones, so they select the same experts."""
    x = randn(tokens, hidden)
    repeated = tokens // 2 if tokens > 4 else 0
    x[tokens - repeated :] = x[:repeated]
    return x


def check_routing(routing, x, w, top_k: int) -> None:
    """Logits match ``F.linear``; the routing is the top-k of the kernel's logits; the expert list is exact."""
    experts = w["router"].shape[0]
    assert rel_err(routing.logits[:, :experts], F.linear(x, w["router"]).float()) < TOL
    assert rel_err(routing.logits[:, experts:], F.linear(x, w["shared_expert_gate"]).float()) < TOL
    probabilities = torch.softmax(routing.logits[:, :experts], dim=-1)
    top_values = torch.topk(probabilities, top_k, dim=-1).values
    chosen = routing.experts.long()
    picked = probabilities.gather(1, chosen)
    assert torch.allclose(picked.sort(dim=-1, descending=True).values, top_values, rtol=1e-5, atol=1e-7)
    assert all(len(set(row)) == top_k for row in chosen.tolist())
    assert torch.allclose(routing.weights, picked / picked.sum(dim=-1, keepdim=True), rtol=1e-5, atol=1e-7)
    listed = sorted(set(chosen.flatten().tolist()))
    assert int(routing.count) == len(listed)
    assert routing.active[: len(listed)].tolist() == listed


_seed = seed_each_test(1234)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_grouped_moe_matches_experts_and_twin(shape, tokens):
    hidden, inner, shared_inner, experts, top_k = shape
    w = make_block(hidden, inner, shared_inner, experts)
    views = fused_views(w, experts, shared_inner)
    x = inputs(tokens, hidden)
    workspace = moe_workspace(hidden, DEVICE)
    tiles = default_tiles(tokens, DEVICE)
    routing = route_experts(
        x, views["router"], top_k, shared_expert_gate=views["shared_expert_gate"], workspace=workspace, tiles=tiles
    )
    check_routing(routing, x, w, top_k)
    act, shared_act = grouped_gate_up(x, w["gate_up"], routing, shared_gate_up=views["shared_gate_up"], tiles=tiles)
    out = grouped_down(
        act, w["down"], routing, shared_act=shared_act, shared_down=w["shared_down"], workspace=workspace, tiles=tiles
    )
    assert out.shape == (tokens, hidden) and out.dtype == x.dtype
    assert rel_err(out, experts_with_routing(x, routing.weights, routing.experts, w, shared=True)) < TOL
    check_against_twin(out, x, w, top_k, routing.experts, TOL)
    assert not workspace.any()  # every counter is left zeroed for the next call
    again = grouped_moe_decode(
        x, views["router"], w["gate_up"], w["down"], top_k, shared_gate_up=views["shared_gate_up"],
        shared_down=w["shared_down"], shared_expert_gate=views["shared_expert_gate"], workspace=workspace,
        tiles=tiles,
    )
    assert torch.equal(again, out)
    assert not workspace.any()


def test_rows_sharing_every_expert_read_them_once_and_agree():
    """Identical rows select identical experts (one group each); every row gets the same output."""
    hidden, inner, shared_inner, experts, top_k = SHAPES[-1]
    w = make_block(hidden, inner, shared_inner, experts)
    views = fused_views(w, experts, shared_inner)
    x = randn(1, hidden).repeat(8, 1)
    routing = route_experts(x, views["router"], top_k, shared_expert_gate=views["shared_expert_gate"])
    assert int(routing.count) == top_k
    out = grouped_moe_decode(
        x, views["router"], w["gate_up"], w["down"], top_k, shared_gate_up=views["shared_gate_up"],
        shared_down=w["shared_down"], shared_expert_gate=views["shared_expert_gate"],
    )
    assert torch.equal(out, out[:1].expand_as(out))
    assert rel_err(out, experts_with_routing(x, routing.weights, routing.experts, w, shared=True)) < TOL


@pytest.mark.parametrize("tokens", [1, 5])
def test_grouped_moe_without_shared_expert(tokens):
    hidden, inner, shared_inner, experts, top_k = SHAPES[-1]
    w = make_block(hidden, inner, shared_inner, experts)
    x = inputs(tokens, hidden)
    out = grouped_moe_decode(x, w["router"], w["gate_up"], w["down"], top_k)
    routing = route_experts(x, w["router"], top_k)
    assert rel_err(out, experts_with_routing(x, routing.weights, routing.experts, w, shared=False)) < TOL


@needs_gpu_pdl
@pytest.mark.parametrize("tokens", [1, 8])
def test_programmatic_dependent_launch_in_a_graph_matches_plain_launches(tokens):
    """The three kernels launched with PDL and captured in a CUDA graph give the plain launches' result."""
    hidden, inner, shared_inner, experts, top_k = SHAPES[0]
    w = make_block(hidden, inner, shared_inner, experts)
    views = fused_views(w, experts, shared_inner)
    xs = [inputs(tokens, hidden) for _ in range(3)]
    workspace = moe_workspace(hidden, DEVICE)

    def block(x, pdl):
        return grouped_moe_decode(
            x, views["router"], w["gate_up"], w["down"], top_k, shared_gate_up=views["shared_gate_up"],
            shared_down=w["shared_down"], shared_expert_gate=views["shared_expert_gate"], workspace=workspace,
            tiles=attrs.evolve(default_tiles(tokens, DEVICE), pdl=pdl),
        )

    assert_pdl_graph_matches_plain(block, xs)
    assert not workspace.any()


def test_grouped_moe_rejects_bad_inputs():
    hidden, inner, shared_inner, experts, top_k = SHAPES[-1]
    w = make_block(hidden, inner, shared_inner, experts)
    x = randn(2, hidden)
    with pytest.raises(ValueError, match="top_k"):
        grouped_moe_decode(x, w["router"], w["gate_up"], w["down"], experts + 1)
    with pytest.raises(ValueError, match="N <= "):
        grouped_moe_decode(randn(MAX_TOKENS + 1, hidden), w["router"], w["gate_up"], w["down"], top_k)
    with pytest.raises(ValueError, match="router"):
        grouped_moe_decode(x, w["router"][:, :-1], w["gate_up"], w["down"], top_k)
    with pytest.raises(ValueError, match="together"):
        grouped_moe_decode(x, w["router"], w["gate_up"], w["down"], top_k, shared_down=w["shared_down"])
    with pytest.raises(ValueError, match="16 weight rows"):
        grouped_moe_decode(x, w["router"], w["gate_up"], w["down"], top_k, tiles=default_tiles(1))
    with pytest.raises(ValueError, match="workspace"):
        grouped_moe_decode(x, w["router"], w["gate_up"], w["down"], top_k, workspace=torch.zeros(2, device=DEVICE))
