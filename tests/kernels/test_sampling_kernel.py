"""The sampling rule: its torch form against a per-row reference, and the Triton sampler against its torch twin.

The reference below is the scalar rule written out row by row (penalties from the observed-token counts, top-k over
``logits / T``, softmax, top-p, min-p, renormalize, float64 inverse CDF with one draw from the row's generator).
Inputs are random and checked tie-free among each row's top candidates, where the order of equal logits is not
specified. The kernel cases run on CUDA, or in Triton's CPU interpreter with ``TRITON_INTERPRET=1`` (small
vocabularies); otherwise they are skipped.
"""

from __future__ import annotations

import pytest
import torch
from kernel_support import CUDA, DEVICE, needs_cuda_triton, needs_triton

from ninfer.core import request
from ninfer.core.request import SamplingParams
from ninfer.engine.sampler import RowSampler, sample_tokens
from ninfer.kernels.reference import sampling as twin

CAP = twin.TOP_K_CAP
BIG_VOCAB = 248320 if CUDA else 5000  # the real Qwen3.5 vocabulary on the GPU, a small one in the interpreter


def reference_token(logits: torch.Tensor, sampler: RowSampler, vocab_limit: int) -> int:
    """The sampling rule for one row ``[V]``, as the engine applied it before the rule was vectorised."""
    params = sampler.params
    values = logits[:vocab_limit].float().clone()
    for token, count in sampler.counts.items():
        if token < values.shape[0]:
            values[token] -= params.presence_penalty + params.frequency_penalty * count
    if params.temperature == 0.0:
        return int(values.argmax())
    top_values, ids = (values / params.temperature).topk(min(CAP, values.shape[0]))
    top_values[params.effective_top_k :] = float("-inf")
    probs = torch.softmax(top_values, dim=0)
    if params.top_p < 1.0:
        drop = probs.cumsum(dim=0) - probs >= params.top_p
        drop[0] = False
        probs[drop] = 0.0
    probs[probs < probs[0] * params.min_p] = 0.0
    cdf = (probs / probs.sum()).double().cumsum(dim=0)
    draw = torch.rand((), generator=sampler.generator, dtype=torch.float64)
    return int(ids[min(int(torch.searchsorted(cdf, draw * cdf[-1], right=True)), cdf.shape[0] - 1)])


def random_params(generator: torch.Generator, penalties: bool) -> SamplingParams:
    def uniform(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=generator))

    choice = int(torch.randint(0, 5, (), generator=generator))
    return SamplingParams(
        temperature=0.0 if choice == 0 else uniform(0.3, 1.6),
        top_k=int(torch.randint(0, CAP + 1, (), generator=generator)),
        top_p={1: 1.0, 4: 0.0}.get(choice, uniform(0.3, 1.0)),
        min_p=0.0 if choice == 2 else uniform(0.0, 0.3),
        presence_penalty=uniform(-1.0, 2.0) if penalties else 0.0,
        frequency_penalty=uniform(-0.5, 1.0) if penalties else 0.0,
    )


def random_rows(count: int, vocab: int, seed: int, device: str = "cpu") -> list[RowSampler]:
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for index in range(count):
        params = random_params(generator, penalties=index % 3 != 0)
        rows.append(RowSampler(params, seed * 1000 + index, vocab, torch.device(device)))
    return rows


def assert_tie_free(penalized: torch.Tensor) -> None:
    """Precondition: each row's ``CAP + 1`` largest values are distinct (the order of equal logits is unspecified)."""
    top = penalized.topk(min(CAP + 1, penalized.shape[1]), dim=-1).values
    assert bool((top[:, :-1] > top[:, 1:]).all()), "test input has ties among the top candidates; pick another seed"


def penalized_by_counts(logits: torch.Tensor, rows: list[RowSampler]) -> torch.Tensor:
    out = logits.clone()
    for index, row in enumerate(rows):
        for token, count in row.counts.items():
            out[index, token] -= row.params.presence_penalty + row.params.frequency_penalty * count
    return out


# -- the torch rule (CPU) -----------------------------------------------------------------------------------------


def test_the_kernel_cap_is_the_request_cap():
    assert twin.TOP_K_CAP == request.TOP_K_CAP


@pytest.mark.parametrize("vocab, vocab_limit", [(300, 300), (1000, 990), (12, 12)])
def test_sample_tokens_follows_the_per_row_rule_step_by_step(vocab, vocab_limit):
    count, steps = 24, 6
    rows = random_rows(count, vocab, seed=vocab)
    references = random_rows(count, vocab, seed=vocab)
    generator = torch.Generator().manual_seed(vocab + 1)
    sampled_rows = sum(not row.greedy for row in rows)
    assert 0 < sampled_rows < count and any(row.penalty is not None for row in rows)
    for _ in range(steps):
        logits = torch.randn(count, vocab, generator=generator) * 3
        assert_tie_free(penalized_by_counts(logits[:, :vocab_limit], references))
        tokens = sample_tokens(logits, rows, vocab_limit)
        expected = [reference_token(logits[i], references[i], vocab_limit) for i in range(count)]
        assert tokens == expected
        for row, reference, token in zip(rows, references, tokens):
            row.observe(token)
            reference.observe(token)
    assert all(row.generator.get_state().equal(ref.generator.get_state()) for row, ref in zip(rows, references))


