"""The pure-torch reference kernels against independent oracles: the delta-rule formula written out step by step,
direct convolution sums, dense attention, transformers' rotary embedding, and per-token loops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ninfer.kernels.reference import (
    apply_mrope,
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_rms_norm,
    moe_forward,
    mrope_axis_of_frequency,
    mrope_cos_sin,
    paged_attention,
    paged_slot_mapping,
    recurrent_gated_delta_rule,
    rms_norm,
    write_paged_kv,
)


def _delta_inputs(batch: int, length: int, key_heads: int, value_heads: int, dk: int, dv: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, key_heads, dk, generator=gen)
    k = torch.randn(batch, length, key_heads, dk, generator=gen)
    v = torch.randn(batch, length, value_heads, dv, generator=gen)
    # decays as the model makes them: -exp(A_log) * softplus(a + dt_bias), A in [0.01, 16]
    a_rate = torch.empty(value_heads).uniform_(0.01, 16, generator=gen)
    g = -a_rate * F.softplus(torch.randn(batch, length, value_heads, generator=gen) - 4.0)
    beta = torch.sigmoid(torch.randn(batch, length, value_heads, generator=gen))
    state = torch.randn(batch, value_heads, dk, dv, generator=gen) * 0.5
    return q, k, v, g, beta, state


def _delta_rule_by_formula(q, k, v, g, beta, state):
    """S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q, per (batch, value head, token), fp64."""
    batch, length, key_heads, dk = q.shape
    value_heads = v.shape[2]
    group = value_heads // key_heads
    out = torch.zeros(batch, length, value_heads, v.shape[3], dtype=torch.float64)
    final = torch.zeros(state.shape, dtype=torch.float64)
    for b in range(batch):
        for h in range(value_heads):
            s = state[b, h].double().clone()
            for t in range(length):
                q_t = q[b, t, h // group].double()
                k_t = k[b, t, h // group].double()
                q_t = q_t / torch.sqrt((q_t * q_t).sum() + 1e-6) / math.sqrt(dk)
                k_t = k_t / torch.sqrt((k_t * k_t).sum() + 1e-6)
                s = math.exp(float(g[b, t, h])) * s
                delta = float(beta[b, t, h]) * (v[b, t, h].double() - s.T @ k_t)
                s = s + torch.outer(k_t, delta)
                out[b, t, h] = s.T @ q_t
            final[b, h] = s
    return out, final


def test_recurrent_matches_the_formula_with_grouped_heads():
    q, k, v, g, beta, state = _delta_inputs(2, 9, 2, 4, 8, 6, seed=1)
    out, final, states = recurrent_gated_delta_rule(q, k, v, g, beta, state, output_states=True)
    expected_out, expected_final = _delta_rule_by_formula(q, k, v, g, beta, state)
    torch.testing.assert_close(out.double(), expected_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final.double(), expected_final, atol=1e-5, rtol=1e-5)
    assert states.shape == (2, 9, 4, 8, 6) and states.dtype == torch.float32
    torch.testing.assert_close(states[:, -1], final)


@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 130])
@pytest.mark.parametrize("from_state", [False, True])
def test_chunked_equals_recurrent(length, from_state):
    q, k, v, g, beta, state = _delta_inputs(2, length, 2, 4, 16, 16, seed=length)
    initial = state if from_state else torch.zeros_like(state)
    expected, expected_final, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, expected_final, atol=1e-5, rtol=1e-5)


def test_chunked_continues_across_calls_and_keeps_dtype():
    q, k, v, g, beta, state = _delta_inputs(1, 90, 1, 2, 8, 8, seed=3)
    whole, whole_final = chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size=16)
    first, middle = chunk_gated_delta_rule(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state)
    second, final = chunk_gated_delta_rule(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], middle)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, whole_final, atol=1e-5, rtol=1e-5)
    out, final_bf16 = chunk_gated_delta_rule(q, k, v.bfloat16(), g, beta, state)
    assert out.dtype == torch.bfloat16 and final_bf16.dtype == torch.float32


def test_per_token_states_equal_states_of_prefixes():
    q, k, v, g, beta, state = _delta_inputs(1, 6, 2, 4, 8, 8, seed=4)
    _, _, states = recurrent_gated_delta_rule(q, k, v, g, beta, state, output_states=True)
    for t in range(6):
        _, prefix_final = chunk_gated_delta_rule(
            q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g[:, : t + 1], beta[:, : t + 1], state
        )
        torch.testing.assert_close(states[:, t], prefix_final, atol=1e-5, rtol=1e-5)


def test_delta_rule_rejects_mismatched_heads():
    q, k, v, g, beta, state = _delta_inputs(1, 3, 3, 4, 8, 8, seed=5)
    with pytest.raises(ValueError, match="multiple of key heads"):
        recurrent_gated_delta_rule(q, k, v, g, beta, state)


def _conv_by_sums(x, weight, history):
    """y[t, c] = silu(sum_j weight[c, j] * input[t - K + 1 + j, c]) over [history, x]."""
    window = weight.shape[1]
    full = torch.cat([history.transpose(1, 2), x], dim=1)  # [B, K-1+T, C]
    out = torch.zeros_like(x)
    for t in range(x.shape[1]):
        span = full[:, t : t + window]  # inputs t-K+1 .. t
        out[:, t] = F.silu((span * weight.T[None]).sum(dim=1))
    return out


def test_conv_matches_direct_sums_and_continues_in_pieces():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 11, 5, generator=gen)
    weight = torch.randn(5, 4, generator=gen)
    history = torch.randn(2, 5, 3, generator=gen)
    y, new_state, states = causal_conv1d(x, weight, history, output_states=True)
    torch.testing.assert_close(y, _conv_by_sums(x, weight, history), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(new_state, x[:, -3:].transpose(1, 2))
    state = history
    pieces = []
    for start, stop in [(0, 1), (1, 5), (5, 6), (6, 11)]:
        piece, state, _ = causal_conv1d(x[:, start:stop], weight, state)
        pieces.append(piece)
    torch.testing.assert_close(torch.cat(pieces, dim=1), y, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, new_state)
    state = history
    for t in range(11):  # per-token windows equal the stepwise states
        _, state, _ = causal_conv1d(x[:, t : t + 1], weight, state)
        torch.testing.assert_close(states[:, t], state)


def test_conv_from_nothing_equals_zero_padded_conv():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 8, 6, generator=gen)
    weight = torch.randn(6, 4, generator=gen)
    y, _, _ = causal_conv1d(x, weight, None)
    padded = F.conv1d(x.transpose(1, 2), weight[:, None], padding=3, groups=6)[..., :8]
    torch.testing.assert_close(y, F.silu(padded).transpose(1, 2), atol=1e-6, rtol=1e-6)


def test_norms():
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 4, 16, generator=gen)
    z = torch.randn(3, 4, 16, generator=gen)
    w = torch.randn(16, generator=gen) * 0.1
    rms = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, zero_centered=True), rms * (1 + w))
    torch.testing.assert_close(rms_norm(x, w, 1e-6, zero_centered=False), rms * w)
    torch.testing.assert_close(gated_rms_norm(x, z, w, 1e-6), rms * w * z * torch.sigmoid(z))
    assert rms_norm(x.bfloat16(), w, 1e-6, zero_centered=True).dtype == torch.bfloat16


def test_mrope_axis_layout_of_the_real_config():
    axis = mrope_axis_of_frequency(32, [11, 11, 10], interleaved=True)
    assert torch.nonzero(axis == 1).flatten().tolist() == list(range(1, 32, 3))
    assert torch.nonzero(axis == 2).flatten().tolist() == list(range(2, 30, 3))
    assert (axis == 0).sum() == 11
    contiguous = mrope_axis_of_frequency(4, [2, 1, 1], interleaved=False)
    assert contiguous.tolist() == [0, 0, 1, 2]
    with pytest.raises(ValueError, match="summing"):
        mrope_axis_of_frequency(4, [11, 11, 10], interleaved=True)


def test_mrope_matches_transformers_rotary_embedding():
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding, apply_rotary_pos_emb

    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10], "mrope_interleaved": True}
    config = Qwen3_5TextConfig(hidden_size=128, num_attention_heads=2, head_dim=256, rope_parameters=rope)
    gen = torch.Generator().manual_seed(9)
    positions = torch.randint(0, 5000, (3, 7), generator=gen)  # distinct t/h/w rows
    q = torch.randn(7, 2, 256, generator=gen)
    k = torch.randn(7, 1, 256, generator=gen)
    cos, sin = Qwen3_5TextRotaryEmbedding(config)(q, positions[:, None, :])
    expected_q, expected_k = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    got_q, got_k = apply_mrope(q, k, positions, rotary_dim=64, theta=1e7, mrope_section=[11, 11, 10], interleaved=True)
    torch.testing.assert_close(got_q, expected_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, expected_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_text_mrope_is_plain_partial_rope():
    positions = torch.arange(5)
    cos, sin = mrope_cos_sin(positions, rotary_dim=8, theta=1e4, mrope_section=[2, 1, 1], interleaved=True)
    inv_freq = 1.0 / 1e4 ** (torch.arange(0, 8, 2).float() / 8)
    angles = positions[:, None].float() * inv_freq
    torch.testing.assert_close(cos, torch.cat([angles, angles], -1).cos())
    torch.testing.assert_close(sin, torch.cat([angles, angles], -1).sin())


def test_paged_attention_matches_dense_causal_attention():
    gen = torch.Generator().manual_seed(10)
    page_size, heads, kv_heads, dim = 4, 4, 2, 8
    key_cache = torch.zeros(20, page_size, kv_heads, dim)
    value_cache = torch.zeros_like(key_cache)
    page_tables = torch.tensor([[7, 2, 11, 5, 0], [3, 19, 1, 0, 0]], dtype=torch.int32)
    contexts, news = [6, 0], [9, 3]
    keys = [torch.randn(c + n, kv_heads, dim, generator=gen) for c, n in zip(contexts, news)]
    values = [torch.randn(c + n, kv_heads, dim, generator=gen) for c, n in zip(contexts, news)]
    queries = [torch.randn(n, heads, dim, generator=gen) for n in news]
    # the cached prefix of row 0 is written first, then the new tokens of both rows
    write_paged_kv(key_cache, value_cache, keys[0][:6], values[0][:6], paged_slot_mapping(page_tables[:1], [6], [0], 4))
    slots = paged_slot_mapping(page_tables, news, contexts, page_size)
    new_k = torch.cat([keys[0][6:], keys[1]])
    new_v = torch.cat([values[0][6:], values[1]])
    write_paged_kv(key_cache, value_cache, new_k, new_v, slots)
    out = paged_attention(torch.cat(queries), key_cache, value_cache, page_tables, news, contexts)
    start = 0
    for row in range(2):
        c, n = contexts[row], news[row]
        mask = torch.ones(n, c + n, dtype=torch.bool).tril(diagonal=c)
        expected = F.scaled_dot_product_attention(
            queries[row].transpose(0, 1),
            keys[row].repeat_interleave(2, dim=1).transpose(0, 1),
            values[row].repeat_interleave(2, dim=1).transpose(0, 1),
            attn_mask=mask,
        ).transpose(0, 1)
        torch.testing.assert_close(out[start : start + n], expected, atol=1e-5, rtol=1e-5)
        start += n


def test_moe_matches_a_per_token_loop():
    gen = torch.Generator().manual_seed(11)
    tokens, hidden, experts, inner, shared_inner, top_k = 9, 16, 6, 8, 12, 2
    x = torch.randn(tokens, hidden, generator=gen)
    router = torch.randn(experts, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inner, hidden, generator=gen) * 0.2
    down = torch.randn(experts, hidden, inner, generator=gen) * 0.2
    sg, su = (torch.randn(shared_inner, hidden, generator=gen) * 0.2 for _ in range(2))
    sd = torch.randn(hidden, shared_inner, generator=gen) * 0.2
    shared_gate = torch.randn(1, hidden, generator=gen)
    out = moe_forward(x, router, gate_up, down, top_k, shared_gate=sg, shared_up=su, shared_down=sd,
                      shared_expert_gate=shared_gate)
    for n in range(tokens):
        probs = torch.softmax(router @ x[n], dim=0)
        chosen = torch.argsort(probs, descending=True)[:top_k]
        expected = torch.zeros(hidden)
        for e in chosen.tolist():
            gate, up = gate_up[e, :inner] @ x[n], gate_up[e, inner:] @ x[n]
            expected += probs[e] / probs[chosen].sum() * (down[e] @ (F.silu(gate) * up))
        expected += torch.sigmoid(shared_gate @ x[n]) * (sd @ (F.silu(sg @ x[n]) * (su @ x[n])))
        torch.testing.assert_close(out[n], expected, atol=1e-5, rtol=1e-5)
