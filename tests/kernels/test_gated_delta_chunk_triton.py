"""The fused Triton chunked gated delta rule (``chunk_gated_delta_rule_fused``) against the pure-torch chunked rule.

Inputs are laid out as the model feeds them: q, k and v are strided views split from one ``[B, T, C]`` conv output,
g and beta fp32 ``[B, T, Hv]``. Lengths straddle the 64-token chunk (1, 63, 64, 65, 200, 1000), two sequences,
grouped value heads (Hv = 3 Hk), zero / absent / non-zero initial states, fp32 inputs (outputs and final state to
1e-4) and bf16 inputs (to 1e-2 against the fp32 rule on the same rounded inputs).

Runs on CUDA with the model's head dim (128). Without a GPU the same checks run in Triton's CPU interpreter when
``TRITON_INTERPRET=1`` (head dim 32, fewer heads); there fp32 -> bf16 conversions truncate instead of rounding to
nearest, which doubles the rounding error, so the bf16 cases get 2e-2.
"""

from __future__ import annotations

import pytest
import torch
from kernel_support import CUDA, DEVICE, rel_err, skip_module_without_triton

from ninfer.kernels.reference.gated_delta import chunk_gated_delta_rule

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.kernels.reference.prefill import prefill_gated_delta_rule  # noqa: E402
from ninfer.kernels.triton.gated_delta_chunk import chunk_gated_delta_rule_fused  # noqa: E402

HEAD_DIM = 128 if CUDA else 32
KEY_HEADS, VALUE_HEADS = (4, 12) if CUDA else (1, 3)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2 if CUDA else 2e-2}


def model_inputs(
    length: int,
    *,
    batch: int = 2,
    key_heads: int = KEY_HEADS,
    value_heads: int = VALUE_HEADS,
    dim: int = HEAD_DIM,
    dtype: torch.dtype = torch.float32,
    initial: str = "random",
    device: torch.device | str = DEVICE,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` as views of one conv output ``[B, T, 2*Hk*D + Hv*D]``, ``g, beta`` fp32, the initial state."""
    generator = torch.Generator().manual_seed(seed)
    conv = torch.randn(batch, length, (2 * key_heads + value_heads) * dim, generator=generator)
    g = -torch.rand(batch, length, value_heads, generator=generator) * 0.5
    beta = torch.rand(batch, length, value_heads, generator=generator)
    state_shape = (batch, value_heads, dim, dim)
    states = {
        "none": None,
        "zeros": torch.zeros(state_shape),
        "random": torch.randn(*state_shape, generator=generator) * 0.5,
    }
    state = states[initial]
    conv = conv.to(device, dtype)
    q, k, v = torch.split(conv, [key_heads * dim, key_heads * dim, value_heads * dim], dim=-1)
    q = q.reshape(batch, length, key_heads, dim)
    k = k.reshape(batch, length, key_heads, dim)
    v = v.reshape(batch, length, value_heads, dim)
    return q, k, v, g.to(device), beta.to(device), None if state is None else state.to(device)


def check_fused_rule(
    length: int, dtype: torch.dtype, initial: str, *, device: torch.device | str = DEVICE, **dims: int
) -> None:
    """Run the fused rule on ``device`` and compare it with ``chunk_gated_delta_rule`` in fp32 on the CPU."""
    q, k, v, g, beta, state = model_inputs(length, dtype=dtype, initial=initial, device=device, seed=length, **dims)
    assert not q.is_contiguous() and q.stride(-1) == 1  # read in place through the views' strides
    before = None if state is None else state.clone()
    out, final = chunk_gated_delta_rule_fused(q, k, v, g, beta, state)
    host = [x.float().cpu() for x in (q, k, v, g, beta)]
    ref_out, ref_final = chunk_gated_delta_rule(*host, None if state is None else state.cpu())
    assert out.shape == v.shape and out.dtype == dtype and out.device == v.device
    assert final.shape == ref_final.shape and final.dtype == torch.float32
    assert rel_err(out, ref_out) < TOLERANCE[dtype]
    assert rel_err(final, ref_final) < TOLERANCE[dtype]
    if state is not None:
        assert torch.equal(state, before)  # the entering state is not modified


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200, 1000])
def test_fp32_inputs_match_the_chunked_rule(length):
    check_fused_rule(length, torch.float32, "random")


@pytest.mark.parametrize("length, initial", [(65, "random"), (200, "none"), (1000, "random")])
def test_bf16_inputs_match_the_chunked_rule(length, initial):
    check_fused_rule(length, torch.bfloat16, initial)


@pytest.mark.parametrize("initial", ["none", "zeros"])
def test_zero_initial_state(initial):
    check_fused_rule(130, torch.float32, initial)


def test_one_key_head_per_value_head_and_unequal_head_dims():
    check_fused_rule(100, torch.float32, "random", key_heads=2, value_heads=2)
    q, k, v, g, beta, state = model_inputs(70, dim=32, seed=7)
    v = torch.randn(*v.shape[:3], 64, device=DEVICE)
    state = torch.randn(*state.shape[:3], 64, device=DEVICE)
    out, final = chunk_gated_delta_rule_fused(q, k, v, g, beta, state)
    ref_out, ref_final = chunk_gated_delta_rule(*(x.cpu() for x in (q, k, v, g, beta, state)))
    assert rel_err(out, ref_out) < 1e-4 and rel_err(final, ref_final) < 1e-4


def test_empty_sequence_returns_the_initial_state():
    q, k, v, g, beta, state = model_inputs(0)
    out, final = chunk_gated_delta_rule_fused(q, k, v, g, beta, state)
    assert out.shape == (2, 0, VALUE_HEADS, HEAD_DIM)
    assert torch.equal(final, state) and final.data_ptr() != state.data_ptr()


def test_rejects_shapes_it_cannot_run():
    q, k, v, g, beta, state = model_inputs(10, key_heads=2, value_heads=6, dim=32)
    with pytest.raises(ValueError, match="multiple of key heads"):
        chunk_gated_delta_rule_fused(q, k, v[:, :, :5], g[:, :, :5], beta[:, :, :5], None)
    with pytest.raises(ValueError, match="beta"):
        chunk_gated_delta_rule_fused(q, k, v, g, beta[:, :5], state)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule_fused(q, k, v, g, beta, state[:1])
    with pytest.raises(ValueError, match="power-of-two head dims"):
        chunk_gated_delta_rule_fused(q[..., :24], k[..., :24], v, g, beta, None)


@pytest.mark.skipif(not CUDA, reason="the prefill entry uses the fused kernels on CUDA only")
def test_cuda_prefill_entry_runs_the_fused_kernels():
    inputs = model_inputs(300, dtype=torch.bfloat16)
    out, final = prefill_gated_delta_rule(*inputs)
    fused_out, fused_final = chunk_gated_delta_rule_fused(*inputs)
    assert torch.equal(out, fused_out) and torch.equal(final, fused_final)
