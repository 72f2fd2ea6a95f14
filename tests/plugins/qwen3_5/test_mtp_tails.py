"""The MTP draft of rows whose tails (and draft counts) differ, in one fused chain (``pad_tails``): each tail padded to
the batch's longest by repeating its last real token, the chain run to the largest count.

Oracles: the generic MTP forward (``Qwen35MTP.forward``) and the generic drafter on the same weights (proposals, the
MTP KV of every real position, and every other KV slot left as it was, byte for byte, bar the scratch entries of rows
that draft fewer tokens, which must stay inside the positions the round's verify writes); the eager kernels for the
CUDA graphs; plain greedy decoding for whole engine runs.

Runs on CUDA, or on the CPU in Triton's interpreter when ``TRITON_INTERPRET=1``; otherwise it is skipped. fp32, so
the fused and generic paths agree to rounding and the greedy drafts exactly. The CUDA-graph test needs CUDA.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from kernel_support import CUDA, DEVICE, needs_cuda_graphs, rel_err, skip_module_without_triton

from ninfer.core.runtime import text_positions
from ninfer.core.drafting import Draft
from ninfer.core.runtime import KVCache, LoadOptions

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.core.artifact.source import open_model_source  # noqa: E402
from ninfer.server.compose import artifact_tokenizer  # noqa: E402
from ninfer.core.plugins import load_plugin_manager  # noqa: E402
from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact  # noqa: E402
from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner  # noqa: E402
from ninfer.plugins.qwen3_5.model.fused import fuse_model  # noqa: E402
from ninfer.plugins.qwen3_5.speculative.mtp import Qwen35MTP  # noqa: E402
from ninfer.plugins.qwen3_5.speculative.mtp_drafter import MTPDrafter  # noqa: E402
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime  # noqa: E402
from speculation_support import greedy_plain_then_speculative  # noqa: E402
from test_mtp_fused import (  # noqa: E402
    K, PAGE_SIZE, PAGES_PER_ROW, _rows_with_tails, _runtimes, graph_eager_and_generic_runtimes,
)

LENGTHS = (9, 23, 40)  # prompt lengths of the three rows
TAILS = (1, 2, K + 1)  # their tails: the pending token's position plus 0, 1 and K accepted drafts


@pytest.fixture(scope="module")
def runtimes():
    torch.manual_seed(0)
    return _runtimes("tiny")


def _sentinel(kv: KVCache, seed: int = 11) -> None:
    """Fill every KV slot with random values, so a slot no step should write is recognisable."""
    generator = torch.Generator().manual_seed(seed)
    for cache in (*kv.key, *kv.value):
        cache.copy_(torch.randn(cache.shape, generator=generator))


def _slots(pages: list[int], positions: range) -> set[tuple[int, int]]:
    return {(pages[p // PAGE_SIZE], p % PAGE_SIZE) for p in positions}


def _assert_kv(got: KVCache, expected: KVCache, before: KVCache, real: set, scratch: set) -> None:
    """``real`` slots (page, offset) hold what the generic path wrote; ``scratch`` slots anything; every other slot
    is exactly as it was ``before``, in both caches."""
    for got_t, expected_t, before_t in zip((*got.key, *got.value), (*expected.key, *expected.value),
                                           (*before.key, *before.value)):
        index = torch.tensor(sorted(real))
        assert rel_err(got_t[index[:, 0], index[:, 1]], expected_t[index[:, 0], index[:, 1]]) < 1e-4
        untouched = torch.ones(got_t.shape[:2], dtype=torch.bool)
        for page, offset in real | scratch:
            untouched[page, offset] = False
        untouched = untouched.to(got_t.device)
        assert torch.equal(got_t[untouched], before_t[untouched])
        assert torch.equal(expected_t[untouched], before_t[untouched])


def test_a_padded_fused_step_is_the_generic_forward_of_the_real_tokens(runtimes):
    """Rows of 1, 3 and 2 real tokens padded to 3 with *garbage* padding inputs: the padding tokens' own ids and
    hidden states reach nothing (their K/V is their row's last real token's, and each row carries on from that token
    at its own index), so the outputs and the KV are the generic forward's of the real tokens alone."""
    fused_runtime, generic_runtime = runtimes
    mtp, config, head = fused_runtime.mtp, fused_runtime.config, fused_runtime.model.lm_head
    contexts, lens, q = [5, 21, 0], [1, 3, 2], 3
    rows = len(lens)
    generator = torch.Generator().manual_seed(1)
    token_ids = torch.randint(0, config.vocab_size, (rows * q,), generator=generator).to(DEVICE)
    hidden = torch.randn(rows * q, config.hidden_size, generator=generator).to(DEVICE)
    real = torch.tensor([row * q + t for row, n in enumerate(lens) for t in range(n)], device=DEVICE)
    pages = torch.randperm(rows * PAGES_PER_ROW).view(rows, PAGES_PER_ROW)
    caches = [KVCache.allocate(mtp.spec, rows * PAGES_PER_ROW, PAGE_SIZE) for _ in range(3)]
    for kv in caches:
        _sentinel(kv)
    tokens, out = mtp.fused_step(
        fused_runtime.decoder, token_ids, hidden, torch.tensor(contexts, device=DEVICE), pages.to(DEVICE), caches[0],
        head, tokens_per_row=q, last_offsets=torch.tensor([n - 1 for n in lens], device=DEVICE),
    )
    positions = [c + t for c, n in zip(contexts, lens) for t in range(n)]
    _, reference = generic_runtime.mtp.forward(
        token_ids[real], hidden[real], text_positions(positions, DEVICE), lens, contexts, pages.int().to(DEVICE),
        caches[1], logits="none",
    )
    last = reference[torch.tensor(lens).cumsum(0) - 1]
    assert rel_err(out, last) < 1e-4
    assert torch.equal(tokens, F.linear(last, head).argmax(dim=-1))
    written = set().union(*(_slots(pages[r].tolist(), range(c, c + n)) for r, (c, n) in enumerate(zip(contexts, lens))))
    _assert_kv(caches[0], caches[1], caches[2], written, set())


