"""Triton kernels against their pure-torch twins (relative error: bf16 <= 1e-2, fp32 state <= 1e-4).

Runs on CUDA; without a GPU it runs in Triton's CPU interpreter when ``TRITON_INTERPRET=1`` (small shapes, fp32),
otherwise it is skipped. Inputs are random and non-zero, lengths are not multiples of the block sizes, states start
non-zero, and outputs and untouched cache slots are checked element by element.
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

from ninfer.core.runtime import StateCache, state_update_mask
from ninfer.kernels.reference.attention import paged_attention, paged_slot_mapping, write_paged_kv
from ninfer.kernels.reference.conv import causal_conv1d
from ninfer.kernels.reference.gated_delta import recurrent_gated_delta_rule
from ninfer.kernels.reference.moe import moe_forward
from ninfer.kernels.reference.norms import gated_rms_norm, rms_norm
from ninfer.kernels.reference.rope import apply_rotary, mrope_axis_of_frequency, rope_inverse_frequencies, rotary_cos_sin

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.kernels.triton.attention import paged_attention_decode, qk_norm_rope_write_kv  # noqa: E402
from ninfer.kernels.triton.conv import causal_conv1d_update  # noqa: E402
from ninfer.kernels.triton.gated_delta import fused_recurrent_gated_delta  # noqa: E402
from ninfer.kernels.triton.moe import combine_experts, expert_gemv, route_top_k  # noqa: E402
from ninfer.kernels.triton.norms import add_rms_norm, gated_rms_norm as triton_gated_rms_norm, silu_mul  # noqa: E402
from ninfer.kernels.triton.pending_state import PendingStateUpdates  # noqa: E402
from ninfer.kernels.triton.staging import decode_prologue, stage_inputs  # noqa: E402

TOL = 1e-2 if DTYPE == torch.bfloat16 else 1e-5
STATE_TOL = 1e-4
BIG = CUDA  # real head sizes on the GPU, toy ones in the interpreter


def randn(*shape, dtype=DTYPE, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


_seed = seed_each_test(1234)


@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm(with_residual):
    hidden = 5120 if BIG else 80
    x, residual, weight = randn(7, hidden), randn(7, hidden), randn(hidden, scale=0.1)
    total, normed = add_rms_norm(x, residual if with_residual else None, weight, 1e-6)
    expected_total = (x + residual) if with_residual else x
    assert torch.equal(total, expected_total)
    assert rel_err(normed, rms_norm(expected_total, weight, 1e-6, zero_centered=True)) < TOL


def test_gated_rms_norm_and_silu_mul():
    dim = 128 if BIG else 16
    # 37 x 6 heads: several programs of several heads each, the last one partly past the rows; z a strided slice
    x, weight = randn(37, 6, dim), 1 + randn(dim, scale=0.1)
    z = randn(37, 6 * dim + 5)[:, : 6 * dim].view(37, 6, dim)
    assert rel_err(triton_gated_rms_norm(x, z, weight, 1e-6), gated_rms_norm(x, z, weight, 1e-6)) < TOL
    gate_up = randn(3, 2 * (300 if BIG else 40))
    gate, up = gate_up.chunk(2, dim=-1)
    assert rel_err(silu_mul(gate_up), F.silu(gate.float()) * up.float()) < TOL


def test_conv_update_matches_reference_and_leaves_other_slots():
    channels, kernel, slots_total = (10240 if BIG else 100), 4, 6
    weight = randn(channels, kernel, scale=0.5)
    cache = randn(slots_total, channels, kernel - 1)
    before = cache.clone()
    slots = torch.tensor([4, 1, 3], device=DEVICE)
    x_full = randn(3, channels + 7)  # strided rows, as inside a fused projection
    x = x_full[:, :channels]
    out = causal_conv1d_update(x, weight, cache, slots)
    ref_out, ref_state, _ = causal_conv1d(x[:, None, :].contiguous(), weight, before[slots])
    assert rel_err(out, ref_out[:, 0]) < TOL
    assert torch.equal(cache[slots], ref_state)
    untouched = [s for s in range(slots_total) if s not in slots.tolist()]
    assert torch.equal(cache[untouched], before[untouched])


def _reference_delta_steps(
    qkv, a, b, decay_rate, dt_bias, states, key_heads, dk, dv, tokens_per_row=1, output_states=False
):
    """``(out [tokens, Hv, Dv], final states, per-token states or None)`` by the torch twin, ``tokens_per_row``
    tokens of each row from ``states`` (one per row)."""
    tokens, value_heads = a.shape
    shape = (tokens // tokens_per_row, tokens_per_row)
    q, k, v = torch.split(qkv.reshape(*shape, -1), [key_heads * dk, key_heads * dk, value_heads * dv], dim=-1)
    out, final, per_token = recurrent_gated_delta_rule(
        q.reshape(*shape, key_heads, dk), k.reshape(*shape, key_heads, dk), v.reshape(*shape, value_heads, dv),
        (decay_rate * F.softplus(a.float() + dt_bias)).reshape(*shape, value_heads),
        torch.sigmoid(b.float()).reshape(*shape, value_heads), states, output_states=output_states,
    )
    return out.reshape(tokens, value_heads, dv), final, per_token


@pytest.mark.parametrize("value_split", [1, 2, 4])  # programs per value head (> 1: the norm is a second launch)
@pytest.mark.parametrize("tokens_per_row,fuse_norm", [(1, True), (3, True), (3, False), (1, False)])
def test_fused_recurrent_gated_delta(tokens_per_row, fuse_norm, value_split):
    key_heads, value_heads, dk, dv = (4, 12, 128, 128) if BIG else (2, 4, 16, 16)
    rows, slots_total = 3, 5
    tokens = rows * tokens_per_row
    qkv_width = 2 * key_heads * dk + value_heads * dv
    proj = randn(tokens, qkv_width + value_heads * dv + 2 * value_heads)  # [qkv | z | b | a] like the fused proj
    qkv = proj[:, :qkv_width]
    z = proj[:, qkv_width : qkv_width + value_heads * dv]
    b = proj[:, qkv_width + value_heads * dv : qkv_width + value_heads * dv + value_heads]
    a = proj[:, qkv_width + value_heads * dv + value_heads :]
    decay_rate = -torch.empty(value_heads, device=DEVICE).uniform_(1, 16)
    dt_bias = torch.randn(value_heads, device=DEVICE)
    norm_weight = 1 + randn(dv, scale=0.1)
    cache = torch.randn(slots_total, value_heads, dk, dv, device=DEVICE) * 0.1
    before = cache.clone()
    slots = torch.tensor([2, 0, 4], device=DEVICE)
    out, states = fused_recurrent_gated_delta(
        qkv, a, b, decay_rate, dt_bias, cache, slots, key_heads=key_heads, tokens_per_row=tokens_per_row,
        z=z if fuse_norm else None, norm_weight=norm_weight if fuse_norm else None, output_states=True,
        value_split=value_split,
    )
    ref_out, ref_final, ref_states = _reference_delta_steps(
        qkv, a, b, decay_rate, dt_bias, before[slots], key_heads, dk, dv, tokens_per_row, output_states=True
    )
    if fuse_norm:
        ref_out = gated_rms_norm(ref_out.float(), z.reshape(tokens, value_heads, dv).float(), norm_weight, 1e-6)
    assert out.shape == (tokens, value_heads, dv)
    assert rel_err(out, ref_out) < TOL
    assert rel_err(cache[slots], ref_final) < STATE_TOL
    assert rel_err(states, ref_states.reshape(tokens, value_heads, dk, dv)) < STATE_TOL
    untouched = [s for s in range(slots_total) if s not in slots.tolist()]
    assert torch.equal(cache[untouched], before[untouched])


def _delta_step_inputs(key_heads, value_heads, dk, dv, rows):
    """One decode token per row: ``qkv`` (a strided slice, as inside the fused projection), ``a``, ``b``."""
    qkv_width = 2 * key_heads * dk + value_heads * dv
    proj = randn(rows, qkv_width + 2 * value_heads)
    return proj[:, :qkv_width], proj[:, qkv_width + value_heads :], proj[:, qkv_width : qkv_width + value_heads]


@pytest.mark.parametrize("value_split", [1, 4])
def test_pending_state_updates_give_the_stored_states_outputs_and_settle_into_them(value_split):
    key_heads, value_heads, dk, dv = (4, 12, 128, 128) if BIG else (2, 4, 16, 16)
    slots_total, capacity = 5, 3
    decay_rate = -torch.empty(value_heads, device=DEVICE).uniform_(1, 16)
    dt_bias = torch.randn(value_heads, device=DEVICE)
    cache = torch.randn(slots_total, value_heads, dk, dv, device=DEVICE) * 0.1
    expected = cache.clone()
    updates = PendingStateUpdates.allocate([cache], capacity, value_split)
    state = StateCache(conv=[], ssm=[cache], pending=updates)
    slots = torch.tensor([2, 0, 4], device=DEVICE)
    for step in range(2 * capacity + 3):  # the record fills, the state is stored, it fills again, one stays
        qkv, a, b = _delta_step_inputs(key_heads, value_heads, dk, dv, rows=3)
        stopped = step == 4  # the middle row reads its state but leaves it (and its record) as they are
        step_slots = torch.tensor([2, -1, 4], device=DEVICE) if stopped else slots
        out, _ = fused_recurrent_gated_delta(
            qkv, a, b, decay_rate, dt_bias, state.unsettled_ssm()[0], step_slots, key_heads=key_heads,
            value_split=value_split, pending=updates.layers[0],
        )
        updates.dirty = True
        ref_out, ref_states, _ = _reference_delta_steps(
            qkv, a, b, decay_rate, dt_bias, expected[slots], key_heads, dk, dv
        )
        assert rel_err(out, ref_out) < TOL
        moved = slots[torch.tensor([0, 2])] if stopped else slots
        expected[moved] = ref_states[torch.tensor([0, 2])] if stopped else ref_states
    counts = updates.layers[0].counts
    # 9 steps of records of 3: stored after the 4th and the 8th, the 9th pending; the stopped row 4th and 9th
    assert counts[slots].tolist() == [[[n] * value_split] * value_heads for n in (1, 0, 1)]
    assert rel_err(cache[2], expected[2]) > STATE_TOL and rel_err(cache[0], expected[0]) < STATE_TOL
    assert rel_err(state.ssm[0], expected) < STATE_TOL  # reading the states settles them
    assert not counts.any() and not updates.dirty


def test_pending_state_updates_refuse_what_they_cannot_record():
    cache = torch.zeros(2, 4, 16, 16, device=DEVICE)
    updates = PendingStateUpdates.allocate([cache], 2, value_split=2)
    qkv, a, b = _delta_step_inputs(2, 4, 16, 16, rows=2)
    slots, gate = torch.tensor([0, 1], device=DEVICE), torch.ones(4, device=DEVICE)
    for options in (dict(value_split=1), dict(value_split=2, output_states=True)):
        with pytest.raises(ValueError, match="pending updates need"):
            fused_recurrent_gated_delta(qkv, a, b, gate, gate, cache, slots, key_heads=2, pending=updates.layers[0],
                                        **options)
    with pytest.raises(ValueError, match="must divide"):
        PendingStateUpdates.allocate([cache], 2, value_split=3)


def _paged_setup(kv_heads, dim, page_size, rows_pages, num_pages):
    key_cache = randn(num_pages, page_size, kv_heads, dim)
    value_cache = randn(num_pages, page_size, kv_heads, dim)
    order = torch.randperm(num_pages, device=DEVICE)[: rows_pages[0] * rows_pages[1]]
    page_tables = order.view(*rows_pages).to(torch.int32)
    return key_cache, value_cache, page_tables


def test_qk_norm_rope_write_kv():
    query_heads, kv_heads, dim = (24, 4, 256) if BIG else (4, 2, 32)
    rotary = dim // 4
    page_size, rows = 16, 3
    key_cache, value_cache, page_tables = _paged_setup(kv_heads, dim, page_size, (rows, 4), 20)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    contexts = [5, 17, 33]
    proj = randn(rows, query_heads * 2 * dim + 2 * kv_heads * dim)
    q_norm, k_norm = randn(dim, scale=0.1), randn(dim, scale=0.1)
    positions = torch.tensor(contexts, device=DEVICE)[None, :].repeat(3, 1)
    positions[1] += 3  # distinct MRoPE rows exercise the per-frequency axis
    inv = rope_inverse_frequencies(rotary, 1e7, DEVICE)
    section = (rotary // 2 - 2 * (rotary // 6), rotary // 6, rotary // 6)
    axis = mrope_axis_of_frequency(rotary // 2, section, interleaved=True, device=DEVICE)
    slot_mapping = paged_slot_mapping(page_tables, [1] * rows, contexts, page_size)
    q = qk_norm_rope_write_kv(
        proj, q_norm, k_norm, positions, inv, axis, key_cache, value_cache, slot_mapping, 1e-6, query_heads=query_heads
    )
    query = proj[:, : query_heads * 2 * dim].view(rows, query_heads, 2 * dim)[..., :dim]
    key = proj[:, query_heads * 2 * dim : query_heads * 2 * dim + kv_heads * dim].view(rows, kv_heads, dim)
    value = proj[:, query_heads * 2 * dim + kv_heads * dim :].view(rows, kv_heads, dim)
    cos, sin = rotary_cos_sin(positions, inv, axis)
    ref_q = apply_rotary(rms_norm(query.float(), q_norm, 1e-6, zero_centered=True), cos, sin)
    ref_k = apply_rotary(rms_norm(key.float(), k_norm, 1e-6, zero_centered=True), cos, sin)
    assert rel_err(q, ref_q) < TOL
    write_paged_kv(before_k, before_v, ref_k.to(DTYPE), value, slot_mapping)
    assert rel_err(key_cache, before_k) < TOL
    assert torch.equal(value_cache, before_v)


@pytest.mark.parametrize("split_tokens, lens_dtype", [(None, torch.int32), (32, torch.int64), (128, torch.int64)])
def test_paged_attention_decode(split_tokens, lens_dtype):
    query_heads, kv_heads, dim = (24, 4, 256) if BIG else (4, 2, 32)
    page_size, rows, pages_per_row = 16, 4, 20
    key_cache, value_cache, page_tables = _paged_setup(kv_heads, dim, page_size, (rows, pages_per_row), 100)
    totals = [1, 37, 130, 319]
    q = randn(rows, query_heads, dim)
    gate_source = randn(rows, query_heads, 2 * dim)
    gate = gate_source[..., dim:]
    total_lens = torch.tensor(totals, device=DEVICE, dtype=lens_dtype)
    out = paged_attention_decode(
        q, key_cache, value_cache, page_tables, total_lens, scale=dim**-0.5, gate=gate, split_tokens=split_tokens
    )
    ref = paged_attention(q, key_cache, value_cache, page_tables, [1] * rows, [t - 1 for t in totals])
    ref = ref.float() * torch.sigmoid(gate.float())
    assert rel_err(out.view(rows, query_heads, dim), ref) < TOL


@needs_gpu_pdl
def test_attention_decode_chain_with_programmatic_dependent_launch_in_a_graph_matches_plain_launches():
    """The decode attention layer's launches after a GEMV that writes the projection and triggers its dependents
    early (``act_gemv``): q/k norms + RoPE with the KV write, the split-K partials, their reduce with the gate, and
    the output GEMV, each waiting only where it reads its predecessor's writes."""
    from ninfer.kernels.triton.act_gemv import act_gemv, default_act_tiles

    query_heads, kv_heads, dim, hidden = 16, 2, 256, 2048
    rotary, page_size, rows = dim // 4, 16, 1
    key_cache, value_cache, page_tables = _paged_setup(kv_heads, dim, page_size, (rows, 64), 64)
    contexts = [300]
    width = query_heads * 2 * dim + 2 * kv_heads * dim
    entry, out_proj = randn(width, hidden, scale=0.02), randn(hidden, query_heads * dim, scale=0.02)
    q_norm, k_norm = randn(dim, scale=0.1), randn(dim, scale=0.1)
    positions = torch.tensor(contexts, device=DEVICE)[None, :].repeat(3, 1)
    inv = rope_inverse_frequencies(rotary, 1e7, DEVICE)
    section = (rotary // 2 - 2 * (rotary // 6), rotary // 6, rotary // 6)
    axis = mrope_axis_of_frequency(rotary // 2, section, interleaved=True, device=DEVICE)
    slot_mapping = paged_slot_mapping(page_tables, [1] * rows, contexts, page_size)
    total_lens = torch.tensor([c + 1 for c in contexts], device=DEVICE, dtype=torch.int32)

    def chain(x, pdl):
        tiles = attrs.evolve(default_act_tiles(rows, DEVICE), pdl=pdl)
        proj = act_gemv(x, entry, tiles=tiles)
        q = qk_norm_rope_write_kv(
            proj, q_norm, k_norm, positions, inv, axis, key_cache, value_cache, slot_mapping, 1e-6,
            query_heads=query_heads, pdl=pdl,
        )
        gate = proj[:, : query_heads * 2 * dim].view(rows, query_heads, 2 * dim)[..., dim:]
        attended = paged_attention_decode(
            q, key_cache, value_cache, page_tables, total_lens, scale=dim**-0.5, gate=gate, pdl=pdl
        )
        return act_gemv(attended, out_proj, tiles=tiles)

    assert_pdl_graph_matches_plain(chain, [randn(rows, hidden) for _ in range(3)])


def test_moe_decode_pieces_match_moe_forward():
    hidden, inner, experts, top_k = (512, 128, 64, 8) if BIG else (48, 16, 8, 2)
    tokens = 3
    x = randn(tokens, hidden)
    router = randn(experts, hidden, scale=0.5)
    gate_up = randn(experts, 2 * inner, hidden, scale=0.05)
    down = randn(experts, hidden, inner, scale=0.05)
    shared_gate, shared_up = randn(inner, hidden, scale=0.05), randn(inner, hidden, scale=0.05)
    shared_down, shared_expert_gate = randn(hidden, inner, scale=0.05), randn(1, hidden, scale=0.05)
    ref = moe_forward(
        x, router, gate_up, down, top_k, shared_gate=shared_gate, shared_up=shared_up, shared_down=shared_down,
        shared_expert_gate=shared_expert_gate,
    )
    entry = F.linear(x, torch.cat([router, shared_gate, shared_up, shared_expert_gate]))
    weights, chosen = route_top_k(entry[:, :experts], top_k)
    ref_probs = torch.softmax(entry[:, :experts].float(), dim=-1)
    ref_weights, ref_chosen = torch.topk(ref_probs, top_k, dim=-1)
    assert torch.equal(chosen.long().sort(dim=-1).values, ref_chosen.sort(dim=-1).values)
    assert rel_err(weights, ref_weights / ref_weights.sum(-1, keepdim=True)) < 1e-5
    hidden_act = silu_mul(expert_gemv(x, gate_up, chosen, pairs_per_x=top_k))
    expert_out = expert_gemv(hidden_act, down, chosen, pairs_per_x=1)
    shared = F.linear(silu_mul(entry[:, experts : experts + 2 * inner]), shared_down)
    out = combine_experts(expert_out, weights, shared, entry[:, experts + 2 * inner :])
    assert rel_err(out, ref) < TOL


# the rows' stop tables (ForwardBatch.state_update_stops) and the tokens they are fed: a stop id, none of them,
# not fed, the last stop id, no stop ids
STOPS = [[1, 5, -1, -1], [1, 4, 8, -1], [0, -1, -1, -1], [1, 1, 7, 11], [1, -1, -1, -1]]
FED = [5, 9, 2, 7, 3]


@pytest.mark.parametrize("size", [37, 2500])  # one program, several
@pytest.mark.parametrize("with_ids, stop_columns", [(True, 4), (True, 1), (True, 0), (False, 4), (False, 0)])
def test_stage_inputs_copies_the_buffer_with_the_ids_and_the_stopped_rows_slots_like_the_torch_ops(
    size, with_ids, stop_columns
):
    """``stops[:, :1]``: whether each row feeds its token, no stop ids; 0 columns: no stop table at all."""
    generator = torch.Generator().manual_seed(3)
    rows, slots_at = 5, 20
    source = torch.randint(0, 1 << 40, (size,), generator=generator)
    ids = torch.tensor(FED, device=DEVICE) if with_ids else None
    if not with_ids:
        source[:rows] = torch.tensor(FED)  # the host-staged tokens are the ones fed
    source = source.to(DEVICE)
    stops = torch.tensor(STOPS, device=DEVICE)[:, :stop_columns].contiguous() if stop_columns else None
    target = torch.full((size,), -7, dtype=torch.int64, device=DEVICE)
    expected = source.clone()
    if with_ids:
        expected[:rows] = ids
    if stops is not None:
        keep = state_update_mask(expected[:rows], stops)
        kept = [False, True, False, False, True] if stop_columns > 1 else [True, True, False, True, True]
        assert keep.tolist() == kept
        slots = expected[slots_at : slots_at + rows]
        slots.copy_(torch.where(keep, slots, -1 - slots))
    stage_inputs(source, target, ids, stops, slots_at)
    assert torch.equal(target, expected)


def test_stage_inputs_refuses_stops_that_are_not_int64_tables_of_slots_inside_the_buffer():
    source, stops = torch.zeros(30, dtype=torch.int64, device=DEVICE), torch.tensor(STOPS, device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        stage_inputs(source, source.clone(), None, stops.int(), 0)
    with pytest.raises(ValueError, match="int64"):
        stage_inputs(source, source.clone(), None, stops.flatten(), 0)
    with pytest.raises(ValueError, match="within the buffer"):
        stage_inputs(source, source.clone(), None, stops, 27)
    with pytest.raises(ValueError, match="ids for every row"):
        stage_inputs(source, source.clone(), source[:3], stops, 10)


@pytest.mark.parametrize("rows", [1, 5])
def test_decode_prologue_matches_the_embedding_and_the_slot_arithmetic(rows):
    generator = torch.Generator().manual_seed(5)
    hidden, vocab, page_size, width = (2048 if BIG else 72), 300, 16, 9
    embed = randn(vocab, hidden)
    token_ids = torch.randint(0, vocab, (rows,), generator=generator).to(DEVICE)
    context = torch.randint(0, width * page_size, (rows,), generator=generator).to(DEVICE)
    page_tables = torch.randperm(rows * width, generator=generator).view(rows, width).to(DEVICE)
    got_hidden, got_slots, got_total = decode_prologue(token_ids, context, page_tables, embed, page_size)
    pages = page_tables.gather(1, (context // page_size)[:, None]).squeeze(1)
    assert torch.equal(got_hidden, F.embedding(token_ids, embed))
    assert torch.equal(got_slots, pages * page_size + context % page_size)
    assert torch.equal(got_total, context + 1)
    assert got_slots.dtype == got_total.dtype == torch.int64


def test_decode_prologue_refuses_mismatched_rows_and_devices():
    embed = randn(10, 8)
    ids, context = torch.zeros(3, dtype=torch.int64, device=DEVICE), torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="page_tables"):
        decode_prologue(ids, context, torch.zeros((2, 4), dtype=torch.int64, device=DEVICE), embed, 16)
    if CUDA:
        with pytest.raises(ValueError, match="device"):
            decode_prologue(ids.cpu(), context, torch.zeros((3, 4), dtype=torch.int64, device=DEVICE), embed, 16)

