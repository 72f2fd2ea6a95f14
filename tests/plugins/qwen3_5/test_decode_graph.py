"""The fused decode path (Triton kernels, CUDA graphs) against the reference runtime on the same weights and caches.

Runs on CUDA (graphs on and off); without a GPU it runs the eager fused path in Triton's CPU interpreter when
``TRITON_INTERPRET=1``, otherwise it is skipped.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from kernel_support import CUDA, DEVICE, DTYPE, rel_err, skip_module_without_triton

from ninfer.core.runtime import ForwardBatch, KVCache, StateCache
from ninfer.plugins.qwen3_5.model.presets import preset_config
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.model.synthetic import InMemorySource, build_runtime, random_text_weights

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.kernels.triton import moe_persistent  # noqa: E402
from ninfer.kernels.triton.pending_state import PendingStateUpdates  # noqa: E402
from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner, segment_bounds  # noqa: E402
from ninfer.plugins.qwen3_5.model.fused import fuse_model  # noqa: E402

TOL = 2e-2 if CUDA else 1e-4
PAGE_SIZE = 16


class Caches:
    """KV pages and state slots for ``rows`` rows; row r owns slot ``rows - 1 - r`` and shuffled pages."""

    def __init__(self, runtime, rows: int, pages_per_row: int = 6) -> None:
        self.kv = KVCache.allocate(runtime.spec, rows * pages_per_row + 3, PAGE_SIZE)
        self.state = StateCache.allocate(runtime.spec, rows + 2)
        order = torch.randperm(rows * pages_per_row + 3, generator=torch.Generator().manual_seed(7))
        self.page_tables = order[: rows * pages_per_row].view(rows, pages_per_row).to(torch.int32)
        self.slots = torch.arange(rows - 1, -1, -1)
        self.lengths = [0] * rows

    def clone(self) -> "Caches":
        copy = object.__new__(Caches)
        copy.kv = KVCache(self.kv.page_size, [t.clone() for t in self.kv.key], [t.clone() for t in self.kv.value])
        copy.state = StateCache([t.clone() for t in self.state.conv], [t.clone() for t in self.state.ssm])
        copy.page_tables, copy.slots, copy.lengths = self.page_tables, self.slots, list(self.lengths)
        return copy

    def batch(self, rows: list[int], chunks: list[list[int]], *, verify: bool = False) -> ForwardBatch:
        """The rows' next chunks; ``verify``: logits of every token and the state after each (a verify forward)."""
        contexts = [self.lengths[r] for r in rows]
        positions = torch.cat([torch.arange(c, c + len(t)) for c, t in zip(contexts, chunks)])
        for r, chunk in zip(rows, chunks):
            self.lengths[r] += len(chunk)
        return ForwardBatch(
            token_ids=torch.tensor([t for chunk in chunks for t in chunk]),
            positions=positions.expand(3, -1),
            query_lens=[len(c) for c in chunks],
            context_lens=contexts,
            page_tables=self.page_tables[rows],
            state_slots=self.slots[rows],
            logits="all" if verify else "last",
            capture_states=verify,
            return_hidden=True,
        )


def _runtimes(preset: str, dtype: torch.dtype = DTYPE):
    """``(reference, model, fused)``: the generic eager runtime and the fused model on the same random weights."""
    config = preset_config(preset)
    tensors = random_text_weights(config, device=DEVICE, dtype=dtype, seed=3)
    with torch.no_grad():  # move norms and gates away from their init values so every weight matters
        for name, tensor in tensors.items():
            if "norm" in name or "dt_bias" in name:
                tensor.add_(torch.randn_like(tensor.float()).to(tensor.dtype) * 0.2)
    reference = build_runtime(InMemorySource(preset, config, tensors), dtype=dtype, device=DEVICE)
    model = reference.model
    if reference.decoder is None:
        model, fused = fuse_model(model)
    else:
        fused = reference.decoder.fused
        reference = Qwen35Runtime(model, None, None)  # the generic eager path only
    return reference, model, fused


