"""The continuation prefill attentions (the Triton paged kernel; ``split_paged_attention`` on cuDNN and on flash)
against their twin, the reference ``paged_attention`` (fp32 math on the same
bf16 inputs): rows whose chunk continues cached context (continuation chunks) and rows that start at root, query and
context lengths that are not multiples of the 64-token blocks or the 16-token pages, pages scattered in the pool,
grouped KV heads, several rows in one batch, and a query that is a strided view (the unfused projection).
"""

from __future__ import annotations

import pytest
import torch
from kernel_support import CUDA, DEVICE, rel_err, skip_module_without_triton

from ninfer.kernels.reference.attention import paged_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="bf16 tensor-core attention needs a GPU")]

skip_module_without_triton()

from ninfer.kernels.reference.prefill import cudnn_attention, flash_attention, split_paged_attention  # noqa: E402
from ninfer.kernels.triton.prefill_attention import paged_prefill_attention  # noqa: E402

KERNELS = {
    "triton": paged_prefill_attention,
    "split-cudnn": lambda *args, scale: split_paged_attention(*args, scale=scale, attend=cudnn_attention),
    "split-flash": lambda *args, scale: split_paged_attention(*args, scale=scale, attend=flash_attention),
}

PAGE = 16


def _batch(rows: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, seed: int):
    """Caches holding every row's context + new tokens on shuffled pages, and the new tokens' queries."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_row = [-(-(context + length) // PAGE) for length, context in rows]
    total_pages = sum(pages_per_row) + 3
    order = torch.randperm(total_pages, generator=generator)
    width = max(pages_per_row)
    tables = torch.zeros(len(rows), width, dtype=torch.int32)
    used = 0
    for row, count in enumerate(pages_per_row):
        tables[row, :count] = order[used : used + count]
        used += count
    keys = torch.randn(total_pages, PAGE, kv_heads, dim, generator=generator).to(torch.bfloat16)
    values = torch.randn(total_pages, PAGE, kv_heads, dim, generator=generator).to(torch.bfloat16)
    tokens = sum(length for length, _ in rows)
    query = torch.randn(tokens, heads, dim, generator=generator).to(torch.bfloat16)
    return query, keys, values, tables


@pytest.mark.parametrize(
    "rows, heads, kv_heads, dim",
    [
        ([(1, 0)], 4, 1, 128),
        ([(100, 0)], 8, 2, 256),
        ([(333, 0)], 6, 1, 256),
        ([(64, 64)], 8, 2, 256),  # a continuation chunk on block boundaries
        ([(70, 130)], 8, 2, 256),  # a continuation chunk off every boundary
        ([(1000, 2500)], 24, 4, 256),  # a long continuation (the 27B head layout)
        ([(37, 0), (129, 211), (1, 5), (200, 1000)], 16, 4, 128),  # mixed rows in one batch
    ],
)
@pytest.mark.parametrize("kernel", KERNELS)
def test_matches_the_reference(kernel, rows, heads, kv_heads, dim):
    query, keys, values, tables = _batch(rows, heads, kv_heads, dim, seed=len(rows) * 1000 + dim + heads)
    query_lens, context_lens = [length for length, _ in rows], [context for _, context in rows]
    expected = paged_attention(query.float(), keys, values, tables, query_lens, context_lens, scale=dim**-0.5)
    got = KERNELS[kernel](query.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), tables.to(DEVICE),
                          query_lens, context_lens, scale=dim**-0.5)
    assert got.dtype == torch.bfloat16
    assert rel_err(got.float(), expected) < 1e-2


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_strided_query_view_reads_the_right_heads(kernel):
    """The unfused projection hands over ``[T, H, 2D]`` split into query and gate: a view with a head stride 2D."""
    rows, heads, kv_heads, dim = [(90, 40)], 8, 2, 128
    query, keys, values, tables = _batch(rows, heads, kv_heads, dim, seed=5)
    projected = torch.cat([query, torch.randn_like(query.float()).to(torch.bfloat16)], dim=-1).to(DEVICE)
    view = projected[..., :dim]
    assert not view.is_contiguous()
    expected = paged_attention(query.float(), keys, values, tables, [90], [40], scale=dim**-0.5)
    got = KERNELS[kernel](view, keys.to(DEVICE), values.to(DEVICE), tables.to(DEVICE), [90], [40], scale=dim**-0.5)
    assert rel_err(got.float(), expected) < 1e-2


def test_rejects_a_head_dim_it_cannot_tile():
    query = torch.zeros(4, 2, 24, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(2, PAGE, 1, 24, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="head dim 24"):
        paged_prefill_attention(query, cache, cache, torch.zeros(1, 1, dtype=torch.int32, device=DEVICE), [4], [0],
                                scale=1.0)
