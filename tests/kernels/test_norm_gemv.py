"""The norm-fused decode GEMVs (``norm_gemv``) and the add+norm router (``moe_grouped``) against their pure-torch twins.

Runs on CUDA (bf16, the 35B-A3B and 27B per-layer shapes and an odd one; PDL launches in a CUDA graph); without a
GPU it runs in Triton's CPU interpreter when ``TRITON_INTERPRET=1`` (fp32, toy shapes), otherwise it is skipped.
Twins: ``rms_norm`` (zero-centered) / ``gated_rms_norm`` of ``ninfer.kernels.reference.norms`` followed by ``F.linear``; the
router with its own add+norm against ``route_experts`` of the twin's normed rows.
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

from ninfer.kernels.reference.conv import causal_conv1d
from ninfer.kernels.reference.norms import gated_rms_norm, rms_norm

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.kernels.triton.moe_grouped import (  # noqa: E402
    grouped_moe_decode,
    grouped_moe_decode_add_norm,
    moe_workspace,
    route_experts,
    route_experts_add_norm,
)
from ninfer.kernels.triton.norm_gemv import (  # noqa: E402
    ArgmaxEpilogue,
    ConvEpilogue,
    GemvTiles,
    add_norm_gemv,
    default_gated_tiles,
    default_tiles,
    gated_norm_gemv,
    greedy_ids_from_keys,
)

TOL = 1e-2 if CUDA else 1e-5
EPS = 1e-6
# (hidden, out rows): 35B-A3B GDN in (qkvzba), attention in (q+gate, k, v), MoE entry (router, shared gate/up,
# shared gate); 27B GDN in and dense gate/up; an odd shape. The interpreter: toy shapes, one not a power of two.
ADD_NORM_SHAPES = (
    [(2048, 12352), (2048, 9216), (2048, 1281), (5120, 16480), (5120, 34816), (1000, 333)]
    if CUDA else [(40, 37), (64, 200)]
)
# (value heads, head dim, out rows): 35B-A3B and 27B GDN out projections, an odd one
GATED_SHAPES = [(32, 128, 2048), (48, 128, 5120), (5, 64, 300)] if CUDA else [(4, 16, 64), (5, 8, 37)]
# the router block (hidden, experts, top_k, shared inner, inner): 35B-A3B, then toy
MOE_SHAPE = (2048, 256, 8, 512, 512) if CUDA else (40, 16, 4, 12, 12)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(DTYPE)


_seed = seed_each_test(4321)


def add_norm_twin(hidden, pending, norm_weight, weight):
    new_hidden = hidden if pending is None else pending + hidden
    normed = rms_norm(new_hidden, norm_weight, EPS, zero_centered=True)
    return new_hidden, normed, F.linear(normed, weight)


@pytest.mark.parametrize("shape", ADD_NORM_SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_add_norm_gemv_matches_twin(shape, tokens):
    width, out_rows = shape
    hidden, pending = randn(tokens, width), randn(tokens, width)
    norm_weight, weight = randn(width, scale=0.3), randn(out_rows, width, scale=0.05)
    new_hidden, projected, normed = add_norm_gemv(hidden, pending, norm_weight, weight, EPS, keep_normed=True)
    ref_hidden, ref_normed, ref_projected = add_norm_twin(hidden, pending, norm_weight, weight)
    assert torch.equal(new_hidden, ref_hidden)  # one fp32 add, rounded once: exact
    assert rel_err(normed, ref_normed) < TOL
    assert projected.shape == (tokens, out_rows) and projected.dtype == DTYPE
    assert rel_err(projected, ref_projected) < TOL


@pytest.mark.parametrize("tokens", [1, 3])
def test_add_norm_gemv_stores_fp32_projections_with_the_activation_values(tokens):
    """``out_dtype=float32`` (the lm_head's logits): the same values as the activation-dtype projection, widened."""
    width, out_rows = ADD_NORM_SHAPES[-1]
    hidden, pending = randn(tokens, width), randn(tokens, width)
    norm_weight, weight = randn(width, scale=0.3), randn(out_rows, width, scale=0.05)
    _, projected, _ = add_norm_gemv(hidden, pending, norm_weight, weight, EPS)
    _, widened, _ = add_norm_gemv(hidden, pending, norm_weight, weight, EPS, out_dtype=torch.float32)
    assert widened.dtype == torch.float32 and torch.equal(widened, projected.float())


@pytest.mark.parametrize("tokens", [1, 3])
def test_add_norm_gemv_argmax_epilogue_finds_each_token_s_first_largest_column_below_the_limit(tokens):
    """The merged keys name ``torch.argmax`` of the projection's first ``limit`` columns (equal maxima: the first;
    rows 5 and 9 of the weight are the same row); ``greedy_ids_from_keys`` stores them and resets the keys; a limit
    of 0 leaves the keys as they are and an address of 0 stores nothing."""
    width, out_rows = ADD_NORM_SHAPES[-1]
    hidden, pending = randn(tokens, width), randn(tokens, width)
    norm_weight, weight = randn(width, scale=0.3), randn(out_rows, width, scale=0.05)
    weight[9] = weight[5]
    hidden[0] = weight[5] * 40  # token 0's largest column is row 5 (and 9)
    _, expected, _ = add_norm_gemv(hidden, pending, norm_weight, weight, EPS, out_dtype=torch.float32)
    keys = torch.full((tokens,), -(2**63), dtype=torch.int64, device=DEVICE)
    ids = torch.full((tokens,), -1, dtype=torch.int64, device=DEVICE)
    address = torch.tensor([ids.data_ptr()], device=DEVICE)
    for limit in (out_rows, out_rows - 3, 7):
        argmax = ArgmaxEpilogue(keys, torch.tensor([limit], device=DEVICE))
        _, logits, _ = add_norm_gemv(hidden, pending, norm_weight, weight, EPS, out_dtype=torch.float32, argmax=argmax)
        assert torch.equal(logits, expected)
        greedy_ids_from_keys(keys, address)
        assert ids.tolist() == expected[:, :limit].argmax(dim=1).tolist(), limit
        assert (keys == -(2**63)).all()
    assert ids[0] == 5
    nothing = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    add_norm_gemv(hidden, pending, norm_weight, weight, EPS, argmax=ArgmaxEpilogue(keys, nothing))
    assert (keys == -(2**63)).all()
    ids.fill_(-1)
    add_norm_gemv(hidden, pending, norm_weight, weight, EPS, argmax=ArgmaxEpilogue(keys, nothing + 7))
    greedy_ids_from_keys(keys, nothing)
    assert (ids == -1).all() and (keys == -(2**63)).all()
    with pytest.raises(ValueError, match="argmax"):
        add_norm_gemv(hidden, pending, norm_weight, weight, EPS, argmax=ArgmaxEpilogue(keys[:1].int(), keys[:1]))


@pytest.mark.parametrize("tokens", [1, 3])
def test_add_norm_gemv_stores_through_a_staged_address_into_each_call_s_own_tensor(tokens):
    """``out_address`` (the decode step's logits): the kernel stores the projection at the address the tensor holds
    when it runs, so a captured launch replayed with another address fills another tensor."""
    width, out_rows = ADD_NORM_SHAPES[-1]
    hidden, pending = randn(tokens, width), randn(tokens, width)
    norm_weight, weight = randn(width, scale=0.3), randn(out_rows, width, scale=0.05)
    _, expected, _ = add_norm_gemv(hidden, pending, norm_weight, weight, EPS, out_dtype=torch.float32)
    targets = [torch.full((tokens, out_rows), -7.0, device=DEVICE) for _ in range(2)]
    address = torch.tensor([targets[0].data_ptr()], device=DEVICE)
    new_hidden, projected, _ = add_norm_gemv(
        hidden, pending, norm_weight, weight, EPS, out_dtype=torch.float32, out_address=address
    )
    assert projected is None and torch.equal(targets[0], expected) and torch.equal(new_hidden, hidden + pending)
    assert (targets[1] == -7.0).all()
    if CUDA:  # one capture, two replays: each writes the tensor staged for it, the other stays as it was
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            add_norm_gemv(hidden, pending, norm_weight, weight, EPS, out_dtype=torch.float32, out_address=address)
        for target, other in (targets[1], targets[0]), (targets[0], targets[1]):
            other.fill_(-7.0)
            address.fill_(target.data_ptr())
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(target, expected) and (other == -7.0).all()
    with pytest.raises(ValueError, match="out_address"):
        add_norm_gemv(hidden, pending, norm_weight, weight, EPS, out_address=address.to(torch.int32))


# (hidden, out rows, conv channels): the 35B-A3B GDN entry (q|k|v conv channels, then z, b, a); toy ones
CONV_SHAPES = [(2048, 12352, 8192), (1000, 333, 200)] if CUDA else [(40, 37, 20), (64, 200, 64)]


@pytest.mark.parametrize("shape", CONV_SHAPES)
@pytest.mark.parametrize("tokens", [1, 3])
def test_add_norm_gemv_with_the_conv_epilogue_matches_projection_then_conv(shape, tokens):
    """The first C projected columns come back as silu(conv) over each row's window (slots out of order), the
    windows shift in place, a masked slot (-1 - s) reads its window and leaves it as it was; other columns and
    slots are untouched. Oracle: the twin's projection, then the torch causal conv over [window | new column]."""
    width, out_rows, channels = shape
    taps = 4
    hidden, pending = randn(tokens, width), randn(tokens, width)
    norm_weight, weight = randn(width, scale=0.3), randn(out_rows, width, scale=0.05)
    conv_weight = randn(channels, taps, scale=0.5)
    cache = randn(tokens + 2, channels, taps - 1)
    slots = torch.arange(tokens + 1, 1, -1, device=DEVICE)  # rows use slots t+2 .. 2: out of order, 0 and 1 unused
    if tokens > 1:
        slots[1] = -1 - slots[1]  # row 1 is masked: it reads its window and leaves it
    before = cache.clone()
    new_hidden, projected, _ = add_norm_gemv(
        hidden, pending, norm_weight, weight, EPS, conv=ConvEpilogue(conv_weight, cache, slots)
    )
    _, _, ref_projected = add_norm_twin(hidden, pending, norm_weight, weight)
    read = torch.where(slots >= 0, slots, -1 - slots)
    ref_conv, ref_windows, _ = causal_conv1d(ref_projected[:, None, :channels], conv_weight, before[read])
    assert rel_err(projected[:, :channels], ref_conv[:, 0]) < TOL
    assert rel_err(projected[:, channels:], ref_projected[:, channels:]) < TOL
    written = slots >= 0
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[read[written]] = False
    assert torch.equal(cache[untouched], before[untouched])  # unused and masked slots
    shifted = cache[read[written]]
    assert torch.equal(shifted[:, :, :-1], before[read[written]][:, :, 1:])
    assert rel_err(shifted[:, :, -1], ref_windows[written][:, :, -1]) < TOL  # the new column as the kernel rounded it


def test_the_conv_epilogue_matches_the_conv_kernel_bit_for_bit():
    """Projection + conv epilogue in one launch equals the projection followed by ``causal_conv1d_update``."""
    from ninfer.kernels.triton.conv import causal_conv1d_update

    width, out_rows, channels = CONV_SHAPES[0]
    tokens = 2
    hidden, norm_weight = randn(tokens, width), randn(width, scale=0.3)
    weight, conv_weight = randn(out_rows, width, scale=0.05), randn(channels, 4, scale=0.5)
    cache = randn(3, channels, 3)
    slots = torch.tensor([2, 0], device=DEVICE)
    fused_cache, separate_cache = cache.clone(), cache.clone()
    conv = ConvEpilogue(conv_weight, fused_cache, slots)
    _, fused, _ = add_norm_gemv(hidden, None, norm_weight, weight, EPS, conv=conv)
    _, projected, _ = add_norm_gemv(hidden, None, norm_weight, weight, EPS)
    mixed = causal_conv1d_update(projected[:, :channels], conv_weight, separate_cache, slots)
    assert torch.equal(fused[:, :channels], mixed)
    assert torch.equal(fused[:, channels:], projected[:, channels:])
    assert torch.equal(fused_cache, separate_cache)


@pytest.mark.parametrize("tokens", [1, 5])
def test_add_norm_gemv_without_pending_reads_hidden_as_is(tokens):
    width, out_rows = ADD_NORM_SHAPES[-1]
    hidden, norm_weight, weight = randn(tokens, width), randn(width, scale=0.3), randn(out_rows, width, scale=0.05)
    new_hidden, projected, normed = add_norm_gemv(hidden, None, norm_weight, weight, EPS)
    assert new_hidden is hidden and normed is None
    assert rel_err(projected, add_norm_twin(hidden, None, norm_weight, weight)[2]) < TOL


@pytest.mark.parametrize(
    ("tokens", "tiles"),
    [
        (1, GemvTiles(rows=2, block_k=16, warps=1)),  # several column steps, the last one partial (FMA)
        (1, GemvTiles(rows=8, block_k=4096, warps=4)),  # one step over the whole row
        (4, GemvTiles(rows=16, block_k=32, warps=4)),  # tl.dot over several steps
    ],
)
def test_add_norm_gemv_tile_variants_agree(tokens, tiles):
    width, out_rows = ADD_NORM_SHAPES[0]
    hidden, pending = randn(tokens, width), randn(tokens, width)
    norm_weight, weight = randn(width, scale=0.3), randn(out_rows, width, scale=0.05)
    new_hidden, projected, _ = add_norm_gemv(hidden, pending, norm_weight, weight, EPS, tiles=tiles)
    ref_hidden, _, ref_projected = add_norm_twin(hidden, pending, norm_weight, weight)
    assert torch.equal(new_hidden, ref_hidden)
    assert rel_err(projected, ref_projected) < TOL


def test_add_norm_gemv_reads_strided_rows():
    """``hidden`` and ``pending`` may be row slices of wider buffers."""
    width, out_rows = ADD_NORM_SHAPES[0]
    hidden, pending = randn(3, width + 8)[:, 8:], randn(3, width + 24)[:, :width]
    norm_weight, weight = randn(width, scale=0.3), randn(out_rows, width, scale=0.05)
    new_hidden, projected, _ = add_norm_gemv(hidden, pending, norm_weight, weight, EPS)
    ref_hidden, _, ref_projected = add_norm_twin(hidden, pending, norm_weight, weight)
    assert torch.equal(new_hidden, ref_hidden)
    assert rel_err(projected, ref_projected) < TOL


def gated_twin(core, z, norm_weight, weight):
    tokens, heads, dim = core.shape
    gated = gated_rms_norm(core, z.view(tokens, heads, dim), norm_weight, EPS)
    return F.linear(gated.reshape(tokens, heads * dim), weight)


@pytest.mark.parametrize("shape", GATED_SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_gated_norm_gemv_matches_twin(shape, tokens):
    heads, dim, out_rows = shape
    core = randn(tokens, heads, dim)
    z = randn(tokens, 3 * heads * dim)[:, heads * dim : 2 * heads * dim]  # a column slice, like the fused projection
    norm_weight, weight = randn(dim, scale=0.5) + 1, randn(out_rows, heads * dim, scale=0.05)
    out = gated_norm_gemv(core, z, norm_weight, weight, EPS)
    assert out.shape == (tokens, out_rows) and out.dtype == DTYPE
    assert rel_err(out, gated_twin(core, z, norm_weight, weight)) < TOL


@pytest.mark.parametrize(
    ("tokens", "tiles"),
    [
        (1, GemvTiles(rows=2, block_k=1, warps=1)),  # one head per step
        (1, GemvTiles(rows=4, block_k=1 << 16, warps=4)),  # every head in one step
        (2, GemvTiles(rows=16, block_k=1, warps=4)),  # tl.dot, one head per step
    ],
)
def test_gated_norm_gemv_tile_variants_agree(tokens, tiles):
    heads, dim, out_rows = GATED_SHAPES[-1]
    core, z = randn(tokens, heads, dim), randn(tokens, heads * dim)
    norm_weight, weight = randn(dim, scale=0.5) + 1, randn(out_rows, heads * dim, scale=0.05)
    out = gated_norm_gemv(core, z, norm_weight, weight, EPS, tiles=tiles)
    assert rel_err(out, gated_twin(core, z, norm_weight, weight)) < TOL


def moe_block():
    hidden, experts, top_k, shared_inner, inner = MOE_SHAPE
    fused = randn(experts + 2 * shared_inner + 1, hidden, scale=0.5)  # [router | shared gate | shared up | gate]
    return dict(
        router=fused[:experts], gate_up=randn(experts, 2 * inner, hidden, scale=0.05),
        down=randn(experts, hidden, inner, scale=0.05), top_k=top_k,
        shared_gate_up=fused[experts : experts + 2 * shared_inner], shared_down=randn(hidden, shared_inner, scale=0.05),
        shared_expert_gate=fused[experts + 2 * shared_inner :],
    )


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_router_with_add_norm_routes_the_normed_rows(tokens):
    """The router's own add+norm writes the twin's rows and routes exactly as ``route_experts`` of its normed rows;
    the whole block matches ``grouped_moe_decode`` of them."""
    block = moe_block()
    width = MOE_SHAPE[0]
    hidden, pending, norm_weight = randn(tokens, width), randn(tokens, width), randn(width, scale=0.3)
    workspace = moe_workspace(width, DEVICE)
    routing, new_hidden, normed = route_experts_add_norm(
        hidden, pending, norm_weight, EPS, block["router"], block["top_k"],
        shared_expert_gate=block["shared_expert_gate"], workspace=workspace,
    )
    ref_hidden, ref_normed, _ = add_norm_twin(hidden, pending, norm_weight, block["router"])
    assert torch.equal(new_hidden, ref_hidden)
    assert rel_err(normed, ref_normed) < TOL
    expected = route_experts(
        normed, block["router"], block["top_k"], shared_expert_gate=block["shared_expert_gate"], workspace=workspace
    )
    # the same products over the same normed values; only the kernels' summation layouts may differ
    assert torch.allclose(routing.logits, expected.logits, rtol=1e-6, atol=1e-6)
    assert torch.allclose(routing.weights, expected.weights, rtol=1e-5, atol=1e-7)
    assert torch.equal(routing.experts, expected.experts)
    assert torch.equal(routing.active[: int(routing.count)], expected.active[: int(expected.count)])
    out, block_hidden = grouped_moe_decode_add_norm(hidden, pending, norm_weight, EPS, workspace=workspace, **block)
    assert torch.equal(block_hidden, ref_hidden)
    assert rel_err(out, grouped_moe_decode(normed, workspace=workspace, **block)) < TOL
    assert not workspace.any()


def test_router_with_norm_only_leaves_hidden_as_is():
    block = moe_block()
    hidden, norm_weight = randn(2, MOE_SHAPE[0]), randn(MOE_SHAPE[0], scale=0.3)
    routing, new_hidden, normed = route_experts_add_norm(hidden, None, norm_weight, EPS, block["router"], 2)
    assert new_hidden is hidden
    assert rel_err(normed, rms_norm(hidden, norm_weight, EPS, zero_centered=True)) < TOL
    assert torch.equal(routing.experts, route_experts(normed, block["router"], 2).experts)


@needs_gpu_pdl
@pytest.mark.parametrize("tokens", [1, 8])
def test_programmatic_dependent_launch_in_a_graph_matches_plain_launches(tokens):
    """A chain of the fused GEMVs launched with PDL and captured in a CUDA graph gives the plain launches' result."""
    width, out_rows = ADD_NORM_SHAPES[0]
    heads, dim, _ = GATED_SHAPES[0]
    weight, norm_weight = randn(out_rows, width, scale=0.05), randn(width, scale=0.3)
    gated_norm, out_weight = randn(dim, scale=0.5) + 1, randn(width, heads * dim, scale=0.05)
    starts = [(randn(tokens, width), randn(tokens, width)) for _ in range(3)]

    def chain(hidden, pending, pdl):
        tiles = attrs.evolve(default_tiles(tokens, DEVICE), pdl=pdl)
        gated_tiles = attrs.evolve(default_gated_tiles(tokens, DEVICE), pdl=pdl)
        hidden, projected, _ = add_norm_gemv(hidden, pending, norm_weight, weight, EPS, tiles=tiles)
        core, z = projected[:, : heads * dim].view(tokens, heads, dim), projected[:, heads * dim : 2 * heads * dim]
        pending = gated_norm_gemv(core, z, gated_norm, out_weight, EPS, tiles=gated_tiles)
        return add_norm_gemv(hidden, pending, norm_weight, weight, EPS, tiles=tiles)[:2]

    assert_pdl_graph_matches_plain(lambda start, pdl: chain(*start, pdl), starts)


def test_fused_gemvs_reject_bad_inputs():
    width, out_rows = ADD_NORM_SHAPES[-1]
    hidden, norm_weight, weight = randn(2, width), randn(width), randn(out_rows, width)
    with pytest.raises(ValueError, match="pending"):
        add_norm_gemv(hidden, randn(3, width), norm_weight, weight, EPS)
    with pytest.raises(ValueError, match="weight must be"):
        add_norm_gemv(hidden, None, norm_weight, weight[:, :-1], EPS)
    with pytest.raises(ValueError, match="norm_weight"):
        add_norm_gemv(hidden, None, norm_weight[:-1], weight, EPS)
    with pytest.raises(ValueError, match="1..64 rows"):
        add_norm_gemv(randn(65, width), None, norm_weight, weight, EPS)
    with pytest.raises(ValueError, match="16 weight rows"):
        add_norm_gemv(hidden, None, norm_weight, weight, EPS, tiles=GemvTiles(rows=4))
    conv_weight, cache, slots = randn(out_rows // 2, 4), randn(3, out_rows // 2, 3), torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="conv weight"):
        add_norm_gemv(hidden, None, norm_weight, weight, EPS, conv=ConvEpilogue(randn(out_rows + 1, 4), cache, slots))
    with pytest.raises(ValueError, match="conv cache"):
        add_norm_gemv(hidden, None, norm_weight, weight, EPS, conv=ConvEpilogue(conv_weight, cache[:, :, :2], slots))
    with pytest.raises(ValueError, match="conv slots"):
        add_norm_gemv(hidden, None, norm_weight, weight, EPS, conv=ConvEpilogue(conv_weight, cache, slots[:1]))
    with pytest.raises(ValueError, match="out_dtype"):
        conv = ConvEpilogue(conv_weight, cache, slots)
        add_norm_gemv(hidden, None, norm_weight, weight, EPS, conv=conv, out_dtype=torch.float64)
    heads, dim, out_rows = GATED_SHAPES[-1]
    core, z, gated_weight = randn(2, heads, dim), randn(2, heads * dim), randn(out_rows, heads * dim)
    with pytest.raises(ValueError, match="power-of-two"):
        gated_norm_gemv(core[:, :, :-1], z, randn(dim), gated_weight, EPS)
    with pytest.raises(ValueError, match="z must be"):
        gated_norm_gemv(core, z[:, :-1], randn(dim), gated_weight, EPS)
    with pytest.raises(ValueError, match="norm_weight"):
        gated_norm_gemv(core, z, randn(dim + 1), gated_weight, EPS)
    block = moe_block()
    with pytest.raises(ValueError, match="pending"):
        route_experts_add_norm(randn(2, MOE_SHAPE[0]), randn(1, MOE_SHAPE[0]), randn(MOE_SHAPE[0]), EPS,
                               block["router"], 2)
