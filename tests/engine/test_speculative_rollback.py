"""The speculative round's cheap rollback and read-back: ``RowCopy`` (every layer's state row in one launch) against
per-tensor ``copy_``, ``StateRollback``'s reuse of one copy plan per set of captured buffers, a whole round restoring
the same state as the per-layer copies, and the batched target distributions against the per-position ones.

The kernel tests run on CUDA, or on the CPU in Triton's interpreter when ``TRITON_INTERPRET=1``; otherwise they are
skipped (the CPU round then takes the per-layer copies, which tests/test_speculative.py covers).
"""

from __future__ import annotations

import pytest
import torch
from kernel_support import DEVICE, needs_triton

from ninfer.bench.spec import SpecRows, build_spec_runtime
from ninfer.core.request import SamplingParams
from ninfer.engine.sampler import RowSampler
from ninfer.engine.speculative import StateRollback, sampled_distributions, target_distribution
from ninfer.core.runtime import CapturedStates, StateCache
from ninfer.plugins.qwen3_5.speculative.mtp_drafter import MTPDrafter


def _random(shape, dtype, generator):
    return torch.randn(shape, generator=generator).to(dtype).to(DEVICE)


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("conv_dim", "dtype", "word"), [(12, torch.bfloat16, 4), (5, torch.bfloat16, 2), (7, torch.int8, 1)]
)
def test_row_copy_moves_one_row_of_every_tensor(conv_dim, dtype, word):
    from ninfer.kernels.triton.row_copy import RowCopy

    generator = torch.Generator().manual_seed(conv_dim)
    # sources: views of larger buffers, as a verify runner hands them over; two kinds with their own dtype and shape
    conv_buffers = [_random((9, conv_dim, 3), dtype, generator) for _ in range(3)]
    ssm_buffers = [_random((9, 2, 4, 8), torch.float32, generator) for _ in range(3)]
    sources = [t[:6] for t in (*conv_buffers, *ssm_buffers)]
    destinations = [_random((4, conv_dim, 3), dtype, generator) for _ in range(3)]
    destinations += [_random((4, 2, 4, 8), torch.float32, generator) for _ in range(3)]
    expected = [t.clone() for t in destinations]
    for row, slot in ((5, 2), (0, 0)):
        copy = RowCopy(sources, destinations)
        assert copy.word == word
        copy(row, slot)
        for reference, source in zip(expected, sources):
            reference[slot].copy_(source[row])
        assert all(torch.equal(out, ref) for out, ref in zip(destinations, expected))  # other slots untouched


@needs_triton
@pytest.mark.gpu
def test_row_copy_rejects_mismatched_tensors():
    from ninfer.kernels.triton.row_copy import RowCopy

    a, b = torch.zeros(2, 3, device=DEVICE), torch.zeros(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="does not match"):
        RowCopy([a], [b])
    with pytest.raises(ValueError, match="contiguous"):
        RowCopy([torch.zeros(2, 3, 4, device=DEVICE)[:, :, :2]], [torch.zeros(2, 3, 2, device=DEVICE)])
    with pytest.raises(ValueError, match="as many"):
        RowCopy([a], [a, a])


def _state(layers: int, slots: int, generator) -> StateCache:
    return StateCache(
        conv=[_random((slots, 6, 3), torch.bfloat16, generator) for _ in range(layers)],
        ssm=[_random((slots, 2, 4, 4), torch.float32, generator) for _ in range(layers)],
    )


@needs_triton
@pytest.mark.gpu
def test_state_rollback_keeps_one_copy_plan_per_set_of_buffers():
    generator = torch.Generator().manual_seed(0)
    state = _state(3, 4, generator)
    oracle = StateCache([t.clone() for t in state.conv], [t.clone() for t in state.ssm])
    rollback = StateRollback(state)
    buffers = _state(3, 8, generator)  # a verify runner's per-token buffers, handed over as fresh views each round

    def captured(tokens: int) -> CapturedStates:
        return CapturedStates([t[:tokens] for t in buffers.conv], [t[:tokens] for t in buffers.ssm])

    def restore(states: CapturedStates, index: int, slot: int) -> None:
        rollback.restore(states, index, slot)
        for destination, source in zip((*oracle.conv, *oracle.ssm), (*states.conv, *states.ssm)):
            destination[slot].copy_(source[index])
        assert all(torch.equal(a, b) for a, b in zip((*state.conv, *state.ssm), (*oracle.conv, *oracle.ssm)))

    restore(captured(8), 3, 1)
    plan = rollback._copy
    restore(captured(5), 4, 2)
    assert rollback._copy is plan  # same buffers: the plan is reused
    fresh = _state(3, 5, generator)  # a generic forward's fresh tensors
    restore(CapturedStates(fresh.conv, fresh.ssm), 2, 0)
    assert rollback._copy is not plan
    for tensor in (*buffers.conv, *buffers.ssm):
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    restore(captured(6), 5, 3)  # back to the buffers (new contents): correct again


@needs_triton
@pytest.mark.gpu
def test_a_round_restores_the_state_the_per_layer_copies_restore():
    runtime = build_spec_runtime("tiny", device=DEVICE)
    prompts = torch.randint(0, runtime.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(2))
    pairs = [SpecRows(runtime, MTPDrafter(runtime, 2), prompts, rounds=4) for _ in range(2)]
    pairs[1].round.rollback._kernel = False  # the oracle: one copy per layer and kind
    try:
        for force in ("zero", "full", "zero"):
            for rows in pairs:
                rows.run_round(force, instrumented=False)
            ours, reference = (rows.state for rows in pairs)
            assert [seq.tokens for seq in pairs[0].sequences] == [seq.tokens for seq in pairs[1].sequences]
            for a, b in zip((*ours.conv, *ours.ssm), (*reference.conv, *reference.ssm)):
                assert torch.equal(a, b), force
        assert pairs[0].round.rollback._copy is not None  # the kernel path ran
    finally:
        for rows in pairs:
            rows.close()


def test_batched_target_distributions_equal_the_per_position_ones():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=generator) * 3
    samplers = [
        RowSampler(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1), 1, 50, torch.device("cpu")),
        RowSampler(SamplingParams(temperature=1.3, min_p=0.05, seed=2), 2, 50, torch.device("cpu")),
    ]
    rows, chosen = [0, 2, 3, 5], [samplers[0], samplers[0], samplers[1], samplers[1]]
    for limit in (None, 40):
        batched = sampled_distributions(logits, rows, chosen, limit)
        for row, sampler, target in zip(rows, chosen, batched):
            expected = target_distribution(logits[row], sampler, limit)
            assert expected.probs is not None and target.probs is not None
            assert torch.equal(target.ids, expected.ids)
            assert torch.allclose(target.probs, expected.probs, atol=1e-12)
            assert limit is None or int(target.ids[target.probs > 0].max()) < limit