def test_the_runner_takes_mixed_tails_and_close_counts_only_with_pad_tails(runtimes):
    from ninfer.plugins.qwen3_5.cuda.mtp_graph import MTPDraftRunner

    fused_runtime, _ = runtimes

    def runner(pad_tails: bool, k: int = K) -> MTPDraftRunner:
        return MTPDraftRunner(fused_runtime.mtp, fused_runtime.decoder, fused_runtime.model.lm_head,
                              max_tokens_per_row=k + 1, pad_tails=pad_tails)

    plain, padded, padded5 = runner(False), runner(True), runner(True, 5)
    assert plain.takes([2, 2], [K, K]) and not plain.takes([1, 2], [K, K]) and not plain.takes([2, 2], [K, 1])
    assert padded.takes([1, 2, K + 1], [K, K, K]) and padded.takes([1, K + 1], [1, K]) and padded.takes([3], [2])
    assert not padded.takes([1, K + 2], [K, K])  # a tail longer than k + 1: the generic path
    assert not padded.takes([], []) and not padded.takes([1, 2], [K, 0])
    # a chain of 5 drafts: rows of 3 or more drafts share it; a row of 2 would write entries past its verify's reach
    assert padded5.takes([1, 6], [5, 3]) and not padded5.takes([1, 6], [5, 2]) and padded5.takes([1, 6], [4, 2])


