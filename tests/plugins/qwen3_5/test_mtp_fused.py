"""The MTP draft on the fused kernels (``Qwen35MTP.fused_step``, ``MTPDraftRunner``: used when the runtime has a
decode runner) against the generic MTP forward (``Qwen35MTP.forward``) on the same weights: same proposals, same
hidden states, same MTP KV.

Runs on CUDA, or on the CPU in Triton's interpreter when ``TRITON_INTERPRET=1``; otherwise it is skipped. fp32, so
the two paths agree to rounding and the greedy drafts exactly. The CUDA-graph test needs CUDA.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from kernel_support import DEVICE, needs_cuda_graphs, rel_err, skip_module_without_triton

from ninfer.engine import decoding_sequence as bench_sequence
from ninfer.core.runtime import text_positions
from ninfer.engine.batching import build_batch
from ninfer.engine.commit import commit_sampled
from ninfer.core.runtime import KVCache, StateCache
from ninfer.plugins.qwen3_5.speculative.mtp import Qwen35MTP
from ninfer.plugins.qwen3_5.speculative.mtp_drafter import MTPDrafter
from ninfer.plugins.qwen3_5.model.presets import preset_config
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.model.synthetic import (
    InMemorySource,
    build_runtime,
    random_mtp_weights,
    random_text_weights,
)

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner  # noqa: E402
from ninfer.plugins.qwen3_5.model.fused import fuse_model  # noqa: E402
from ninfer.plugins.qwen3_5.cuda.mtp_graph import MTPDraftRunner  # noqa: E402

PAGE_SIZE = 16
PAGES_PER_ROW = 4
K = 3


def _runtimes(preset: str, *, graphs: bool = False) -> tuple[Qwen35Runtime, Qwen35Runtime]:
    """(with a decode runner: the fused draft, without: the generic MTP steps), one fp32 model."""
    config = {**preset_config(preset), "mtp_num_hidden_layers": 1}
    tensors = random_text_weights(config, device=DEVICE, dtype=torch.float32, seed=3)
    tensors.update(random_mtp_weights(config, device=DEVICE, dtype=torch.float32, seed=3))
    with torch.no_grad():  # move norms away from their init values so every weight matters
        for name, tensor in tensors.items():
            if "norm" in name:
                tensor.add_(torch.randn_like(tensor) * 0.2)
    runtime = build_runtime(InMemorySource(preset, config, tensors), dtype=torch.float32, device=DEVICE,
                            cuda_graphs=graphs)
    assert runtime.mtp is not None
    if runtime.decoder is None:
        model, fused = fuse_model(runtime.model)
        decoder = DecodeGraphRunner(model, fused, use_graphs=False)
    else:
        model, decoder = runtime.model, runtime.decoder
    weights = runtime.mtp.weights
    return Qwen35Runtime(model, Qwen35MTP(model, weights), decoder), Qwen35Runtime(model, Qwen35MTP(model, weights))


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def runtimes(request):
    torch.manual_seed(0)
    return _runtimes(request.param)


def _rows_with_tails(runtime: Qwen35Runtime, drafters, lengths, tails, *, bind: bool = True):
    """Sequences of ``lengths`` prompt tokens, prefilled; each drafter holds the MTP KV of every prompt position but
    the last ``tails[i]`` ones (written on the generic path), whose trunk hidden states are its tail. ``bind``: give
    the drafters a fresh KV pool first (else they keep theirs, and their captured graphs)."""
    vocab = runtime.config.vocab_size
    pages = torch.randperm(len(lengths) * PAGES_PER_ROW).view(len(lengths), PAGES_PER_ROW).tolist()
    rows = [
        bench_sequence(index, torch.randint(0, vocab, (n,)).tolist(), 8, index, pages[index], runtime, K)
        for index, n in enumerate(lengths)
    ]
    for drafter in drafters if bind else ():
        drafter.bind(len(lengths) * PAGES_PER_ROW, PAGE_SIZE)
    kv = KVCache.allocate(runtime.spec, len(lengths) * PAGES_PER_ROW, PAGE_SIZE)
    state = StateCache.allocate(runtime.spec, len(lengths))
    with torch.no_grad():
        for seq, tail in zip(rows, tails):
            hidden = runtime.forward(build_batch([seq], [seq.tokens], "none", return_hidden=True), kv, state).hidden
            seq.fed = seq.prompt_len
            commit_sampled(seq, int(runtime.model.logits(hidden[-1:])[0].argmax()), time.monotonic())
            written = seq.prompt_len - tail
            for drafter in drafters:
                drafter.observe(seq, 0, hidden[:written])
                drafter._write_tail([seq], [drafter._rows[id(seq)]], keep_last=False)
                drafter.observe(seq, written, hidden[written:])
                assert drafter.ready(seq)
    return rows


@pytest.mark.parametrize("q", [1, 3])
def test_fused_step_matches_the_generic_forward(runtimes, q):
    fused_runtime, generic_runtime = runtimes
    mtp, config = fused_runtime.mtp, fused_runtime.config
    contexts = [5, 21, 0]
    rows = len(contexts)
    generator = torch.Generator().manual_seed(q)
    token_ids = torch.randint(0, config.vocab_size, (rows * q,), generator=generator).to(DEVICE)
    hidden = torch.randn(rows * q, config.hidden_size, generator=generator).to(DEVICE)
    tables = torch.randperm(rows * PAGES_PER_ROW).view(rows, PAGES_PER_ROW).to(DEVICE)
    caches = []
    for _ in range(2):  # the same MTP KV history for both paths
        kv = KVCache.allocate(mtp.spec, rows * PAGES_PER_ROW, PAGE_SIZE)
        for cache in (*kv.key, *kv.value):
            cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(7)))
        caches.append(kv)
    head = fused_runtime.model.lm_head
    tokens, out = mtp.fused_step(
        fused_runtime.decoder, token_ids, hidden, torch.tensor(contexts, device=DEVICE), tables, caches[0], head,
        tokens_per_row=q,
    )
    positions = [c + i for c in contexts for i in range(q)]
    _, reference = generic_runtime.mtp.forward(
        token_ids, hidden, text_positions(positions, DEVICE), [q] * rows, contexts, tables.int(), caches[1],
        logits="none",
    )
    last = reference[q - 1 :: q]
    assert out.shape == (rows, config.hidden_size)
    assert rel_err(out, last) < 1e-4
    assert torch.equal(tokens, F.linear(last, head).argmax(dim=-1))
    for fused_cache, generic_cache in zip((*caches[0].key, *caches[0].value), (*caches[1].key, *caches[1].value)):
        assert rel_err(fused_cache, generic_cache) < 1e-5  # every tail token's KV written, nothing else touched


@pytest.mark.parametrize("tails", [(1, 1, 1), (K + 1, K + 1, K + 1)])
def test_uniform_tails_draft_in_one_fused_chain(runtimes, tails, monkeypatch):
    fused_runtime, generic_runtime = runtimes
    drafters = [MTPDrafter(fused_runtime, K), MTPDrafter(generic_runtime, K)]
    rows = _rows_with_tails(generic_runtime, drafters, (9, 23, 40), tails)

    def no_generic_step(*args, **kwargs):
        raise AssertionError("a uniform batch took the generic MTP path")

    monkeypatch.setattr(drafters[0], "_write_tail", no_generic_step)
    fused_drafts, generic_drafts = (drafter.draft(rows, [K] * len(rows)) for drafter in drafters)
    assert [d.tokens for d in fused_drafts] == [d.tokens for d in generic_drafts]
    assert all(len(d.tokens) == K for d in fused_drafts)
    fused_kv, generic_kv = (drafter._kv for drafter in drafters)
    assert rel_err(fused_kv.key[0], generic_kv.key[0]) < 1e-4  # the tail and every chained position
    assert rel_err(fused_kv.value[0], generic_kv.value[0]) < 1e-4
    for drafter in drafters:  # the tail is consumed: the next round's tail starts at the pending token
        assert all(drafter._rows[id(seq)].tail is None and drafter._rows[id(seq)].tail_start == seq.fed
                   for seq in rows)


def test_mixed_tails_without_pad_tails_draft_what_the_generic_path_drafts(runtimes):
    fused_runtime, generic_runtime = runtimes
    for counts in ([K, K, K], [K, 1, 2]):  # tails written on the generic path, then the fused chain
        drafters = [MTPDrafter(fused_runtime, K, pad_tails=False), MTPDrafter(generic_runtime, K)]
        rows = _rows_with_tails(generic_runtime, drafters, (9, 23, 40), (1, K + 1, 2))
        fused_drafts, generic_drafts = (drafter.draft(rows, counts) for drafter in drafters)
        assert [d.tokens for d in fused_drafts] == [d.tokens for d in generic_drafts]
        assert [len(d.tokens) for d in fused_drafts] == counts


def test_the_draft_runner_rejects_shapes_it_cannot_take(runtimes):
    fused_runtime, _ = runtimes
    runner = MTPDraftRunner(fused_runtime.mtp, fused_runtime.decoder, fused_runtime.model.lm_head,
                            max_tokens_per_row=K + 1)
    assert runner.supports(2, K + 1) and not runner.supports(2, K + 2) and not runner.supports(0, 1)
    drafter = MTPDrafter(fused_runtime, K)
    rows = _rows_with_tails(fused_runtime, [drafter], (9, 23), (2, 2))
    batch = build_batch(rows, [[1, 2], [3]], "none")
    with pytest.raises(ValueError, match="tail tokens in every row"):
        runner.draft(batch, [torch.zeros(2, fused_runtime.config.hidden_size)] * 2, drafter._kv, K)


def graph_eager_and_generic_runtimes() -> tuple[Qwen35Runtime, Qwen35Runtime, Qwen35Runtime]:
    """The tiny model on the CUDA decode runner with graphs, on the same runner without them, and on the generic
    path."""
    graph_runtime, generic_runtime = _runtimes("tiny", graphs=True)
    assert graph_runtime.decoder is not None and graph_runtime.decoder.use_graphs
    eager_decoder = DecodeGraphRunner(graph_runtime.model, graph_runtime.decoder.fused, use_graphs=False)
    return graph_runtime, Qwen35Runtime(graph_runtime.model, graph_runtime.mtp, eager_decoder), generic_runtime


@needs_cuda_graphs
def test_captured_drafts_replay_what_the_eager_kernels_draft():
    torch.manual_seed(0)
    graph_runtime, eager_runtime, generic_runtime = graph_eager_and_generic_runtimes()
    drafters = [MTPDrafter(graph_runtime, K), MTPDrafter(eager_runtime, K), MTPDrafter(generic_runtime, K)]
    for drafter in drafters:
        drafter.bind(2 * PAGES_PER_ROW, PAGE_SIZE)
    runner = drafters[0].fused_runner
    assert runner is not None
    for lengths in ((9, 23), (17, 40), (30, 12)):  # each shape: eager + capture, then replays on new contents
        for q in range(1, K + 2):
            replay = (2, q, K) in runner.captured()
            rows = _rows_with_tails(generic_runtime, drafters, lengths, (q, q), bind=False)
            graph, eager, generic = (drafter.draft(rows, [K, K]) for drafter in drafters)
            assert [d.tokens for d in graph] == [d.tokens for d in eager] == [d.tokens for d in generic], (lengths, q)
            assert rel_err(drafters[0]._kv.key[0], drafters[1]._kv.key[0]) < 1e-5, (lengths, q, replay)
            assert (2, q, K) in runner.captured()
    assert sorted(runner.captured()) == [(2, q, K) for q in range(1, K + 2)]
    drafters[0].bind(2 * PAGES_PER_ROW, PAGE_SIZE)
    assert runner.captured() == []  # graphs bound to the old KV are gone
