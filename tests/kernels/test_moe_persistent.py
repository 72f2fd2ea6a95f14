"""The persistent one-row MoE decode kernel (``moe_persistent``) against ``moe_forward`` and plain-torch experts.

Runs on CUDA (bf16: the 35B-A3B shape, odd sizes, grids of one program per SM and of a few programs that loop over
their units, one launch with grid barriers and the three-launch form); without a GPU in Triton's CPU interpreter
when ``TRITON_INTERPRET=1`` (fp32, toy shapes, the three-launch form), otherwise it is skipped. In bf16 two router
logits can round to a tie, so the output is checked against experts run with the routing of the kernel's own logits
(the highest logits, the lower index first among equal ones) and, whenever that routing is the twin's, against
``moe_forward``.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F
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
from moe_support import check_against_twin, experts_with_routing, fused_views, make_block

from ninfer.kernels.reference.norms import rms_norm

pytestmark = pytest.mark.gpu

skip_module_without_triton()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from ninfer.kernels.triton import moe_persistent  # noqa: E402
from ninfer.kernels.triton.moe_grouped import moe_workspace  # noqa: E402
from ninfer.kernels.triton.moe_persistent import (  # noqa: E402
    NotResidentError,
    default_programs,
    default_tiles,
    persistent_moe_decode,
)

TOL = 1e-2 if DTYPE == torch.bfloat16 else 1e-5
EPS = 1e-6
# (hidden, inner, shared inner, experts, top_k)
SHAPES = [(2048, 512, 512, 256, 8), (1000, 200, 136, 24, 6), (64, 32, 32, 8, 2)] if CUDA else [(40, 12, 20, 16, 4)]
# grids: the default (one program per SM on CUDA), and few programs, each looping over several units
GRIDS = [None, 7] if CUDA else [None, 2, 64]


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(DTYPE)


_seed = seed_each_test(4321)


def run(hidden, pending, norm, w, views, top_k, workspace, **options):
    return persistent_moe_decode(
        hidden, pending, norm, EPS, views["router"], w["gate_up"], w["down"], top_k,
        shared_gate_up=views["shared_gate_up"], shared_down=w["shared_down"],
        shared_expert_gate=views["shared_expert_gate"], workspace=workspace, **options,
    )


def check_block(out, logits, x, w, top_k):
    """Logits match ``F.linear``; the output matches the experts of the kernel's logits' routing, and the twin."""
    experts = w["router"].shape[0]
    assert rel_err(logits[:experts], F.linear(x, w["router"])[0].float()) < TOL
    assert rel_err(logits[experts:], F.linear(x, w["shared_expert_gate"])[0].float()) < TOL
    # the kernel's rule: the highest logits, the lower index first among equal (bf16-rounded) ones
    chosen = torch.sort(logits[None, :experts], dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.softmax(logits[None, :experts], dim=-1).gather(1, chosen)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, experts_with_routing(x, weights, chosen, w, shared=True)) < TOL
    check_against_twin(out, x, w, top_k, chosen, TOL)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("programs", GRIDS)
@pytest.mark.parametrize("entry", ["add_norm", "norm", "plain"])
def test_persistent_moe_matches_experts_and_twin(shape, programs, entry):
    hidden_size, inner, shared_inner, experts, top_k = shape
    w = make_block(hidden_size, inner, shared_inner, experts, DEVICE, DTYPE)
    views = fused_views(w, experts, shared_inner)
    hidden = randn(1, hidden_size)
    pending = randn(1, hidden_size) if entry == "add_norm" else None
    norm = randn(hidden_size, scale=0.1) if entry != "plain" else None
    workspace = moe_workspace(hidden_size, DEVICE)
    out, new_hidden, logits = run(hidden, pending, norm, w, views, top_k, workspace, programs=programs)
    summed = hidden if pending is None else (hidden.float() + pending.float()).to(DTYPE)
    assert torch.equal(new_hidden, summed)
    x = summed if norm is None else rms_norm(summed, norm, EPS, zero_centered=True)
    check_block(out, logits, x, w, top_k)
    assert not workspace.any()  # the barrier counter is left zeroed for the next call
    again = run(hidden, pending, norm, w, views, top_k, workspace, programs=programs)
    assert torch.equal(again[0], out)
    if CUDA:  # the three-launch form (the interpreter's) computes the same bits
        three = run(hidden, pending, norm, w, views, top_k, workspace, programs=programs, one_launch=False)
        assert torch.equal(three[0], out) and torch.equal(three[2], logits)
    assert not workspace.any()


@needs_gpu_pdl
def test_programmatic_dependent_launch_in_a_graph_matches_plain_launches():
    """Blocks chained through the residual stream, launched with PDL and captured in one CUDA graph, give the plain
    launches' results (the counter is reset between the grid barriers of consecutive launches)."""
    hidden_size, inner, shared_inner, experts, top_k = SHAPES[0]
    w = make_block(hidden_size, inner, shared_inner, experts, DEVICE, DTYPE)
    views = fused_views(w, experts, shared_inner)
    norm = randn(hidden_size, scale=0.1)
    workspace = moe_workspace(hidden_size, DEVICE)
    hidden = randn(1, hidden_size)

    def blocks(pending, pdl):
        tiles = attrs.evolve(default_tiles(DEVICE), pdl=pdl)
        out, new_hidden, _ = run(hidden, pending, norm, w, views, top_k, workspace, tiles=tiles)
        out2, new_hidden2, _ = run(new_hidden, out, norm, w, views, top_k, workspace, tiles=tiles)
        return out2, new_hidden2

    assert_pdl_graph_matches_plain(blocks, [randn(1, hidden_size) for _ in range(3)])
    assert not workspace.any()