def test_greedy_rows_draw_no_uniform_and_take_the_first_of_equal_maxima():
    logits = torch.zeros(2, 40)
    logits[:, [7, 19]] = 5.0
    rows = [RowSampler(SamplingParams(temperature=0.0), seed, 40, torch.device("cpu")) for seed in (1, 2)]
    states = [row.generator.get_state() for row in rows]
    assert sample_tokens(logits, rows) == [7, 7]
    assert all(row.generator.get_state().equal(state) for row, state in zip(rows, states))


def test_twin_penalty_rows_index_a_narrower_penalty_and_skip_negative_rows():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(4))
    penalty = torch.arange(1.0, 17.0).reshape(2, 8)
    out = twin.penalize(logits, penalty, torch.tensor([1, -1, 0]))
    expected = logits.clone()
    expected[0, :8] -= penalty[1]
    expected[2, :8] -= penalty[0]
    assert torch.equal(out, expected)


def test_twin_rejects_mismatched_per_row_parameters():
    logits = torch.zeros(2, 30)
    per_row = [torch.ones(2) for _ in range(4)]
    with pytest.raises(ValueError, match="per-row"):
        twin.sample_rows(logits, *per_row, torch.ones(3))


# -- the Triton kernel against the twin ----------------------------------------------------------------------------


def kernel_test(test):
    """Marks a kernel case: ``gpu``, and skipped unless Triton runs on CUDA or in its interpreter."""
    return pytest.mark.gpu(needs_triton(test))


def random_batch(rows: int, vocab: int, seed: int, penalized: int) -> dict:
    """Random logits, per-row parameters (a quarter greedy), penalties for some rows, uniforms; all on DEVICE."""
    generator = torch.Generator().manual_seed(seed)

    def column(values: torch.Tensor) -> torch.Tensor:
        return values.to(torch.float64).to(DEVICE)

    temperature = torch.rand(rows, generator=generator) * 1.3 + 0.3
    temperature[torch.arange(rows) % 4 == 1] = 0.0
    top_p = torch.rand(rows, generator=generator) * 0.7 + 0.3
    top_p[torch.arange(rows) % 5 == 2] = 1.0
    top_p[torch.arange(rows) % 7 == 3] = 0.0  # keeps only the best candidate
    penalty = torch.rand(penalized, vocab, generator=generator) * 2
    penalty *= torch.rand(penalized, vocab, generator=generator) < 0.05  # sparse, like real output-token counts
    penalty_rows = torch.randint(-1, penalized, (rows,), generator=generator)
    return {
        "logits": (torch.randn(rows, vocab, generator=generator) * 3).to(DEVICE),
        "temperature": column(temperature),
        "top_k": column(torch.randint(0, CAP + 1, (rows,), generator=generator)),
        "top_p": column(top_p),
        "min_p": column(torch.rand(rows, generator=generator) * 0.2),
        "uniform": column(torch.rand(rows, generator=generator, dtype=torch.float64)),
        "penalty": penalty.to(DEVICE),
        "penalty_rows": column(penalty_rows),
    }


def run_both(batch: dict, vocab_limit: int | None = None, chunk: int | None = None) -> tuple[list[int], list[int]]:
    from ninfer.kernels.triton.sampling import sample_rows

    width = batch["logits"].shape[1] if vocab_limit is None else vocab_limit
    assert_tie_free(twin.penalize(batch["logits"][:, :width], batch["penalty"], batch["penalty_rows"]))
    expected = twin.sample_rows(**batch, vocab_limit=vocab_limit).tolist()
    got = sample_rows(**batch, vocab_limit=vocab_limit, chunk=chunk)
    assert got.dtype == torch.int64 and got.device == batch["logits"].device
    return got.tolist(), expected


@kernel_test
@pytest.mark.parametrize("vocab, rows, vocab_limit", [(BIG_VOCAB, 8 if CUDA else 6, None), (1000, 16, 990)])
@pytest.mark.parametrize("penalized", [0, 3])
def test_kernel_matches_twin_on_random_rows(vocab, rows, vocab_limit, penalized):
    batch = random_batch(rows, vocab, seed=vocab + penalized, penalized=max(penalized, 1))
    if not penalized:
        batch["penalty"] = batch["penalty_rows"] = None
    got, expected = run_both(batch, vocab_limit, chunk=None if CUDA else 1024)  # several chunks per row
    assert got == expected
    assert len(set(expected)) > rows // 2  # the rows really sample different tokens


