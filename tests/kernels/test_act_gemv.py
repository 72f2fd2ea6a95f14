"""``act_gemv`` (decode GEMV, optionally through SwiGLU's SiLU·mul) against its pure-torch twin.

Runs on CUDA (bf16, the 27B dense down projection, the 35B-A3B attention output projection and an odd shape; PDL
launches in a CUDA graph); without a GPU in Triton's CPU interpreter when ``TRITON_INTERPRET=1`` (fp32, toy shapes),
otherwise it is skipped. Twin: ``F.silu(gate) * up`` then ``F.linear``.
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

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.kernels.triton.act_gemv import act_gemv, default_act_tiles  # noqa: E402

TOL = 1e-2 if CUDA else 1e-5
# (K, out rows): 27B dense down, 35B-A3B attention out, an odd one; the interpreter: toy shapes
SHAPES = [(17408, 5120), (4096, 2048), (1000, 333)] if CUDA else [(40, 37), (200, 64)]


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(DTYPE)


_seed = seed_each_test(7)


@pytest.mark.parametrize("width, out_rows", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("block_k", [None, 16])  # the default steps, and many short ones (a tail step too)
def test_silu_mul_gemv_matches_the_twin(width, out_rows, tokens, block_k):
    gate_up, weight = randn(tokens, 2 * width), randn(out_rows, width, scale=0.05)
    activated = (F.silu(gate_up[:, :width].float()) * gate_up[:, width:].float()).to(DTYPE)
    tiles = attrs.evolve(default_act_tiles(tokens, DEVICE), block_k=block_k) if block_k else None
    out = act_gemv(gate_up, weight, silu_mul=True, tiles=tiles)
    assert out.shape == (tokens, out_rows) and out.dtype == DTYPE
    assert rel_err(out, F.linear(activated.float(), weight.float())) < TOL


@pytest.mark.parametrize("width, out_rows", SHAPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_plain_gemv_of_a_strided_input_matches_the_twin(width, out_rows, tokens):
    wide = randn(tokens, width + 8)
    x = wide[:, 3 : 3 + width]  # rows with a stride: a column slice of a wider projection
    weight = randn(out_rows, width, scale=0.05)
    assert rel_err(act_gemv(x, weight), F.linear(x.float(), weight.float())) < TOL


def test_bad_inputs_are_refused_by_name():
    weight = randn(8, 16)
    with pytest.raises(ValueError, match="x must be"):
        act_gemv(randn(2, 16).t(), weight)
    with pytest.raises(ValueError, match="weight must be"):
        act_gemv(randn(2, 32), weight, silu_mul=False)
    with pytest.raises(ValueError, match="even width"):
        act_gemv(randn(2, 33), weight, silu_mul=True)
    with pytest.raises(ValueError, match="rows"):
        act_gemv(randn(65, 16), weight)


@needs_gpu_pdl
@pytest.mark.parametrize("tokens", [1, 8])
def test_programmatic_dependent_launch_in_a_graph_matches_plain_launches(tokens):
    """Down projection after its gate/up GEMM (a cuBLAS kernel writes the input), then a plain GEMV of the result."""
    width, out_rows = SHAPES[0]
    entry, down, back = randn(2 * width, out_rows, scale=0.02), randn(out_rows, width, scale=0.02), randn(64, out_rows)
    xs = [randn(tokens, out_rows) for _ in range(3)]

    def chain(x, pdl):
        tiles = attrs.evolve(default_act_tiles(tokens, DEVICE), pdl=pdl)
        y = act_gemv(F.linear(x, entry), down, silu_mul=True, tiles=tiles)
        return act_gemv(y, back, tiles=tiles)

    assert_pdl_graph_matches_plain(chain, xs)
