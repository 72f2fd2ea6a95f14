"""Programmatic dependent launch of the Gated DeltaNet decode kernels (conv update, fused recurrent gated delta).

With PDL a kernel loads its weights, slot ids and recurrent state before ``griddepcontrol.wait`` and only the
predecessor's outputs after it. The GPU tests capture decode-like chains in one CUDA graph (the kernels' inputs
written by the kernel just before: a plain ``torch.add``, or a PDL ``add_norm_gemv`` that lets them start while it
runs) and replay it for several steps, so the states feed back; outputs and states with ``pdl=True`` must equal
those with ``pdl=False`` bit for bit. PDL needs sm_90+: without it the GPU tests are skipped; the argument checks
run wherever Triton imports.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from kernel_support import CUDA, DEVICE

from ninfer.kernels.triton import triton_importable

if not triton_importable():
    pytest.skip("needs Triton", allow_module_level=True)

from ninfer.kernels.triton.conv import causal_conv1d_update  # noqa: E402
from ninfer.kernels.triton.gated_delta import fused_recurrent_gated_delta  # noqa: E402
from ninfer.kernels.triton.norm_gemv import add_norm_gemv, gated_norm_gemv, pdl_supported  # noqa: E402

HOPPER = CUDA and pdl_supported("cuda")
EPS = 1e-6
KEY_HEADS, VALUE_HEADS, HEAD_DIM, CONV_KERNEL, HIDDEN = 16, 32, 128, 4, 2048  # 35B-A3B's linear-attention layers
CONV_DIM = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM
VALUE_DIM = VALUE_HEADS * HEAD_DIM
PROJECTED = CONV_DIM + VALUE_DIM + 2 * VALUE_HEADS  # [qkv | z | b | a], the fused input projection
SLOTS_TOTAL, LAYERS, STEPS = 6, 3, 4

needs_pdl = pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a CUDA device of sm_90+")


@attrs.frozen
class Layer:
    """One linear-attention layer's weights (the chain's predecessor weights included) and its initial caches."""

    conv_weight: torch.Tensor
    decay_rate: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    input_norm: torch.Tensor
    mixer_in: torch.Tensor
    mixer_out: torch.Tensor
    offset: torch.Tensor
    conv_cache: torch.Tensor
    ssm_cache: torch.Tensor


def _layer(rows: int) -> Layer:
    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, device="cuda") * scale).to(dtype)

    return Layer(
        conv_weight=randn(CONV_DIM, CONV_KERNEL, scale=0.5),
        decay_rate=-torch.empty(VALUE_HEADS, device="cuda").uniform_(0.1, 2.0),
        dt_bias=torch.randn(VALUE_HEADS, device="cuda"),
        norm=randn(HEAD_DIM, scale=0.1) + 1,
        input_norm=randn(HIDDEN, scale=0.1),
        mixer_in=randn(PROJECTED, HIDDEN, scale=HIDDEN**-0.5),
        mixer_out=randn(HIDDEN, VALUE_DIM, scale=VALUE_DIM**-0.5),
        offset=randn(rows, PROJECTED, scale=0.5),
        conv_cache=randn(SLOTS_TOTAL, CONV_DIM, CONV_KERNEL - 1),
        ssm_cache=torch.randn(SLOTS_TOTAL, VALUE_HEADS, HEAD_DIM, HEAD_DIM, device="cuda") * 0.1,
    )


def _step(predecessor, layers, caches, slots, step_input, value_split, pdl):
    """One decode step over ``layers``; returns every layer's conv and gated delta outputs (and out projection)."""
    outputs = []
    hidden = step_input
    for index, (layer, (conv_cache, ssm_cache)) in enumerate(zip(layers, caches)):
        if predecessor == "torch.add":  # a plain kernel writes the projection the conv reads
            projected = torch.add(step_input, layer.offset, alpha=index + 1)
        else:  # a PDL kernel writes it: its dependents start while it still runs
            _, projected, _ = add_norm_gemv(hidden, None, layer.input_norm, layer.mixer_in, EPS)
        qkv, z = projected[:, :CONV_DIM], projected[:, CONV_DIM : CONV_DIM + VALUE_DIM]
        b = projected[:, CONV_DIM + VALUE_DIM : CONV_DIM + VALUE_DIM + VALUE_HEADS]
        a = projected[:, CONV_DIM + VALUE_DIM + VALUE_HEADS :]
        mixed = causal_conv1d_update(qkv, layer.conv_weight, conv_cache, slots, pdl=pdl)
        fused_norm = dict(z=z, norm_weight=layer.norm, norm_eps=EPS) if predecessor == "torch.add" else {}
        core, _ = fused_recurrent_gated_delta(
            mixed, a, b, layer.decay_rate, layer.dt_bias, ssm_cache, slots, key_heads=KEY_HEADS,
            value_split=value_split, pdl=pdl, **fused_norm,
        )
        outputs += [mixed, core]
        if predecessor != "torch.add":  # the out projection (a PDL kernel) reads core right after
            hidden = gated_norm_gemv(core, z, layer.norm, layer.mixer_out, EPS)
            outputs.append(hidden)
    return outputs