def test_equal_logits_select_the_lower_expert():
    """Three experts with the same router row tie for the top two slots: the lower two are selected."""
    hidden_size, inner, shared_inner, experts, _ = SHAPES[-1]
    w = make_block(hidden_size, inner, shared_inner, experts, DEVICE, DTYPE)
    views = fused_views(w, experts, shared_inner)
    hidden = randn(1, hidden_size)
    for expert in (2, 4, 6):  # a logit far above every other
        views["router"][expert] = w["router"][expert] = hidden[0] * 4
    workspace = moe_workspace(hidden_size, DEVICE)
    out, _, logits = run(hidden, None, None, w, views, 2, workspace)
    assert logits[2] == logits[4] == logits[6] and logits[2] > logits[:experts].topk(4).values[-1]
    weights = torch.full((1, 2), 0.5, device=DEVICE)
    assert rel_err(out, experts_with_routing(hidden, weights, torch.tensor([[2, 4]]), w, shared=True)) < TOL


@triton.jit
def _route_rows(logits_ptr, experts_ptr, weights_ptr, num_experts, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
                BLOCK_E: tl.constexpr, NARROW_KEYS: tl.constexpr):
    row = tl.program_id(0)
    experts, weights, _ = moe_persistent._route(
        logits_ptr + row * (num_experts + 1), num_experts, TOP_K, TOP_K_PAD, BLOCK_E, NARROW_KEYS
    )
    slots = tl.arange(0, TOP_K_PAD)
    tl.store(experts_ptr + row * TOP_K + slots, experts, mask=slots < TOP_K)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=slots < TOP_K)


@pytest.mark.parametrize("narrow_keys", [False, True])
def test_routing_keys_select_the_highest_logits_lower_index_first(narrow_keys):
    """Both key widths of the routing (int32 keys where the logits are bf16-exact) give the torch rule: the highest
    logits, the lower index first among equal ones, softmax over the selection; on rows with many ties, negative
    and zero logits, and fewer experts than the power of two."""
    experts, top_k = 200, 8
    logits = (torch.randn(64, experts + 1) * 4).to(torch.bfloat16).float()
    logits[::2, : experts // 2] = logits[::2, experts // 2 : 2 * (experts // 2)]  # every value twice
    logits[1::4] = logits[1::4].round()  # many equal integers, zeros among them
    logits[3::8] = -logits[3::8].abs()  # only negative logits
    logits = logits.to(DEVICE)
    chosen = torch.empty(64, top_k, dtype=torch.int32, device=DEVICE)
    weights = torch.empty(64, top_k, dtype=torch.float32, device=DEVICE)
    _route_rows[(64,)](logits, chosen, weights, experts, TOP_K=top_k, TOP_K_PAD=top_k, BLOCK_E=256,
                       NARROW_KEYS=narrow_keys)
    expected = torch.sort(logits[:, :experts], dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(chosen.long(), expected)
    selected = logits[:, :experts].gather(1, expected)
    assert rel_err(weights, torch.softmax(selected, dim=-1)) < 1e-5


def test_persistent_moe_rejects_bad_inputs():
    hidden_size, inner, shared_inner, experts, top_k = SHAPES[-1]
    w = make_block(hidden_size, inner, shared_inner, experts, DEVICE, DTYPE)
    views = fused_views(w, experts, shared_inner)
    workspace = moe_workspace(hidden_size, DEVICE)
    hidden = randn(1, hidden_size)
    norm = randn(hidden_size)
    with pytest.raises(ValueError, match="one contiguous row"):
        run(randn(2, hidden_size), None, norm, w, views, top_k, workspace)
    with pytest.raises(ValueError, match="pending needs norm_weight"):
        run(hidden, randn(1, hidden_size), None, w, views, top_k, workspace)
    with pytest.raises(ValueError, match="top_k"):
        run(hidden, None, norm, w, views, experts + 1, workspace)
    with pytest.raises(ValueError, match="norm_weight"):
        run(hidden, None, norm[:-1], w, views, top_k, workspace)
    with pytest.raises(ValueError, match="router"):
        run(hidden, None, norm, w, dict(views, router=w["router"][:, :-1]), top_k, workspace)
    with pytest.raises(ValueError, match="workspace"):
        run(hidden, None, norm, w, views, top_k, torch.zeros(2, device=DEVICE))
    with pytest.raises(NotResidentError if CUDA else ValueError, match="every program" if CUDA else "CUDA device"):
        run(hidden, None, norm, w, views, top_k, workspace, programs=100 * default_programs(DEVICE), one_launch=True)
    assert not workspace.any()
