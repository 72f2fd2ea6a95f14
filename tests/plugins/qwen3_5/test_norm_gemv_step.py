"""The decode step with the norms folded into the GEMVs (``DecodeGraphRunner(norm_gemv_rows=...)``) against the same
step with separate norm launches, on the same weights and caches.

Runs on CUDA (bf16; eager and CUDA graphs with programmatic dependent launch); without a GPU it runs the eager step
in Triton's CPU interpreter when ``TRITON_INTERPRET=1`` (fp32), otherwise it is skipped. Covers Gated DeltaNet and
attention layers, the persistent and the grouped MoE blocks (batch 1), the separate-launch MoE block (2 rows) and the
dense MLP; the step with separate norm launches runs the separate-launch MoE block.
"""

from __future__ import annotations

import pytest
import torch
from kernel_support import CUDA, rel_err, skip_module_without_triton

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from test_decode_graph import Caches, _runtimes  # noqa: E402

from ninfer.plugins.qwen3_5.cuda import decode_graph  # noqa: E402
from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner  # noqa: E402

TOL = 2e-2 if CUDA else 1e-4
FUSED_KERNELS = ("add_norm_gemv", "gated_norm_gemv", "grouped_moe_decode_add_norm", "persistent_moe_decode")
MOE_PATHS = {  # the decode runner's options for each MoE block
    "persistent": dict(persistent_moe=True),
    "grouped": dict(persistent_moe=False, grouped_moe_rows=1),
    "separate": dict(persistent_moe=False, grouped_moe_rows=0),
}


def count_calls(monkeypatch) -> dict[str, int]:
    """Count the decode runner's calls of the norm-fused kernels (so the folded path provably runs)."""
    calls = dict.fromkeys(FUSED_KERNELS, 0)
    for name in FUSED_KERNELS:
        kernel = getattr(decode_graph, name)

        def counted(*args, _name=name, _kernel=kernel, **kwargs):
            calls[_name] += 1
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(decode_graph, name, counted)
    return calls


@pytest.mark.parametrize(
    ("preset", "rows", "moe"),
    [("tiny-moe", 1, "persistent"), ("tiny-moe", 1, "grouped"), ("tiny-moe", 2, "separate"), ("tiny", 2, "separate")],
)
def test_folded_norms_match_separate_norm_launches(preset, rows, moe, monkeypatch):
    torch.manual_seed(0)
    reference, model, fused = _runtimes(preset)
    config = model.config
    vocab = config.vocab_size
    members = list(range(rows))
    caches = Caches(reference, rows)
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (7, 19)[:rows]]
    with torch.no_grad():
        reference.forward(caches.batch(members, prompts), caches.kv, caches.state)
    folded_caches, graph_caches = caches.clone(), caches.clone()
    separate = DecodeGraphRunner(model, fused, use_graphs=False, **MOE_PATHS["separate"])
    folded = DecodeGraphRunner(model, fused, use_graphs=False, norm_gemv_rows=8, **MOE_PATHS[moe])
    graphs = DecodeGraphRunner(model, fused, use_graphs=True, norm_gemv_rows=8, **MOE_PATHS[moe]) if CUDA else None
    calls = count_calls(monkeypatch)
    steps = 3 if CUDA else 2
    for step in range(steps):
        tokens = [[int(t)] for t in torch.randint(0, vocab, (rows,))]
        expected = separate.forward(caches.batch(members, tokens), caches.kv, caches.state)
        got = folded.forward(folded_caches.batch(members, tokens), folded_caches.kv, folded_caches.state)
        assert rel_err(got.logits, expected.logits) < TOL, step
        assert rel_err(got.hidden, expected.hidden) < TOL, step
        if graphs is not None:  # the first step runs eagerly and captures, the later ones replay
            replayed = graphs.forward(graph_caches.batch(members, tokens), graph_caches.kv, graph_caches.state)
            assert rel_err(replayed.logits, got.logits) < 1e-6, step
    for ours, theirs in [
        *zip(folded_caches.state.ssm, caches.state.ssm),
        *zip(folded_caches.state.conv, caches.state.conv),
        *zip(folded_caches.kv.key, caches.kv.key),
        *zip(folded_caches.kv.value, caches.kv.value),
    ]:
        assert rel_err(ours, theirs) < TOL
    layers = config.num_hidden_layers
    recurrent = sum(1 for kind in config.layer_types if kind != decode_graph.FULL_ATTENTION)
    eager_steps = steps if graphs is None else steps + 2  # graphs: their first (eager) step and the capture
    assert calls["gated_norm_gemv"] == recurrent * eager_steps
    assert calls["grouped_moe_decode_add_norm"] == (layers * eager_steps if moe == "grouped" else 0)
    assert calls["persistent_moe_decode"] == (layers * eager_steps if moe == "persistent" else 0)
    lm_head = 1  # the final norm folds into the lm_head GEMV (at one row also in the separate step)
    separate_lm_heads = steps if rows == 1 else 0
    folded_calls = (layers * (2 if moe == "separate" else 1) + lm_head) * eager_steps
    assert calls["add_norm_gemv"] == folded_calls + separate_lm_heads


@pytest.mark.parametrize("option", ["norm_gemv_rows", "down_gemv_rows", "out_gemv_rows"])
def test_row_thresholds_must_not_be_negative(option):
    _, model, fused = _runtimes("tiny")
    with pytest.raises(ValueError, match=option):
        DecodeGraphRunner(model, fused, use_graphs=False, **{option: -1})