def _replayed(predecessor, layers, slots, step_inputs, value_split, pdl):
    """Capture one step in a CUDA graph and replay it for every step input; every step's outputs and the caches."""
    caches = [(layer.conv_cache.clone(), layer.ssm_cache.clone()) for layer in layers]
    static_input = step_inputs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside the capture (it updates the caches: restored below)
        _step(predecessor, layers, caches, slots, static_input, value_split, pdl)
    torch.cuda.current_stream().wait_stream(side)
    for (conv_cache, ssm_cache), layer in zip(caches, layers):
        conv_cache.copy_(layer.conv_cache)
        ssm_cache.copy_(layer.ssm_cache)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = _step(predecessor, layers, caches, slots, static_input, value_split, pdl)
    steps = []
    for step_input in step_inputs:
        static_input.copy_(step_input)
        graph.replay()
        steps.append([out.clone() for out in outputs])
    torch.cuda.synchronize()
    return steps, caches


@needs_pdl
@pytest.mark.gpu
@pytest.mark.parametrize("predecessor", ["torch.add", "add_norm_gemv"])
@pytest.mark.parametrize("rows,value_split", [(1, 1), (1, 4), (3, 2)])
def test_pdl_matches_plain_launch_in_a_graph(predecessor, rows, value_split):
    torch.manual_seed(1234)
    layers = [_layer(rows) for _ in range(LAYERS)]
    slots = torch.tensor([4, 1, 3][:rows], device="cuda")
    width = PROJECTED if predecessor == "torch.add" else HIDDEN
    step_inputs = [torch.randn(rows, width, device="cuda").to(torch.bfloat16) for _ in range(STEPS)]
    plain_steps, plain_caches = _replayed(predecessor, layers, slots, step_inputs, value_split, pdl=False)
    pdl_steps, pdl_caches = _replayed(predecessor, layers, slots, step_inputs, value_split, pdl=True)
    for step, (plain, dependent) in enumerate(zip(plain_steps, pdl_steps)):
        for index, (want, got) in enumerate(zip(plain, dependent)):
            assert torch.isfinite(want.float()).all(), (step, index)
            assert torch.equal(got, want), f"step {step}, output {index}"
    assert not torch.equal(plain_steps[0][1], plain_steps[1][1])  # every replay computed its step anew
    untouched = [s for s in range(SLOTS_TOTAL) if s not in slots.tolist()]
    for layer, (plain_conv, plain_ssm), (pdl_conv, pdl_ssm) in zip(layers, plain_caches, pdl_caches):
        assert torch.equal(pdl_conv, plain_conv)
        assert torch.equal(pdl_ssm, plain_ssm)
        assert not torch.equal(plain_ssm[slots], layer.ssm_cache[slots])
        assert torch.equal(pdl_ssm[untouched], layer.ssm_cache[untouched])
        assert torch.equal(pdl_conv[untouched], layer.conv_cache[untouched])


@pytest.mark.skipif(HOPPER, reason="checks the refusal on devices without programmatic dependent launch")
def test_pdl_refused_without_device_support():
    x = torch.zeros(1, 8, device=DEVICE)
    conv_cache = torch.zeros(2, 8, 3, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="pdl=True needs"):
        causal_conv1d_update(x, torch.zeros(8, 4, device=DEVICE), conv_cache, slots, pdl=True)
    qkv, gates = torch.zeros(1, 2 * 16 + 2 * 16, device=DEVICE), torch.zeros(1, 2, device=DEVICE)
    ssm_cache = torch.zeros(2, 2, 16, 16, device=DEVICE)
    with pytest.raises(ValueError, match="pdl=True needs"):
        fused_recurrent_gated_delta(qkv, gates, gates, gates[0], gates[0], ssm_cache, slots, key_heads=1, pdl=True)