@pytest.mark.parametrize(
    ("preset", "grouped_moe_rows", "persistent_moe"),
    [("tiny", 1, True), ("tiny-moe", 0, True), ("tiny-moe", 1, False), ("tiny-moe", 3, True)],
)
def test_fused_decode_matches_reference(preset, grouped_moe_rows, persistent_moe):
    torch.manual_seed(0)
    reference, model, fused = _runtimes(preset)
    vocab = model.config.vocab_size
    rows = [0, 1, 2]
    caches = Caches(reference, len(rows))
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (5, 17, 30)]
    with torch.no_grad():
        reference.forward(caches.batch(rows, prompts), caches.kv, caches.state)
    ours = caches.clone()
    options = dict(grouped_moe_rows=grouped_moe_rows, persistent_moe=persistent_moe)
    eager = DecodeGraphRunner(model, fused, use_graphs=False, **options)
    graphs = DecodeGraphRunner(model, fused, use_graphs=True, **options) if CUDA else None
    graph_caches = caches.clone() if CUDA else None
    returned = []  # (logits a step returned, a copy): no later step may overwrite them
    for step in range(7):
        active = rows[: 3 if step < 3 else 2 if step < 5 else 1]  # the batch shrinks: 3, 2, then 1 row
        tokens = [[int(t)] for t in torch.randint(0, vocab, (len(active),))]
        expected = reference.forward(caches.batch(active, tokens), caches.kv, caches.state)
        batch = ours.batch(active, tokens)
        batch.greedy_below = vocab - 3
        got = eager.forward(batch, ours.kv, ours.state)
        assert rel_err(got.logits, expected.logits) < TOL, step
        assert rel_err(got.hidden, expected.hidden) < TOL, step
        returned.append((got.logits, got.logits.clone()))
        outputs = [got]
        if graphs is not None:
            batch = graph_caches.batch(active, tokens)
            batch.greedy_below = vocab - 3
            replayed = graphs.forward(batch, graph_caches.kv, graph_caches.state)
            assert rel_err(replayed.logits, got.logits) < 1e-6, step
            returned.append((replayed.logits, replayed.logits.clone()))
            outputs.append(replayed)
        for output in outputs:  # the lm_head takes the argmax with the logits where it folds the norm: one row
            if len(active) == 1:
                assert output.greedy_ids.tolist() == output.logits[:, : vocab - 3].argmax(dim=1).tolist(), step
            else:
                assert output.greedy_ids is None, step
    assert all(torch.equal(logits, copy) for logits, copy in returned)
    # a prefill chunk after decode steps that left state updates pending (row 0: 7 steps, 2 pending) reads them
    chunk = torch.randint(0, vocab, (3,)).tolist()
    expected = reference.forward(caches.batch([0], [chunk]), caches.kv, caches.state)
    for cached in (ours, graph_caches) if graphs is not None else (ours,):
        got = reference.forward(cached.batch([0], [chunk]), cached.kv, cached.state)
        assert rel_err(got.logits, expected.logits) < TOL
    for got_ssm, expected_ssm in zip(ours.state.ssm, caches.state.ssm):
        assert rel_err(got_ssm, expected_ssm) < TOL
    for got_conv, expected_conv in zip(ours.state.conv, caches.state.conv):
        assert rel_err(got_conv, expected_conv) < TOL
    for got_key, expected_key in zip(ours.kv.key, caches.kv.key):
        assert rel_err(got_key, expected_key) < TOL
    if graphs is not None:
        assert len(graphs._graphs) == 3  # one per batch size, replayed on the later steps
        for replay_ssm, eager_ssm in zip(graph_caches.state.ssm, ours.state.ssm):
            assert rel_err(replay_ssm, eager_ssm) < 1e-6
        graphs.reset()
        assert not any(graphs.captured(rows) for rows in (1, 2, 3))  # the next step of each size captures again


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_state_update_stops_keep_stopped_rows_states_and_change_no_output(preset):
    """The slot of a row fed one of its stop ids goes to the recurrent kernels as ``-1 - s``: read, not written
    (graphs replay it)."""
    torch.manual_seed(0)
    reference, model, fused = _runtimes(preset)
    vocab = model.config.vocab_size
    caches = Caches(reference, 2)
    with torch.no_grad():
        reference.forward(caches.batch([0, 1], [torch.randint(0, vocab, (n,)).tolist() for n in (7, 12)]),
                          caches.kv, caches.state)
    masked, plain = caches.clone(), caches.clone()
    runner = DecodeGraphRunner(model, fused, use_graphs=CUDA)
    for step in range(3):  # the first step of the batch size runs eagerly (and captures), the last replays
        tokens = [[int(t)] for t in torch.randint(0, vocab, (2,))]
        last = step == 2
        batch = masked.batch([0, 1], tokens)
        stop = tokens[0][0] if last else -1  # at the last step row 0 is fed its stop id
        batch.state_update_stops = torch.tensor([[1, stop], [1, tokens[1][0] + 1]], device=DEVICE)
        before = [t.clone() for t in (*masked.state.conv, *masked.state.ssm)]
        got = runner.forward(batch, masked.kv, masked.state)
        expected = runner.forward(plain.batch([0, 1], tokens), plain.kv, plain.state)
        assert torch.equal(got.logits, expected.logits), step
    states = zip((*masked.state.conv, *masked.state.ssm), (*plain.state.conv, *plain.state.ssm), before)
    for ours, theirs, old in states:
        slot_0, slot_1 = caches.slots.tolist()
        assert torch.equal(ours[slot_1], theirs[slot_1]) and torch.equal(ours[slot_0], old[slot_0])