@kernel_test
def test_kernel_matches_twin_across_many_uniforms_on_one_row():
    rows = 64 if CUDA else 16
    batch = random_batch(rows, 600, seed=11, penalized=2)
    batch["logits"] = batch["logits"][:1].expand(rows, -1).contiguous() / 2
    for name in ("temperature", "top_k", "top_p", "min_p"):
        batch[name] = torch.full_like(batch[name], {"temperature": 1.0, "top_k": 0, "top_p": 0.9, "min_p": 0.02}[name])
    got, expected = run_both(batch, chunk=128)
    assert got == expected
    assert len(set(expected)) >= 4


@kernel_test
def test_kernel_matches_twin_when_the_top_logits_cluster_in_few_column_groups():
    """Logits falling with ``column % 64`` put far more than 64 keys above the group-maximum bound of every chunk,
    which sends the kernel down its one-maximum-at-a-time path."""
    batch = random_batch(8, 3000, seed=9, penalized=2)
    columns = torch.arange(3000, device=DEVICE)
    batch["logits"] = batch["logits"] * 0.3 - (columns % 64) * 2.0
    got, expected = run_both(batch, chunk=512)
    assert got == expected


@kernel_test
def test_kernel_handles_a_vocabulary_smaller_than_the_cap():
    batch = random_batch(10, 7, seed=5, penalized=2)
    got, expected = run_both(batch)
    assert got == expected


@kernel_test
def test_kernel_greedy_takes_the_first_of_equal_maxima():
    from ninfer.kernels.triton.sampling import sample_rows

    logits = torch.zeros(2, 3000, device=DEVICE)
    logits[:, [2500, 40, 1777]] = 9.0
    zeros = torch.zeros(2, dtype=torch.float64, device=DEVICE)
    assert sample_rows(logits, zeros, zeros, zeros + 1, zeros, zeros, chunk=512).tolist() == [40, 40]


@kernel_test
@pytest.mark.parametrize("rows, vocab, vocab_limit, chunk", [(1, BIG_VOCAB, None, None), (5, 3000, 2990, 512)])
def test_kernel_greedy_rows_match_the_twin_and_the_sampler_at_temperature_zero(rows, vocab, vocab_limit, chunk):
    from ninfer.kernels.triton.sampling import greedy_rows, sample_rows

    batch = random_batch(rows, vocab, seed=rows, penalized=1)
    logits = batch["logits"]
    logits[0, [vocab // 3, 5, vocab // 2]] = logits.max() + 1.0  # equal maxima: the first column wins
    got = greedy_rows(logits, vocab_limit, chunk=chunk)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert got.tolist() == twin.greedy_rows(logits, vocab_limit).tolist()
    assert got[0] == 5
    zeros = torch.zeros(rows, dtype=torch.float64, device=DEVICE)
    sampled = sample_rows(logits, zeros, zeros, zeros + 1, zeros, zeros, vocab_limit=vocab_limit, chunk=chunk)
    assert got.tolist() == sampled.tolist()


def test_twin_greedy_rows_is_the_temperature_zero_rule_below_the_vocab_limit():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(8))
    logits[:, 45] = 100.0  # above the limit: never chosen
    zeros = torch.zeros(3, dtype=torch.float64)
    expected = twin.sample_rows(logits, zeros, zeros, zeros + 1, zeros, zeros, vocab_limit=40)
    assert twin.greedy_rows(logits, 40).tolist() == expected.tolist()
    assert (twin.greedy_rows(logits) == 45).all()


@pytest.fixture
def fresh_row_sampler():
    """``sample_tokens`` resolves its row sampler once per process: resolve it again inside the test."""
    from ninfer.engine.sampler import _row_sampler

    _row_sampler.cache_clear()
    yield
    _row_sampler.cache_clear()


@pytest.mark.gpu
@needs_cuda_triton
def test_sample_tokens_on_cuda_uses_the_kernel_and_reproduces_the_cpu_tokens(monkeypatch, fresh_row_sampler):
    import ninfer.kernels.triton.sampling as kernel

    calls = []
    original = kernel.sample_rows
    monkeypatch.setattr(kernel, "sample_rows", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    vocab, count = 248320, 12
    cpu_rows, cuda_rows = random_rows(count, vocab, seed=3), random_rows(count, vocab, seed=3, device="cuda")
    generator = torch.Generator().manual_seed(12)
    for _ in range(4):
        logits = torch.randn(count, vocab, generator=generator) * 3
        assert_tie_free(penalized_by_counts(logits, cpu_rows))
        tokens = sample_tokens(logits, cpu_rows)
        assert sample_tokens(logits.cuda(), cuda_rows) == tokens
        for cpu_row, cuda_row, token in zip(cpu_rows, cuda_rows, tokens):
            cpu_row.observe(token)
            cuda_row.observe(token)
    assert len(calls) == 4
