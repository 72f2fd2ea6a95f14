"""Decode-step kernel variants against their twins: the gated delta step's split refused where it does not divide
the value columns, the head-wise gated RMSNorm over strided rows, and the whole decode step with the grouped MoE
kernels and the split gated delta step against the reference runtime (the split step itself: ``test_triton_kernels``).

Runs on CUDA; without a GPU it runs in Triton's CPU interpreter when ``TRITON_INTERPRET=1`` (small shapes, fp32),
otherwise it is skipped.
"""

from __future__ import annotations

import pytest
import torch
from kernel_support import CUDA, DEVICE, DTYPE, rel_err, seed_each_test, skip_module_without_triton

from ninfer.core.runtime import ForwardBatch, KVCache, StateCache
from ninfer.kernels.reference.norms import gated_rms_norm
from ninfer.plugins.qwen3_5.model.presets import preset_config
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.model.synthetic import InMemorySource, build_runtime, random_text_weights

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.kernels.triton.gated_delta import fused_recurrent_gated_delta  # noqa: E402
from ninfer.kernels.triton.norms import gated_rms_norm as triton_gated_rms_norm  # noqa: E402
from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner  # noqa: E402
from ninfer.plugins.qwen3_5.model.fused import fuse_model  # noqa: E402

TOL = 1e-2 if CUDA else 1e-5
STATE_TOL = 1e-4
BIG = CUDA


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(DTYPE)


_seed = seed_each_test(1234)


def test_split_gated_delta_rejects_uneven_split():
    cache = torch.zeros(2, 4, 16, 16, device=DEVICE)
    qkv = randn(1, 2 * 2 * 16 + 4 * 16)
    gates = randn(1, 4)
    with pytest.raises(ValueError, match="value_split"):
        fused_recurrent_gated_delta(
            qkv, gates, gates, gates[0].float(), gates[0].float(), cache, torch.tensor([0], device=DEVICE),
            key_heads=2, value_split=3,
        )


def test_gated_rms_norm_over_strided_heads():
    """z as a column slice of a wider projection viewed [N, H, D]: read in place, same result as contiguous."""
    tokens, heads, dim = 5, 6, (128 if BIG else 16)
    x = randn(tokens, heads, dim)
    wide = randn(tokens, heads * dim + 7)
    z = wide[:, 3 : 3 + heads * dim].view(tokens, heads, dim)
    weight = 1 + randn(dim, scale=0.1)
    out = triton_gated_rms_norm(x, z, weight, 1e-6)
    assert rel_err(out, gated_rms_norm(x.float(), z.float(), weight.float(), 1e-6)) < TOL
    with pytest.raises(ValueError, match="contiguous heads"):
        triton_gated_rms_norm(x.transpose(1, 2), z.transpose(1, 2), weight, 1e-6)


def _tiny_moe():
    config = preset_config("tiny-moe")
    tensors = random_text_weights(config, device=DEVICE, dtype=DTYPE, seed=3)
    with torch.no_grad():  # move norms and gates away from their init values so every weight matters
        for name, tensor in tensors.items():
            if "norm" in name or "dt_bias" in name:
                tensor.add_(torch.randn_like(tensor.float()).to(tensor.dtype) * 0.2)
    reference = build_runtime(InMemorySource("tiny-moe", config, tensors), dtype=DTYPE, device=DEVICE)
    if reference.decoder is None:
        model, fused = fuse_model(reference.model)
    else:
        model, fused = reference.model, reference.decoder.fused
        reference = Qwen35Runtime(model, None, None)
    return reference, model, fused


def _decode_batch(lengths: list[int], tables: torch.Tensor, tokens: list[list[int]]) -> ForwardBatch:
    positions = torch.cat([torch.arange(c, c + len(t)) for c, t in zip(lengths, tokens)])
    return ForwardBatch(
        token_ids=torch.tensor([t for chunk in tokens for t in chunk]),
        positions=positions.expand(3, -1),
        query_lens=[len(t) for t in tokens],
        context_lens=list(lengths),
        page_tables=tables,
        state_slots=torch.arange(len(tokens) - 1, -1, -1),
        logits="last",
        return_hidden=True,
    )


def test_decode_step_with_grouped_moe_and_split_gated_delta_matches_reference():
    torch.manual_seed(0)
    reference, model, fused = _tiny_moe()
    vocab, rows, page_size = model.config.vocab_size, 3, 16
    kv = KVCache.allocate(reference.spec, rows * 4, page_size)
    state = StateCache.allocate(reference.spec, rows)
    tables = torch.arange(rows * 4, dtype=torch.int32).view(rows, 4)
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (5, 17, 30)]
    lengths = [0] * rows
    with torch.no_grad():
        reference.forward(_decode_batch(lengths, tables, prompts), kv, state)
    lengths = [len(p) for p in prompts]
    ours_kv = KVCache(kv.page_size, [t.clone() for t in kv.key], [t.clone() for t in kv.value])
    ours_state = StateCache([t.clone() for t in state.conv], [t.clone() for t in state.ssm])
    runner = DecodeGraphRunner(model, fused, use_graphs=CUDA, grouped_moe_rows=64, gdn_value_split=2)
    for step in range(3):
        tokens = [[int(t)] for t in torch.randint(0, vocab, (rows,))]
        expected = reference.forward(_decode_batch(lengths, tables, tokens), kv, state)
        got = runner.forward(_decode_batch(lengths, tables, tokens), ours_kv, ours_state)
        lengths = [n + 1 for n in lengths]
        assert rel_err(got.logits, expected.logits) < (2e-2 if CUDA else 1e-4), step
        assert rel_err(got.hidden, expected.hidden) < (2e-2 if CUDA else 1e-4), step
    for got_ssm, expected_ssm in zip(ours_state.ssm, state.ssm):
        assert rel_err(got_ssm, expected_ssm) < (2e-2 if CUDA else 1e-4)