@pytest.mark.skipif(not CUDA, reason="the persistent MoE block's residency check needs a GPU")
def test_a_persistent_moe_grid_the_device_cannot_hold_falls_back_to_the_grouped_kernels(monkeypatch, caplog):
    torch.manual_seed(0)
    reference, model, fused = _runtimes("tiny-moe")
    vocab = model.config.vocab_size
    caches = Caches(reference, 1)
    with torch.no_grad():
        reference.forward(caches.batch([0], [torch.randint(0, vocab, (9,)).tolist()]), caches.kv, caches.state)
    theirs = caches.clone()
    tiles = attrs.evolve(moe_persistent.default_tiles("cuda"), programs_per_sm=64)  # more than any SM holds
    monkeypatch.setattr(moe_persistent, "default_tiles", lambda device="cpu": tiles)
    runner = DecodeGraphRunner(model, fused, use_graphs=True)
    grouped = DecodeGraphRunner(model, fused, use_graphs=True, persistent_moe=False)
    for _ in range(3):
        token = [[int(torch.randint(0, vocab, ()))]]
        got = runner.forward(caches.batch([0], token), caches.kv, caches.state)
        expected = grouped.forward(theirs.batch([0], token), theirs.kv, theirs.state)
        assert torch.equal(got.logits, expected.logits)
    assert not runner.persistent_moe and "grouped kernels run instead" in caplog.text


def test_graph_segments_grow_from_one_layer_and_cover_every_layer_once():
    assert segment_bounds(40, 4) == [(0, 1), (1, 5), (5, 21), (21, 40)]
    assert segment_bounds(64, 1) == [(0, 64)]
    assert segment_bounds(4, 4) == [(0, 1), (1, 4)]  # no empty segment
    assert segment_bounds(3, 2) == [(0, 1), (1, 3)]


def test_a_runner_refuses_pending_updates_of_another_shape_and_rejects_a_negative_length():
    reference, model, fused = _runtimes("tiny")
    caches = Caches(reference, 1)
    caches.state.pending = PendingStateUpdates.allocate(caches.state.unsettled_ssm(), 2, 4)  # the runner keeps 4
    with pytest.raises(ValueError, match="not this decode runner's"):
        DecodeGraphRunner(model, fused, use_graphs=False).forward(caches.batch([0], [[1]]), caches.kv, caches.state)
    assert not caches.state.pending.dirty
    with pytest.raises(ValueError, match="pending_updates must be >= 0"):
        DecodeGraphRunner(model, fused, use_graphs=False, pending_updates=-1)


def test_runtime_routes_pure_decode_batches_only():
    reference, model, fused = _runtimes("tiny")
    runtime = Qwen35Runtime(model, None, DecodeGraphRunner(model, fused, use_graphs=CUDA))
    caches = Caches(runtime, 2)
    decoder = runtime.decoder
    assert not decoder.supports(caches.batch([0, 1], [[1, 2], [3]]))  # a prefill chunk: reference path
    assert decoder.supports(caches.batch([0, 1], [[4], [5]]))
    verify = caches.batch([0], [[6]])
    verify.capture_states = True
    assert not decoder.supports(verify)


def test_device_resident_batches_decode_like_host_batches():
    """The engine hands over device tensors: they are staged device to device and give the same step."""
    reference, model, fused = _runtimes("tiny")
    runtime = Qwen35Runtime(model, None, DecodeGraphRunner(model, fused, use_graphs=CUDA, graph_segments=2))
    caches = Caches(runtime, 2)
    with torch.no_grad():
        runtime.forward(caches.batch([0, 1], [[1, 2, 3], [4, 5]]), caches.kv, caches.state)
        on_host, on_device = caches, caches.clone()
        for step in range(3):
            tokens = [[7 + step], [9 + step]]
            host_batch = on_host.batch([0, 1], tokens)
            device_batch = on_device.batch([0, 1], tokens)
            for name in ("token_ids", "positions", "page_tables", "state_slots"):
                setattr(device_batch, name, getattr(device_batch, name).to(DEVICE))
            expected = runtime.forward(host_batch, on_host.kv, on_host.state).logits
            got = runtime.forward(device_batch, on_device.kv, on_device.state).logits
            assert rel_err(got, expected) < 1e-6, step