@pytest.mark.parametrize("counts", [(K, K, K), (1, K, 2)])
def test_mixed_tails_draft_in_one_padded_chain_what_the_generic_path_drafts(runtimes, counts, monkeypatch):
    fused_runtime, generic_runtime = runtimes
    drafters = [MTPDrafter(fused_runtime, K), MTPDrafter(generic_runtime, K)]
    for drafter in drafters:
        drafter.bind(len(LENGTHS) * PAGES_PER_ROW, PAGE_SIZE)
        _sentinel(drafter._kv)
    rows = _rows_with_tails(generic_runtime, drafters, LENGTHS, TAILS, bind=False)
    before = KVCache(PAGE_SIZE, [t.clone() for t in drafters[0]._kv.key], [t.clone() for t in drafters[0]._kv.value])

    def no_generic_step(*args, **kwargs):
        raise AssertionError("a padded batch took the generic MTP path")

    monkeypatch.setattr(drafters[0], "_write_tail", no_generic_step)
    fused_drafts, generic_drafts = (drafter.draft(rows, list(counts)) for drafter in drafters)
    assert [d.tokens for d in fused_drafts] == [d.tokens for d in generic_drafts]
    assert [len(d.tokens) for d in fused_drafts] == list(counts)
    real, scratch = set(), set()
    for seq, tail, count in zip(rows, TAILS, counts):
        fed = seq.fed  # the pending token's position
        real |= _slots(seq.pages, range(fed - tail, fed + count - 1))  # the tail and the row's own chained entries
        # the extra chained steps of a row with fewer drafts: inside the positions its verify writes (fed..fed+count)
        scratch |= _slots(seq.pages, range(fed + count - 1, min(fed + max(counts) - 1, fed + count + 1)))
    _assert_kv(drafters[0]._kv, drafters[1]._kv, before, real, scratch)
    for drafter in drafters:  # every tail consumed: the next round's starts at the pending token
        assert all(drafter._rows[id(seq)].tail is None and drafter._rows[id(seq)].tail_start == seq.fed
                   for seq in rows)


@needs_cuda_graphs
def test_captured_padded_drafts_replay_what_the_eager_kernels_draft():
    torch.manual_seed(0)
    graph_runtime, eager_runtime, generic_runtime = graph_eager_and_generic_runtimes()
    drafters = [MTPDrafter(graph_runtime, K), MTPDrafter(eager_runtime, K),
                MTPDrafter(generic_runtime, K)]
    for drafter in drafters:
        drafter.bind(len(LENGTHS) * PAGES_PER_ROW, PAGE_SIZE)
    runner = drafters[0].fused_runner
    assert runner is not None
    shapes = [(TAILS, (K, K, K)), ((K + 1, 1, 2), (K, K, K)), ((2, K + 1, K + 1), (1, K, 2)), ((1, 2, 1), (K, 2, K))]
    for lengths in (LENGTHS, (17, 40, 12)):  # the second pass replays every shape on new contents
        for tails, counts in shapes:
            rows = _rows_with_tails(generic_runtime, drafters, lengths, tails, bind=False)
            graph, eager, generic = (drafter.draft(rows, list(counts)) for drafter in drafters)
            assert [d.tokens for d in graph] == [d.tokens for d in eager] == [d.tokens for d in generic], tails
            for got, expected in zip((*drafters[0]._kv.key, *drafters[0]._kv.value),
                                     (*drafters[1]._kv.key, *drafters[1]._kv.value)):
                assert rel_err(got, expected) < 1e-5, (lengths, tails)
    assert sorted(runner.captured(padded=True)) == [(3, 2, K), (3, K + 1, K)]
    assert runner.captured() == []  # no uniform batch


# -- whole engine runs -------------------------------------------------------------------------------------------


