"""The Triton prefill kernels against their torch twins: the chunk-to-chunk state pass of the chunked gated delta
rule, and the whole CUDA prefill rule (which uses it) against the token-by-token recurrent rule (fp32 state to 1e-4,
bf16 outputs to 1e-2, lengths that are not multiples of the 64-token chunk, a non-zero initial state, grouped value
heads); the chunk causal conv against the reference conv (chunks shorter and longer than the window, a non-zero
window, channel counts that are not multiples of the block).

Runs on CUDA; without a GPU the kernel-level test runs in Triton's CPU interpreter when ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import pytest
import torch
from kernel_support import CUDA, DEVICE, DTYPE, rel_err, skip_module_without_triton

from ninfer.kernels.reference.conv import causal_conv1d
from ninfer.kernels.reference.gated_delta import recurrent_gated_delta_rule
from ninfer.kernels.reference.prefill import batched_chunk_gated_delta_rule, chunk_state_pass_torch

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.kernels.triton.chunk_state import chunk_state_pass  # noqa: E402
from ninfer.kernels.triton.conv import causal_conv1d_prefill  # noqa: E402


@pytest.mark.parametrize("chunks, key_dim, value_dim", [(1, 16, 16), (5, 32, 64)])
def test_state_pass_matches_torch_twin(chunks, key_dim, value_dim):
    torch.manual_seed(chunks)
    sequences, size = 3, 16
    decayed_q = torch.randn(chunks, sequences, size, key_dim, device=DEVICE)
    solved_k = torch.randn(chunks, sequences, size, key_dim, device=DEVICE) * 0.1
    base = torch.randn(chunks, sequences, size, value_dim, device=DEVICE)
    decayed_k_t = torch.randn(chunks, sequences, key_dim, size, device=DEVICE) * 0.1
    chunk_decay = torch.rand(chunks, sequences, device=DEVICE)
    state = torch.randn(sequences, key_dim, value_dim, device=DEVICE)
    before = state.clone()
    got = chunk_state_pass(decayed_q, solved_k, base, decayed_k_t, chunk_decay, state)
    expected = chunk_state_pass_torch(decayed_q, solved_k, base, decayed_k_t, chunk_decay, state)
    for name, ours, theirs in zip(("out", "corrections", "state"), got, expected):
        assert ours.shape == theirs.shape, name
        assert rel_err(ours, theirs) < 1e-4, name
    assert torch.equal(state, before)  # the entering state is not modified


def test_state_pass_rejects_sizes_it_cannot_tile():
    x = torch.zeros(1, 1, 16, 24, device=DEVICE)
    with pytest.raises(ValueError, match="key dim"):
        chunk_state_pass(x, x, torch.zeros(1, 1, 16, 16, device=DEVICE), torch.zeros(1, 1, 24, 16, device=DEVICE),
                         torch.zeros(1, 1, device=DEVICE), torch.zeros(1, 24, 16, device=DEVICE))


def _inputs(length: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    batch, key_heads, value_heads, dk, dv = 2, 2, 4, 128, 128

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    q, k = randn(batch, length, key_heads, dk), randn(batch, length, key_heads, dk)
    v = randn(batch, length, value_heads, dv)
    g = -torch.rand(batch, length, value_heads, generator=generator) * 0.5
    beta = torch.rand(batch, length, value_heads, generator=generator)
    initial = randn(batch, value_heads, dk, dv) * 0.5
    on_device = [t.to(DEVICE, dtype) for t in (q, k, v)] + [t.to(DEVICE) for t in (g, beta, initial)]
    return on_device, (q, k, v, g, beta, initial)


@pytest.mark.skipif(not CUDA, reason="the CUDA prefill path (64-token chunks) needs a GPU")
@pytest.mark.parametrize("length", [1, 64, 100, 333])
def test_cuda_chunked_rule_matches_recurrent_fp32(length):
    device_inputs, host_inputs = _inputs(length, torch.float32, length)
    out, final = batched_chunk_gated_delta_rule(*device_inputs)
    ref_out, ref_final, _ = recurrent_gated_delta_rule(*host_inputs)
    assert rel_err(out.cpu(), ref_out) < 1e-4
    assert rel_err(final.cpu(), ref_final) < 1e-4


@pytest.mark.skipif(not CUDA, reason="the CUDA prefill path (64-token chunks) needs a GPU")
@pytest.mark.parametrize("length", [77, 200])
def test_cuda_chunked_rule_in_bf16(length):
    device_inputs, host_inputs = _inputs(length, torch.bfloat16, 1000 + length)
    out, final = batched_chunk_gated_delta_rule(*device_inputs)
    q, k, v, g, beta, initial = host_inputs
    rounded = [t.to(torch.bfloat16).float() for t in (q, k, v)]
    ref_out, ref_final, _ = recurrent_gated_delta_rule(*rounded, g, beta, initial)
    assert out.dtype == torch.bfloat16
    assert rel_err(out.cpu(), ref_out) < 1e-2
    assert rel_err(final.cpu(), ref_final) < 1e-4


@pytest.mark.parametrize("length", [1, 2, 37, 100])
def test_prefill_conv_matches_reference(length):
    torch.manual_seed(length)
    batch, channels, kernel = 2, 200, 4
    x = torch.randn(batch, length, channels, device=DEVICE).to(DTYPE)
    weight = torch.randn(channels, kernel, device=DEVICE).to(DTYPE)
    window = torch.randn(batch, channels, kernel - 1, device=DEVICE).to(DTYPE)
    before = window.clone()
    y, new_window = causal_conv1d_prefill(x, weight, window)
    ref_y, ref_window, _ = causal_conv1d(x.float().cpu(), weight.float().cpu(), window.float().cpu())
    assert y.dtype == DTYPE and new_window.dtype == DTYPE
    assert rel_err(y.cpu(), ref_y) < (1e-2 if CUDA else 1e-5)
    assert torch.equal(new_window.float().cpu(), ref_window)  # the window holds inputs, copied exactly
    assert torch.equal(window, before)
