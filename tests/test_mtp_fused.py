"""The MTP drafter's chained steps on the fused decode kernels (``Qwen35MTP.decode_step``, used when the runtime has a
CUDA decode runner) against the generic MTP steps on the same weights: same drafts, same MTP KV.

Runs on CUDA, or on the CPU in Triton's interpreter when ``TRITON_INTERPRET=1``; otherwise it is skipped. fp32, so
the two paths agree to rounding and the greedy drafts exactly.
"""

from __future__ import annotations

import time

import pytest
import torch

from ninfer.bench_spec import bench_sequence
from ninfer.core.engine.batching import build_batch
from ninfer.core.engine.commit import commit_sampled
from ninfer.core.runtime import KVCache, StateCache
from ninfer.kernels.triton import triton_available
from ninfer.plugins.qwen3_5.mtp import Qwen35MTP
from ninfer.plugins.qwen3_5.mtp_drafter import MTPDrafter
from ninfer.plugins.qwen3_5.presets import preset_config
from ninfer.plugins.qwen3_5.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.synthetic import InMemorySource, build_runtime, random_mtp_weights, random_text_weights

pytestmark = pytest.mark.gpu

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
if not triton_available(DEVICE):
    pytest.skip("needs Triton on a CUDA device (or TRITON_INTERPRET=1)", allow_module_level=True)

from ninfer.plugins.qwen3_5.decode_graph import DecodeGraphRunner  # noqa: E402
from ninfer.plugins.qwen3_5.fused import fuse_model  # noqa: E402

PAGE_SIZE = 16
PAGES_PER_ROW = 4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _runtimes(preset: str) -> tuple[Qwen35Runtime, Qwen35Runtime]:
    """(with the decode runner: drafts chain on the fused kernels, without: the generic MTP steps), one model."""
    config = {**preset_config(preset), "mtp_num_hidden_layers": 1}
    tensors = random_text_weights(config, device=DEVICE, dtype=torch.float32, seed=3)
    tensors.update(random_mtp_weights(config, device=DEVICE, dtype=torch.float32, seed=3))
    with torch.no_grad():  # move norms away from their init values so every weight matters
        for name, tensor in tensors.items():
            if "norm" in name:
                tensor.add_(torch.randn_like(tensor) * 0.2)
    runtime = build_runtime(InMemorySource(preset, config, tensors), dtype=torch.float32, device=DEVICE,
                            cuda_graphs=False)
    assert runtime.mtp is not None
    if runtime.decoder is None:
        model, fused = fuse_model(runtime.model)
        decoder = DecodeGraphRunner(model, fused, use_graphs=False)
    else:
        model, decoder = runtime.model, runtime.decoder
    weights = runtime.mtp.weights
    return Qwen35Runtime(model, Qwen35MTP(model, weights), decoder), Qwen35Runtime(model, Qwen35MTP(model, weights))


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_chained_steps_on_the_decode_kernels_match_the_generic_steps(preset, monkeypatch):
    torch.manual_seed(0)
    fused_runtime, generic_runtime = _runtimes(preset)
    k, lengths = 4, (5, 17, 30)
    vocab = fused_runtime.config.vocab_size
    pages = torch.randperm(len(lengths) * PAGES_PER_ROW).view(len(lengths), PAGES_PER_ROW).tolist()
    rows = [
        bench_sequence(index, torch.randint(0, vocab, (n,)).tolist(), 8, index, pages[index], generic_runtime, k)
        for index, n in enumerate(lengths)
    ]
    drafters = [MTPDrafter(runtime, k) for runtime in (fused_runtime, generic_runtime)]
    for drafter in drafters:
        drafter.bind(len(lengths) * PAGES_PER_ROW, PAGE_SIZE)
    kv = KVCache.allocate(generic_runtime.spec, len(lengths) * PAGES_PER_ROW, PAGE_SIZE)
    state = StateCache.allocate(generic_runtime.spec, len(lengths))
    with torch.no_grad():
        for seq in rows:  # the executor's drafting prefill: every prompt position's hidden state to the drafters
            hidden = generic_runtime.forward(build_batch([seq], [seq.tokens], "none", return_hidden=True), kv,
                                             state).hidden
            for drafter in drafters:
                drafter.observe(seq, 0, hidden)
            seq.fed = seq.prompt_len
            commit_sampled(seq, int(generic_runtime.model.logits(hidden[-1:])[0].argmax()), time.monotonic())
    fused_steps, generic_steps = {}, {}
    decode_step, generic_step = Qwen35MTP.decode_step, drafters[1]._step

    def recording_decode_step(self, *args, step, **kwargs):
        fused_steps[step] = decode_step(self, *args, step=step, **kwargs)
        return fused_steps[step]

    def recording_generic_step(*args):
        generic_steps[args[-1]] = generic_step(*args)
        return generic_steps[args[-1]]

    monkeypatch.setattr(Qwen35MTP, "decode_step", recording_decode_step)
    monkeypatch.setattr(drafters[1], "_step", recording_generic_step)
    fused_drafts, generic_drafts = (drafter.draft(rows, [k] * len(rows)) for drafter in drafters)
    assert sorted(fused_steps) == [1, 2, 3]  # the chained steps took the fused path, the generic drafter never did
    for step, (tokens, hidden) in fused_steps.items():
        logits, expected_hidden = generic_steps[step]
        assert rel_err(hidden, expected_hidden) < 1e-4, step
        assert torch.equal(tokens, logits.argmax(dim=-1)), step
    assert [d.tokens for d in fused_drafts] == [d.tokens for d in generic_drafts]
    assert all(len(d.tokens) == k for d in fused_drafts)
    fused_kv, generic_kv = (drafter._kv for drafter in drafters)
    assert rel_err(fused_kv.key[0], generic_kv.key[0]) < 1e-4  # every chained step wrote its position's KV
    assert rel_err(fused_kv.value[0], generic_kv.value[0]) < 1e-4
