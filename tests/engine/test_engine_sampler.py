"""The sampler on synthetic logits: each parameter's effect on the distribution, seeds, precedence."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from ninfer.core.descriptors import SamplingPreset
from ninfer.core.request import SamplingParams, resolve_sampling
from ninfer.engine.sampler import (
    RowSampler,
    candidate_distribution,
    penalized_logits,
    plain_greedy,
    sample_token_ids,
    sample_tokens,
)
from ninfer.core.errors import InvalidRequestError

VOCAB = 50


def row(seed: int = 0, **params) -> RowSampler:
    return RowSampler(SamplingParams(seed=seed, **params), seed, VOCAB, torch.device("cpu"))


def logits_from_probs(probs: dict[int, float], floor: float = -1e9) -> torch.Tensor:
    logits = torch.full((VOCAB,), floor)
    for token, p in probs.items():
        logits[token] = math.log(p)
    return logits


def draw(logits: torch.Tensor, sampler: RowSampler, times: int) -> Counter:
    return Counter(sample_tokens(logits[None, :], [sampler])[0] for _ in range(times))


def test_temperature_zero_is_argmax_per_row():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = [row(temperature=0.0) for _ in range(6)]
    assert sample_tokens(logits, rows) == logits.argmax(dim=-1).tolist()


def test_a_forward_s_argmax_stands_for_rows_that_all_take_a_plain_argmax():
    """``greedy_ids`` (a forward's argmax of the logits, ``ForwardOutput.greedy_ids``) are what plain greedy rows
    sample; with a sampled or a penalized row the sampler takes its own pick."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    forward_ids = logits.argmax(dim=-1)
    greedy = [row(temperature=0.0) for _ in range(3)]
    assert plain_greedy(greedy)
    assert sample_token_ids(logits, greedy, None, forward_ids) is forward_ids
    assert sample_token_ids(logits, greedy).tolist() == forward_ids.tolist()
    for other in (row(seed=4, temperature=1.0), row(temperature=0.0, presence_penalty=1.0)):
        other.observe(int(forward_ids[2]))
        mixed = [*greedy[:2], other]
        assert not plain_greedy(mixed)
        assert sample_token_ids(logits, mixed, None, forward_ids) is not forward_ids


def test_top_k_one_equals_greedy():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4))
    sampler = row(seed=11, temperature=1.5, top_k=1)
    assert set(draw(logits, sampler, 200)) == {int(logits.argmax())}


def test_top_k_zero_selects_the_top_20_cap():
    logits = torch.zeros(VOCAB)
    logits[:30] = torch.linspace(1.0, 0.9, 30)  # 30 nearly equal tokens
    sampler = row(seed=5, temperature=1.0, top_k=0)
    probs, ids = candidate_distribution(logits[None, :], [sampler])
    assert int((probs[0] > 0).sum()) == 20
    assert set(ids[0].tolist()) == set(range(20))
    assert set(draw(logits, sampler, 2000)) <= set(range(20))


def test_top_k_prunes_to_k_candidates():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(6))
    sampler = row(seed=1, temperature=1.0, top_k=5)
    top5 = set(logits.topk(5).indices.tolist())
    seen = draw(logits, sampler, 1000)
    assert set(seen) <= top5 and len(seen) == 5


def test_top_p_prunes_the_tail_and_renormalizes():
    logits = logits_from_probs({7: 0.5, 3: 0.3, 9: 0.15, 1: 0.05})
    sampler = row(seed=2, temperature=1.0, top_p=0.75)
    probs, ids = candidate_distribution(logits[None, :], [sampler])
    kept = {int(t): float(p) for t, p in zip(ids[0], probs[0]) if p > 0}
    assert kept.keys() == {7, 3}
    assert kept[7] == pytest.approx(0.625, abs=1e-5) and kept[3] == pytest.approx(0.375, abs=1e-5)
    seen = draw(logits, sampler, 2000)
    assert set(seen) == {7, 3}
    assert seen[7] / 2000 == pytest.approx(0.625, abs=0.05)


def test_min_p_prunes_relative_to_the_top_probability():
    logits = logits_from_probs({7: 0.5, 3: 0.3, 9: 0.15, 1: 0.05})
    sampler = row(seed=3, temperature=1.0, min_p=0.2)  # threshold 0.1 drops only token 1
    probs, ids = candidate_distribution(logits[None, :], [sampler])
    kept = {int(t) for t, p in zip(ids[0], probs[0]) if p > 0}
    assert kept == {7, 3, 9}
    assert set(draw(logits, sampler, 2000)) == {7, 3, 9}


