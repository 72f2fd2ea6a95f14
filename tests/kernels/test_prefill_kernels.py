"""The batched prefill kernels against the token-by-token delta rule and the reference paged attention (fp32, CPU;
the same functions serve CUDA): lengths that are not multiples of the chunk, continuation from a non-zero state,
grouped value heads, rows that continue cached KV."""

from __future__ import annotations

import pytest
import torch
from kernel_support import needs_cuda, rel_err

from ninfer.kernels.reference.attention import paged_attention
from ninfer.kernels.reference.gated_delta import recurrent_gated_delta_rule
from ninfer.kernels.reference.moe import moe_forward
from ninfer.kernels.reference.prefill import batched_chunk_gated_delta_rule, grouped_moe_forward, sdpa_paged_attention


@pytest.mark.parametrize("length", [1, 63, 64, 130])
def test_batched_chunk_rule_matches_recurrent(length):
    torch.manual_seed(length)
    batch, key_heads, value_heads, dk, dv = 2, 2, 4, 16, 8
    q, k = torch.randn(batch, length, key_heads, dk), torch.randn(batch, length, key_heads, dk)
    v = torch.randn(batch, length, value_heads, dv)
    g = -torch.rand(batch, length, value_heads) * 2
    beta = torch.rand(batch, length, value_heads)
    initial = torch.randn(batch, value_heads, dk, dv)
    out, final = batched_chunk_gated_delta_rule(q, k, v, g, beta, initial, chunk_size=16)
    ref_out, ref_final, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    assert out.shape == ref_out.shape and final.shape == ref_final.shape
    assert rel_err(out, ref_out) < 1e-4
    assert rel_err(final, ref_final) < 1e-4


def test_sdpa_paged_attention_matches_reference():
    torch.manual_seed(0)
    query_heads, kv_heads, dim, page_size = 6, 2, 16, 4
    key_cache, value_cache = torch.randn(40, page_size, kv_heads, dim), torch.randn(40, page_size, kv_heads, dim)
    page_tables = torch.randperm(40)[:30].view(3, 10).to(torch.int32)
    query_lens, context_lens = [5, 1, 9], [0, 13, 7]
    query = torch.randn(sum(query_lens), query_heads, dim)
    out = sdpa_paged_attention(query, key_cache, value_cache, page_tables, query_lens, context_lens, scale=0.3)
    ref = paged_attention(query, key_cache, value_cache, page_tables, query_lens, context_lens, scale=0.3)
    assert rel_err(out, ref) < 1e-5


def _moe_inputs(device, dtype):
    generator = torch.Generator().manual_seed(5)

    def rand(*shape, scale=0.1):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    hidden, inner, experts = 64, 32, 16
    return (rand(37, hidden, scale=1.0), rand(experts, hidden, scale=1.0), rand(experts, 2 * inner, hidden),
            rand(experts, hidden, inner)), dict(
        shared_gate=rand(inner, hidden), shared_up=rand(inner, hidden), shared_down=rand(hidden, inner),
        shared_expert_gate=rand(1, hidden))


def test_grouped_moe_matches_reference_moe():
    args, shared = _moe_inputs("cpu", torch.float32)
    ref = moe_forward(*args, 4, **shared)
    assert rel_err(grouped_moe_forward(*args, 4, use_grouped_mm=False, **shared), ref) < 1e-5


@pytest.mark.gpu
@needs_cuda
def test_cuda_prefill_paths_in_bf16_match_the_fp32_reference():
    from ninfer.kernels.reference.prefill import prefill_attention, prefill_gated_delta_rule

    torch.manual_seed(1)
    length, key_heads, value_heads, dk, dv = 333, 4, 12, 128, 128
    q, k = torch.randn(1, length, key_heads, dk), torch.randn(1, length, key_heads, dk)
    v = torch.randn(1, length, value_heads, dv)
    g, beta = -torch.rand(1, length, value_heads) * 3, torch.rand(1, length, value_heads)
    initial = torch.randn(1, value_heads, dk, dv) * 0.1
    ref_out, ref_final, _ = recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    out, final = prefill_gated_delta_rule(
        *(x.cuda().to(torch.bfloat16) for x in (q, k, v)), g.cuda(), beta.cuda(), initial.cuda()
    )
    assert rel_err(out.cpu(), ref_out) < 1e-2 and rel_err(final.cpu(), ref_final) < 1e-2
    query_heads, kv_heads, dim, page_size = 24, 4, 256, 16
    key_cache, value_cache = torch.randn(80, page_size, kv_heads, dim), torch.randn(80, page_size, kv_heads, dim)
    page_tables = torch.randperm(80)[:60].view(2, 30).to(torch.int32)
    query_lens, context_lens = [300, 77], [0, 101]
    query = torch.randn(sum(query_lens), query_heads, dim)
    ref = paged_attention(query, key_cache, value_cache, page_tables, query_lens, context_lens, scale=dim**-0.5)
    out = prefill_attention(
        query.cuda().bfloat16(), key_cache.cuda().bfloat16(), value_cache.cuda().bfloat16(), page_tables.cuda(),
        query_lens, context_lens, scale=dim**-0.5,
    )
    assert rel_err(out.cpu(), ref) < 1e-2
    args, shared = _moe_inputs("cuda", torch.bfloat16)
    ref = moe_forward(*args, 4, **shared)
    assert rel_err(grouped_moe_forward(*args, 4, use_grouped_mm=True, **shared), ref) < 1e-2