class LockstepDrafter:
    """The padded fused drafter and the generic one fed the same states every round. Their proposals are recorded
    (to be equal), as is the largest relative error between their MTP KV of every row's committed positions, in the
    engine's pages; the proposals are then replaced by the plain greedy continuation, wrong at pseudo-random output
    positions, so rows accept different numbers of drafts and the next round's tails differ."""

    def __init__(self, fused: MTPDrafter, generic: MTPDrafter, references: dict[tuple[int, ...], list[int]]) -> None:
        self.fused, self.generic, self.references = fused, generic, references
        self.draft_tokens = fused.draft_tokens
        self.proposals: list[tuple[list, list]] = []
        self.kv_errors: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fused, name)

    def bind(self, num_pages: int, page_size: int) -> list[KVCache]:
        return [*self.fused.bind(num_pages, page_size), *self.generic.bind(num_pages, page_size)]

    def observe(self, seq: Any, start: int, hidden: torch.Tensor) -> None:
        self.fused.observe(seq, start, hidden)
        self.generic.observe(seq, start, hidden)

    def forget(self, seq: Any) -> None:
        self.fused.forget(seq)
        self.generic.forget(seq)

    def snapshot(self, seq: Any) -> Any:
        self.generic.snapshot(seq)
        return self.fused.snapshot(seq)

    def restore(self, seq: Any, snapshot: Any) -> None:
        self.fused.restore(seq, snapshot)
        self.generic.restore(seq, snapshot)

    def draft(self, rows: Any, counts: Any) -> list[Draft]:
        fused, generic = self.fused.draft(rows, counts), self.generic.draft(rows, counts)
        self.proposals.append(([d.tokens for d in fused], [d.tokens for d in generic]))
        slots = torch.tensor(sorted(set().union(*(_slots(seq.pages, range(seq.fed)) for seq in rows))))
        for got, expected in zip((*self.fused._kv.key, *self.fused._kv.value),
                                 (*self.generic._kv.key, *self.generic._kv.value)):
            self.kv_errors.append(rel_err(got[slots[:, 0], slots[:, 1]], expected[slots[:, 0], slots[:, 1]]))
        drafts = []
        for seq, count in zip(rows, counts):
            reference, start = self.references[tuple(seq.prompt)], len(seq.tokens)
            tokens = [reference[p] if p < len(reference) else 0 for p in range(start, start + count)]
            if random.Random(start * 31 + seq.prompt_len).random() < 0.5:  # one wrong draft, the rest cut off
                cut = random.Random(start).randrange(count)
                tokens[cut] = (tokens[cut] + 1) % 1000
            drafts.append(Draft(tuple(tokens)))
        return drafts


RUN_PROMPTS = [[random.Random(n).randrange(200, 150_000) for _ in range(n)] for n in (5, 17, 9, 12)]
RUN_MAX_TOKENS = [30, 26, 34, 28]


def test_greedy_speculation_with_padded_tails_equals_plain_greedy(tmp_path):
    """Four concurrent rows: every round's padded fused draft equals the generic drafter's, through the engine's
    real page tables, and the outputs equal plain greedy. On CUDA the load path's runtime (CUDA graphs, fp32), in
    the interpreter an eager fused draft runner next to the CPU trunk."""
    registries = load_plugin_manager(entry_points=False).registries
    options = TinyOptions(family="qwen3_5", seed=0, mtp=True)
    artifact = open_model_source(write_tiny_artifact(tmp_path / "mtp.ninfer", options, registries))
    try:
        load = LoadOptions(device="cuda", dtype="float32") if CUDA else LoadOptions()
        runtime = registries.family_for(artifact.manifest).require("load_runtime")(artifact, load)
        model, weights = runtime.model, runtime.mtp.weights
        with torch.no_grad():  # the tiny init (N(0, .02)) leaves the MTP's attention nearly silent: make it count
            weights.layers[0].mixer.o_proj.mul_(50.0)
        if CUDA:
            fused_runtime = runtime
        else:
            fused_model, fused = fuse_model(model)
            decoder = DecodeGraphRunner(fused_model, fused, use_graphs=False)
            fused_runtime = Qwen35Runtime(fused_model, Qwen35MTP(fused_model, weights), decoder)
        generic = MTPDrafter(Qwen35Runtime(model, Qwen35MTP(model, weights)), K)
        fused_drafter = MTPDrafter(fused_runtime, K)
        runner = fused_drafter.fused_runner
        assert runner is not None and generic.fused_runner is None
        shapes: list[list[int]] = []
        real_draft = runner.draft
        runner.draft = lambda batch, *args: shapes.append(list(batch.query_lens)) or real_draft(batch, *args)
        tiny = (artifact, runtime, artifact_tokenizer(artifact))
        plain, results, drafter = greedy_plain_then_speculative(
            tiny, RUN_PROMPTS, RUN_MAX_TOKENS, lambda references: LockstepDrafter(fused_drafter, generic, references)
        )
    finally:
        artifact.close()
    for result, base in zip(results, plain):
        assert result.output_token_ids == base.output_token_ids
        assert result.speculative.rounds > 0
    assert all(fused == generic for fused, generic in drafter.proposals)
    assert max(drafter.kv_errors) < 1e-4
    assert sum(len(set(lens)) > 1 for lens in shapes) >= 3  # rounds with padded tails