def test_temperature_flattens_and_sharpens():
    logits = logits_from_probs({0: 0.6, 1: 0.4})
    hot = candidate_distribution(logits[None, :], [row(temperature=2.0)])[0][0, 0].item()
    cold = candidate_distribution(logits[None, :], [row(temperature=0.5)])[0][0, 0].item()
    assert hot == pytest.approx(math.sqrt(0.6) / (math.sqrt(0.6) + math.sqrt(0.4)), abs=1e-5)
    assert cold == pytest.approx(0.36 / (0.36 + 0.16), abs=1e-5)


def test_empirical_frequencies_follow_the_distribution():
    logits = logits_from_probs({4: 0.5, 5: 0.25, 6: 0.25})
    seen = draw(logits, row(seed=9, temperature=1.0), 4000)
    assert seen[4] / 4000 == pytest.approx(0.5, abs=0.04)
    assert seen[5] / 4000 == pytest.approx(0.25, abs=0.04)


def test_presence_and_frequency_penalties_change_logits_exactly():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(7))
    penalized = row(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    plain = row(temperature=1.0)
    for token in (3, 3, 3, 8):
        penalized.observe(token)
        plain.observe(token)
    out = penalized_logits(logits, [penalized, plain])
    expected = logits.clone()
    expected[0, 3] -= 0.5 + 0.25 * 3
    expected[0, 8] -= 0.5 + 0.25 * 1
    assert torch.equal(out, expected)
    assert torch.equal(logits, torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(7)))  # input untouched


def test_penalty_changes_the_greedy_choice():
    logits = torch.zeros(VOCAB)
    logits[10], logits[11] = 2.0, 1.5
    sampler = row(temperature=0.0, presence_penalty=1.0)
    assert sample_tokens(logits[None, :], [sampler]) == [10]
    sampler.observe(10)
    assert sample_tokens(logits[None, :], [sampler]) == [11]


def test_seeds_reproduce_differ_and_ignore_batching():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(8))
    others = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(9))

    def run(seed: int, batched: bool) -> list[int]:
        sampler = row(seed=seed, temperature=1.0)
        neighbours = [row(seed=100 + i, temperature=1.0) for i in range(3)]
        tokens = []
        for _ in range(40):
            if batched:
                tokens.append(sample_tokens(torch.cat([others[:1], logits[None], others[1:]]), [neighbours[0], sampler, *neighbours[1:]])[1])
            else:
                tokens.append(sample_tokens(logits[None], [sampler])[0])
        return tokens

    assert run(123, batched=False) == run(123, batched=False) == run(123, batched=True)
    assert run(123, batched=False) != run(124, batched=False)
    assert run(-(2**63), batched=False) == run(-(2**63), batched=False)


def test_vocab_limit_is_never_exceeded():
    logits = torch.zeros(VOCAB)
    logits[VOCAB - 1] = 100.0
    assert sample_tokens(logits[None], [row(temperature=0.0)], vocab_limit=VOCAB - 5) != [VOCAB - 1]
    assert all(
        token < VOCAB - 5
        for token in (sample_tokens(logits[None], [row(seed=s, temperature=1.0)], vocab_limit=VOCAB - 5)[0] for s in range(30))
    )


def test_resolve_sampling_precedence():
    preset = SamplingPreset(0.7, 0.8, 20, 0.0, 1.5)
    params = resolve_sampling(preset, {"top_p": 0.9, "temperature": None, "seed": 5}, {}, greedy=False)
    assert (params.temperature, params.top_p, params.top_k, params.presence_penalty, params.seed) == (0.7, 0.9, 20, 1.5, 5)
    params = resolve_sampling(preset, {"top_p": 0.9, "seed": 5}, {"top_p": 0.5, "seed": 6, "max_tokens": 3}, greedy=False)
    assert (params.top_p, params.seed, params.max_tokens) == (0.5, 6, 3)
    params = resolve_sampling(preset, {"temperature": 1.2}, {"temperature": 0.9}, greedy=True)
    assert params.temperature == 0.0 and params.top_p == 0.8


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_k": 21}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"seed": 2**63}, "seed"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_params_are_rejected(fields, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**fields)
    assert info.value.param == param
