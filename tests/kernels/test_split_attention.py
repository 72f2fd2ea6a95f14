"""``split_paged_attention`` (prefix without a mask + chunk causally, merged by log-sum-exp) against the reference
``paged_attention`` on the CPU, with a plain softmax attention written here as the fused kernel it calls: rows
that continue cached context and rows at root, grouped KV heads, pages scattered in the pool."""

from __future__ import annotations

import pytest
import torch

from ninfer.kernels.reference.attention import paged_attention
from ninfer.kernels.reference.prefill import split_paged_attention


def softmax_attention(q, k, v, causal, scale):  # type: ignore[no-untyped-def]
    """Attention of ``[1, H, L, D]`` operands with its natural-log logsumexp; causal means both ends aligned."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v.double()).to(q.dtype), scores.logsumexp(-1).float()


@pytest.mark.parametrize(
    "query_lens, context_lens, heads, kv_heads",
    [([9], [0], 4, 4), ([7], [13], 6, 2), ([1], [30], 8, 1), ([5, 12, 3], [0, 21, 40], 6, 3)],
)
def test_matches_the_reference(query_lens, context_lens, heads, kv_heads):
    generator = torch.Generator().manual_seed(sum(query_lens) + sum(context_lens) + heads)
    page, dim, pages = 4, 16, 64
    keys = torch.randn(pages, page, kv_heads, dim, generator=generator)
    values = torch.randn(pages, page, kv_heads, dim, generator=generator)
    tables = torch.stack([torch.randperm(pages, generator=generator) for _ in query_lens]).to(torch.int32)
    query = torch.randn(sum(query_lens), heads, dim, generator=generator)
    expected = paged_attention(query, keys, values, tables, query_lens, context_lens, scale=dim**-0.5)
    got = split_paged_attention(query, keys, values, tables, query_lens, context_lens, scale=dim**-0.5,
                                attend=softmax_attention)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
