"""The two-launch decode MoE kernel (``fused_moe_decode``) against its pure-torch twin ``moe_forward``.

Runs on CUDA in bf16 with the real Qwen3.6-35B-A3B expert shapes (top-8 of 256, shared expert); without a GPU it runs
in Triton's CPU interpreter when ``TRITON_INTERPRET=1`` (toy shapes, fp32), otherwise it is skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ninfer.kernels.moe import moe_forward
from ninfer.kernels.triton import triton_available

pytestmark = pytest.mark.gpu

CUDA = torch.cuda.is_available()
if not triton_available("cuda" if CUDA else "cpu"):
    pytest.skip("needs Triton on a CUDA device (or TRITON_INTERPRET=1)", allow_module_level=True)

from ninfer.kernels.triton.moe_fused import fused_moe_decode  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
TOL = 1e-2 if DTYPE == torch.bfloat16 else 1e-5
# (hidden, inner, shared inner, experts, top_k): the 35B-A3B shape, and one whose sizes are not powers of two
SHAPES = [(2048, 512, 512, 256, 8), (1000, 200, 136, 256, 8)] if CUDA else [(40, 12, 20, 16, 4)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(DTYPE)


def make_block(hidden: int, inner: int, shared_inner: int, experts: int) -> dict[str, torch.Tensor]:
    return {
        "router": randn(experts, hidden, scale=0.5),
        "gate_up": randn(experts, 2 * inner, hidden, scale=0.05),
        "down": randn(experts, hidden, inner, scale=0.05),
        "shared_gate": randn(shared_inner, hidden, scale=0.05),
        "shared_up": randn(shared_inner, hidden, scale=0.05),
        "shared_down": randn(hidden, shared_inner, scale=0.05),
        "shared_expert_gate": randn(1, hidden, scale=0.05),
    }


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 5, 8])
def test_fused_moe_decode_matches_moe_forward(shape, tokens):
    hidden, inner, shared_inner, experts, top_k = shape
    w = make_block(hidden, inner, shared_inner, experts)
    x = randn(tokens, hidden)
    ref = moe_forward(
        x, w["router"], w["gate_up"], w["down"], top_k, shared_gate=w["shared_gate"], shared_up=w["shared_up"],
        shared_down=w["shared_down"], shared_expert_gate=w["shared_expert_gate"],
    )
    # the decode path's entry GEMM: [router | shared gate | shared up | shared expert gate], sliced as views
    entry = F.linear(x, torch.cat([w["router"], w["shared_gate"], w["shared_up"], w["shared_expert_gate"]]))
    out = fused_moe_decode(
        x, entry[:, :experts], w["gate_up"], w["down"], top_k,
        shared_gate_up=entry[:, experts : experts + 2 * shared_inner], shared_down=w["shared_down"],
        shared_gate_logit=entry[:, experts + 2 * shared_inner :],
    )
    assert out.shape == (tokens, hidden) and out.dtype == x.dtype
    assert rel_err(out, ref) < TOL


def test_fused_moe_decode_without_shared_expert():
    hidden, inner, _, experts, top_k = SHAPES[-1]
    w = make_block(hidden, inner, 1, experts)
    x = randn(3, hidden)
    ref = moe_forward(x, w["router"], w["gate_up"], w["down"], top_k)
    out = fused_moe_decode(x, F.linear(x, w["router"]), w["gate_up"], w["down"], top_k)
    assert rel_err(out, ref) < TOL


def test_fused_moe_decode_rejects_bad_shapes():
    hidden, inner, _, experts, top_k = SHAPES[-1]
    w = make_block(hidden, inner, 1, experts)
    x = randn(2, hidden)
    logits = F.linear(x, w["router"])
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_decode(x, logits, w["gate_up"], w["down"], experts + 1)
    with pytest.raises(ValueError, match="router_logits"):
        fused_moe_decode(x, logits[:, :-1], w["gate_up"], w["down"], top_k)
    with pytest.raises(ValueError, match="shared expert needs"):
        fused_moe_decode(x, logits, w["gate_up"], w["down"], top_k, shared_gate_up=randn(2, 2))
