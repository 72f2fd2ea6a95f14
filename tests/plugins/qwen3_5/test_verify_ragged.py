"""Every verify batch of a speculative round on the CUDA verify runner: ragged rows (fewer drafts near the output
limit, fallback rows of one token) padded to the batch's largest q, and the target layer outputs the DFlash drafters
ask for (``capture_layers``).

Oracles: the generic eager path on the same weights (logits, hidden states, the per-token states, layer outputs, and
the KV pages and state slots each forward leaves), the verify runner's eager forward for its CUDA graphs, and plain
greedy decoding for whole speculative runs (MTP, DFlash, DFlash2). Page tables are built as the engine builds them
(pages handed out on demand, lowest id first, tables zero-padded to the widest row), so a padded row's table points
past its own pages at another row's page, where no padding KV may land.

Runs on CUDA; without a GPU the eager kernels run in Triton's CPU interpreter when ``TRITON_INTERPRET=1``, otherwise
the module is skipped.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from kernel_support import CUDA, needs_cuda_graphs, rel_err, seed_each_test, skip_module_without_triton

from ninfer.core.runtime import ForwardBatch, KVCache, LoadOptions, StateCache

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.core.artifact.source import open_model_source  # noqa: E402
from ninfer.server.compose import artifact_tokenizer  # noqa: E402
from ninfer.core.drafting import Draft  # noqa: E402
from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact  # noqa: E402
from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner  # noqa: E402
from ninfer.plugins.qwen3_5.model.fused import fuse_model  # noqa: E402
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime  # noqa: E402
from ninfer.plugins.qwen3_5.cuda.verify_graph import VerifyGraphRunner, pad_batch  # noqa: E402
from speculation_support import drafter_for, greedy_plain_then_speculative, reference_drafts  # noqa: E402
from test_decode_graph import _runtimes  # noqa: E402
from test_verify_graph import TOL  # noqa: E402

PAGE_SIZE = 16
NUM_PAGES = 12

# three rows: prompts, then verify rounds (tokens per row, capture_layers). Row 0's prompt ends one token short of a
# page, so in round 1 its padding runs past its only page into the table's zero padding: page 0, its own first page;
# row 2 reaches 15 tokens and in round 6 pads into page 0 as well, which is row 0's
PROMPTS = (15, 16, 4)
ROUNDS = (
    ((1, 4, 2), ()),  # mixed q, a fallback row first
    ((4, 1, 4), ()),  # a fallback row among drafting rows (the same padded shape as round 1)
    ((2, 2, 1), (0, 2)),  # the short row last: nothing to compact, its slot to restore; layer outputs
    ((1, 1, 1), (3,)),  # every row a fallback step: uniform q = 1
    ((3, 3, 3), (1, 3)),  # uniform, with layer outputs
    ((2, 4, 1), (1,)),
)


class Rows:
    """The engine's bookkeeping for rows that all take part in every forward: each row's pages (handed out on demand,
    lowest free id first), length and state slot; page tables zero-padded to the widest row (``build_batch``)."""

    def __init__(self, rows: int) -> None:
        self.free = list(range(NUM_PAGES))
        self.pages: list[list[int]] = [[] for _ in range(rows)]
        self.lengths = [0] * rows
        self.slots = torch.arange(rows, 0, -1)  # row r owns slot rows - r; slot 0 belongs to no row

    def batch(self, chunks: list[list[int]], *, verify: bool, layers: tuple[int, ...] = ()) -> ForwardBatch:
        contexts = list(self.lengths)
        for row, chunk in enumerate(chunks):
            self.lengths[row] += len(chunk)
            while len(self.pages[row]) * PAGE_SIZE < self.lengths[row]:
                self.pages[row].append(self.free.pop(0))
        width = max(len(pages) for pages in self.pages)
        positions = torch.cat([torch.arange(c, c + len(chunk)) for c, chunk in zip(contexts, chunks)])
        return ForwardBatch(
            token_ids=torch.tensor([t for chunk in chunks for t in chunk]),
            positions=positions.expand(3, -1),
            query_lens=[len(chunk) for chunk in chunks],
            context_lens=contexts,
            page_tables=torch.tensor([pages + [0] * (width - len(pages)) for pages in self.pages], dtype=torch.int32),
            state_slots=self.slots,
            logits="all" if verify else "last",
            capture_states=verify,
            return_hidden=verify,
            capture_layers=layers,
        )

    def pads_past_its_pages(self, batch: ForwardBatch) -> bool:
        """Whether padding the batch to its largest q reaches past the pages some row owns."""
        q = max(batch.query_lens)
        return any(c + q > len(pages) * PAGE_SIZE for c, pages in zip(batch.context_lens, self.pages))


class Pools:
    """KV pages and state slots for the rows."""

    def __init__(self, runtime: Qwen35Runtime, rows: int) -> None:
        self.kv = KVCache.allocate(runtime.spec, NUM_PAGES, PAGE_SIZE)
        self.state = StateCache.allocate(runtime.spec, rows + 1)

    def clone(self) -> "Pools":
        copy = object.__new__(Pools)
        copy.kv = KVCache(self.kv.page_size, [t.clone() for t in self.kv.key], [t.clone() for t in self.kv.value])
        copy.state = StateCache([t.clone() for t in self.state.conv], [t.clone() for t in self.state.ssm])
        return copy


def _assert_same_output(got, expected, tol):
    assert got.logits.shape == expected.logits.shape and rel_err(got.logits, expected.logits) < tol
    assert got.hidden.shape == expected.hidden.shape and rel_err(got.hidden, expected.hidden) < tol
    for kind in ("conv", "ssm"):
        for got_state, expected_state in zip(getattr(got.states, kind), getattr(expected.states, kind)):
            assert got_state.shape == expected_state.shape and rel_err(got_state, expected_state) < tol
    if expected.layer_hidden is None:
        assert got.layer_hidden is None
    else:
        assert got.layer_hidden.shape == expected.layer_hidden.shape
        assert rel_err(got.layer_hidden, expected.layer_hidden) < tol


def _assert_same_pools(got: Pools, expected: Pools, tol):
    """Every KV page (also those no forward should write) and every state slot."""
    for got_tensor, expected_tensor in zip(
        (*got.kv.key, *got.kv.value, *got.state.conv, *got.state.ssm),
        (*expected.kv.key, *expected.kv.value, *expected.state.conv, *expected.state.ssm),
    ):
        assert rel_err(got_tensor, expected_tensor) < tol


def _prefilled(reference: Qwen35Runtime, vocab: int) -> tuple[Rows, Pools]:
    rows, pools = Rows(len(PROMPTS)), Pools(reference, len(PROMPTS))
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in PROMPTS]
    with torch.no_grad():
        reference.forward(rows.batch(prompts, verify=False), pools.kv, pools.state)
    return rows, pools


_seed = seed_each_test(99)


@pytest.mark.parametrize(
    ("preset", "dtype"),
    [
        pytest.param("tiny", torch.float32, id="tiny-fp32"),
        pytest.param(
            "tiny-moe", torch.float32, id="tiny-moe-fp32",
            marks=pytest.mark.skipif(not CUDA, reason="slow in the interpreter; the padding is the dense model's"),
        ),
        pytest.param(
            "tiny", torch.bfloat16, id="tiny-bf16",
            marks=pytest.mark.skipif(not CUDA, reason="the interpreter's bf16 tl.dot is not faithful"),
        ),
    ],
)
def test_ragged_and_layer_capturing_batches_match_the_generic_path(preset, dtype):
    tol = TOL[dtype]
    reference, model, fused = _runtimes(preset, dtype)
    vocab = model.config.vocab_size
    rows, expected_pools = _prefilled(reference, vocab)
    pools = expected_pools.clone()
    runner = VerifyGraphRunner(model, fused, use_graphs=False)
    past_pages = []
    for step, (lens, layers) in enumerate(ROUNDS):
        batch = rows.batch([torch.randint(0, vocab, (n,)).tolist() for n in lens], verify=True, layers=layers)
        past_pages.append(rows.pads_past_its_pages(batch))
        assert runner.supports(batch), step
        with torch.no_grad():
            expected = reference.forward(batch, expected_pools.kv, expected_pools.state)
        got = runner.forward(batch, pools.kv, pools.state)
        _assert_same_output(got, expected, tol)
        _assert_same_pools(pools, expected_pools, tol)
    assert past_pages[0] and past_pages[5]  # the scenario really pads into pages the rows do not own


@needs_cuda_graphs
def test_ragged_graphs_replay_like_the_eager_runner():
    """Ragged and layer-capturing shapes are captured and replayed (rounds 1 and 2 share one padded shape with other
    row lengths), and match the eager runner exactly."""
    _, model, fused = _runtimes("tiny")
    reference = Qwen35Runtime(model, None, None)
    vocab = model.config.vocab_size
    rows, eager_pools = _prefilled(reference, vocab)
    graph_pools = eager_pools.clone()
    eager = VerifyGraphRunner(model, fused, use_graphs=False)
    graphs = VerifyGraphRunner(model, fused, use_graphs=True)
    for step, (lens, layers) in enumerate(ROUNDS * 2):  # the second pass replays every shape
        batch = rows.batch([torch.randint(0, vocab, (n,)).tolist() for n in lens], verify=True, layers=layers)
        expected = eager.forward(batch, eager_pools.kv, eager_pools.state)
        got = graphs.forward(batch, graph_pools.kv, graph_pools.state)
        _assert_same_output(got, expected, 1e-6)
        _assert_same_pools(graph_pools, eager_pools, 1e-6)
    assert len(graphs.captured_verify(3, 4)) == 2  # rounds 1 and 2 share one graph; round 6 (layer outputs) has one
    assert graphs.captured_verify(3, 1) and graphs.captured_verify(3, 3)


def test_padding_repeats_each_rows_last_token_and_widens_the_page_table():
    rows = Rows(2)
    rows.batch([[5] * 3, [6] * 20], verify=False)
    batch = rows.batch([[1, 2], [3, 4, 5, 6]], verify=True)
    padded = pad_batch(batch, 4, 8)
    assert padded.token_ids.tolist() == [1, 2, 2, 2, 3, 4, 5, 6]
    assert padded.positions[0].tolist() == [3, 4, 4, 4, 20, 21, 22, 23]
    assert padded.query_lens == [4, 4] and padded.context_lens == [3, 20]
    assert padded.page_tables.tolist() == [[0, 0, 0, 0, 0, 0, 0, 0], [1, 2, 0, 0, 0, 0, 0, 0]]
    assert padded.state_slots is batch.state_slots and padded.capture_states


def test_the_runner_takes_every_verify_batch_and_only_those():
    _, model, fused = _runtimes("tiny")
    runner = VerifyGraphRunner(model, fused, use_graphs=False, max_tokens_per_row=8)
    rows = Rows(3)

    def batch(lens, **changes):
        made = rows.batch([[1] * n for n in lens], verify=True)
        for name, value in changes.items():
            setattr(made, name, value)
        return made

    for lens in ([3, 3, 3], [3, 1, 2], [1, 1, 1], [8, 1, 1]):
        assert runner.supports(batch(lens)), lens
    assert runner.supports(batch([2, 3, 1], capture_layers=(0, 3)))
    assert not runner.supports(batch([9, 1, 1]))  # past max_tokens_per_row: the generic path
    assert not runner.supports(batch([3, 1, 2], capture_states=False))
    assert not runner.supports(batch([3, 1, 2], logits="last"))


def test_runtime_sends_ragged_and_layer_capturing_verify_batches_to_the_runner(monkeypatch):
    """Wherever the runtime has the decode runner (CUDA, or its eager form over the fused CPU model here)."""
    _, model, fused = _runtimes("tiny")
    runtime = Qwen35Runtime(model, None, DecodeGraphRunner(model, fused, use_graphs=False))
    verifier = runtime.verifier
    assert verifier is not None
    taken = []
    real_forward = verifier.forward
    monkeypatch.setattr(verifier, "forward", lambda *args: taken.append(args[0].query_lens) or real_forward(*args))
    rows, pools = Rows(2), Pools(runtime, 2)
    runtime.forward(rows.batch([[7] * 9, [8] * 4], verify=False), pools.kv, pools.state)  # prefill: generic
    output = runtime.forward(rows.batch([[3, 4, 5], [6]], verify=True, layers=(1, 2)), pools.kv, pools.state)
    assert output.logits.shape == (4, model.config.vocab_size) and output.states.ssm[0].shape[0] == 4
    assert output.layer_hidden.shape == (4, 2 * model.config.hidden_size)
    assert taken == [[3, 1]]


# -- whole speculative runs ---------------------------------------------------------------------------------------


RUN_PROMPTS = [[random.Random(n).randrange(200, 150_000) for _ in range(n)] for n in (5, 17)]
RUN_MAX_TOKENS = [9, 12]
WRONG_OUTPUTS = (3, 6, 8, 9)  # the output positions steered drafts get wrong
PAUSED_AT = 4  # a row with this many outputs takes a fallback step (and goes on)


class SteeredDrafter:
    """The real drafter (run, its drafts dropped) proposing the plain greedy continuation instead, wrong at output
    positions WRONG_OUTPUTS, and not ready for a row at PAUSED_AT outputs: rounds accept whole drafts, part of one or
    none (a rollback from the compacted per-token states), and a paused row takes a fallback step among drafting rows
    and goes on (no rollback: its slot must hold the state after its one real token)."""

    def __init__(self, inner: Any, references: dict[tuple[int, ...], list[int]]) -> None:
        self.inner = inner
        self.references = references

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def ready(self, seq: Any) -> bool:
        return self.inner.ready(seq) and seq.output_count != PAUSED_AT

    def draft(self, rows: Any, counts: Any) -> list[Draft]:
        self.inner.draft(rows, counts)
        return reference_drafts(rows, counts, self.references, WRONG_OUTPUTS.__contains__, filler=0)


@pytest.mark.parametrize(("backend", "k"), [("mtp", 3), ("dflash", 4), ("dflash2", 4)])
def test_greedy_speculation_through_the_runner_equals_plain_greedy(tmp_path, registries, backend, k):
    """Every verify batch of the runs (ragged ones near the output limits, DFlash's with layer outputs) goes through
    the verify runner: on CUDA the load path's (graphs, fp32 so that greedy picks cannot tie-break apart), in the
    interpreter an eager one attached to the CPU runtime."""
    options = TinyOptions(family="qwen3_5", seed=0, **{backend: True})
    artifact = open_model_source(write_tiny_artifact(tmp_path / f"{backend}.ninfer", options, registries))
    try:
        load = LoadOptions(device="cuda", dtype="float32") if CUDA else LoadOptions()
        runtime = registries.family_for(artifact.manifest).require("load_runtime")(artifact, load)
        if not CUDA:
            runtime.verifier = VerifyGraphRunner(*fuse_model(runtime.model), use_graphs=False)
        verifier = runtime.verifier
        taken: list[list[int]] = []
        real_forward = verifier.forward
        verifier.forward = lambda *args: taken.append(list(args[0].query_lens)) or real_forward(*args)
        tiny = (artifact, runtime, artifact_tokenizer(artifact))

        def steered(references: dict[tuple[int, ...], list[int]]) -> SteeredDrafter:
            assert not taken  # plain decoding never verifies
            return SteeredDrafter(drafter_for(tiny, registries, backend, k), references)

        plain, results, _ = greedy_plain_then_speculative(tiny, RUN_PROMPTS, RUN_MAX_TOKENS, steered)
    finally:
        artifact.close()
    for result, base in zip(results, plain):
        assert result.output_token_ids == base.output_token_ids
        assert result.speculative.backend == backend and result.speculative.rounds > 0
    assert sum(r.speculative.accepted_tokens for r in results) > 0
    assert any(len(set(lens)) > 1 for lens in taken)  # ragged batches went through the runner
