"""Speculative decoding: the engine's round (lossless acceptance, rollback, counters) and the MTP backend.

Oracles: the non-speculative engine's own outputs on the same tiny random-weight artifact (greedy and seeded
T>0), the target distribution itself for the rejection-sampling rule, and a from-scratch MTP pass for the MTP
drafter's KV/hidden-state bookkeeping.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from ninfer.core.request import BudgetClose, GenerationRequest, SamplingParams

from ninfer.engine import EngineConfig
from ninfer.core.drafting import Proposal
from ninfer.engine.acceptance import TargetDistribution, decide
from ninfer.server.compose import load_engine
from ninfer.engine.sampler import RowSampler, candidate_distribution
from ninfer.core.drafting import Draft, SpeculativeConfig
from ninfer.core.errors import ConfigError
from ninfer.core.plugins import load_plugin_manager
from ninfer.core.runtime import KVCache, StateCache
from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact
from live_server import start_servers
from speculation_support import assert_idle, drafter_for, make_engine, open_tiny, reference_drafts, run



@pytest.fixture(scope="module")
def registries():
    return load_plugin_manager(entry_points=False).registries


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory, registries):
    options = TinyOptions(family="qwen3_5", seed=0, mtp=True, template="qwen3_6")
    return write_tiny_artifact(tmp_path_factory.mktemp("spec") / "tiny-mtp.ninfer", options, registries)


@pytest.fixture(scope="module")
def tiny(mtp_path, registries):
    yield from open_tiny(mtp_path, registries)


def mtp(tiny, registries, k: int, lm_head_draft: bool = False):
    return drafter_for(tiny, registries, "mtp", k, lm_head_draft)


def prompts_of(lengths, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 150_000) for _ in range(n)] for n in lengths]


PROMPTS = prompts_of([5, 17, 9, 30])
MAX_TOKENS = [14, 9, 16, 11]


class OracleDrafter:
    """A test drafter proposing a known continuation, with chosen output positions corrupted."""

    backend = "oracle"

    def __init__(self, runtime, draft_tokens: int, references: dict[tuple[int, ...], list[int]], corrupt=()) -> None:
        self.runtime = runtime
        self.draft_tokens = draft_tokens
        self.references = references  # prompt -> prompt + continuation
        self.corrupt = corrupt if corrupt == "all" else set(corrupt)  # output indices, or "all"

    kv_bytes_per_token = 0.0

    def bind(self, num_pages, page_size):
        return []

    def target_logits(self, hidden):
        return self.runtime.model.logits(hidden)

    def observe(self, seq, start, hidden):
        assert hidden.shape[0] >= 1 and start <= seq.fed

    def ready(self, seq):
        return True

    def forget(self, seq):
        pass

    def draft(self, rows, counts) -> list[Draft]:
        wrong = (lambda position: True) if self.corrupt == "all" else self.corrupt.__contains__
        return reference_drafts(rows, counts, self.references, wrong, filler=7)


@pytest.fixture(scope="module")
def baselines(tiny):
    """Non-speculative greedy outputs at concurrency 1 and 4."""
    out = {}
    for concurrency in (1, 4):
        with make_engine(tiny, max_concurrency=concurrency) as engine:
            out[concurrency] = run(engine, PROMPTS, MAX_TOKENS, temperature=0.0)
    assert [o.output_token_ids for o in out[1]] == [o.output_token_ids for o in out[4]]
    return out[1]


def references(results) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): [*p, *o.output_token_ids] for p, o in zip(PROMPTS, results)}


# -- lossless greedy with MTP -----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_mtp_greedy_equals_plain_decoding(tiny, registries, baselines, k, concurrency):
    with make_engine(tiny, mtp(tiny, registries, k), max_concurrency=concurrency) as engine:
        results = run(engine, PROMPTS, MAX_TOKENS, temperature=0.0)
        assert_idle(engine)
    for result, base in zip(results, baselines):
        assert result.output_token_ids == base.output_token_ids
        assert result.finish_reason == base.finish_reason == "length"
        counters = result.speculative
        assert counters.backend == "mtp" and counters.draft_window == k
        assert counters.rounds > 0 and counters.drafted_tokens >= counters.rounds
        # every round commits its accepted drafts plus one target token; fallback steps commit one token
        assert result.completion_tokens == 1 + counters.accepted_tokens + counters.rounds + counters.fallback_steps
        assert sum(counters.accepted_per_position) == counters.accepted_tokens
        assert result.timings.draft_n == counters.drafted_tokens
        assert result.timings.draft_n_accepted == counters.accepted_tokens
        timings = result.timings.timings_dict()
        assert timings["draft_n"] == counters.drafted_tokens


def test_lm_head_draft_is_lossless(tiny, registries, baselines):
    with make_engine(tiny, mtp(tiny, registries, 3, lm_head_draft=True)) as engine:
        results = run(engine, PROMPTS, MAX_TOKENS, temperature=0.0)
    assert [r.output_token_ids for r in results] == [b.output_token_ids for b in baselines]


def test_mtp_drafts_match_a_from_scratch_mtp_pass(tiny, registries):
    """Draft 1 of every round equals the argmax of the MTP over the whole committed history in one pass."""
    _artifact, runtime, _tokenizer = tiny
    drafter = mtp(tiny, registries, 3)
    recorded = []
    original = drafter.draft

    def recording(rows, counts):
        drafts = original(rows, counts)
        recorded.extend((tuple(seq.tokens), draft.tokens[0]) for seq, draft in zip(rows, drafts))
        return drafts

    drafter.draft = recording
    prompts = [PROMPTS[1], prompts_of([90], seed=3)[0]]  # the long prompt's tail is written eagerly
    with make_engine(tiny, drafter, prefill_chunk=8) as engine:  # chunked prefill feeds the tail in pieces
        run(engine, prompts, [10, 10], temperature=0.0)
    assert len(recorded) >= 10
    for tokens, draft in recorded[::3]:
        assert draft == reference_mtp_draft(runtime, list(tokens))


def reference_mtp_draft(runtime, tokens: list[int]) -> int:
    """Trunk over tokens[:-1] in one pass, then the MTP over (hidden_t, token_{t+1}) for every t, argmax at the end."""
    n = len(tokens) - 1
    page_size = 16
    pages = -(-len(tokens) // page_size)
    kv = KVCache.allocate(runtime.spec, pages, page_size)
    state = StateCache.allocate(runtime.spec, 1)
    table = torch.arange(pages, dtype=torch.int32)[None, :]
    from ninfer.core.runtime import ForwardBatch

    positions = torch.arange(n)[None, :].expand(3, -1).contiguous()
    batch = ForwardBatch(
        torch.tensor(tokens[:n]), positions, [n], [0], table, torch.tensor([0]), logits="none", return_hidden=True
    )
    hidden = runtime.forward(batch, kv, state).hidden
    mtp_kv = KVCache.allocate(runtime.mtp.spec, pages, page_size)
    logits, _ = runtime.mtp.forward(
        torch.tensor(tokens[1:]), hidden, positions, [n], [0], table, mtp_kv, logits="last"
    )
    return int(logits[0].argmax())


# -- acceptance levels, stops and reuse with a forced-continuation drafter ---------------------------------------


@pytest.mark.parametrize("corrupt", [(), (2, 5, 6, 9), "all"], ids=["full", "partial", "zero"])
def test_acceptance_levels_are_lossless(tiny, baselines, corrupt):
    drafter = OracleDrafter(tiny[1], 4, references(baselines), corrupt)
    with make_engine(tiny, drafter) as engine:
        results = run(engine, PROMPTS, MAX_TOKENS, temperature=0.0)
        assert_idle(engine)
    assert [r.output_token_ids for r in results] == [b.output_token_ids for b in baselines]
    drafted = sum(r.speculative.drafted_tokens for r in results)
    accepted = sum(r.speculative.accepted_tokens for r in results)
    if corrupt == ():
        assert accepted == drafted > 0
        assert all(r.speculative.rounds < r.completion_tokens // 2 for r in results)
    elif corrupt == "all":
        assert accepted == 0 and drafted > 0
    else:
        assert 0 < accepted < drafted
    for result in results:
        counters = result.speculative
        assert result.completion_tokens == 1 + counters.accepted_tokens + counters.rounds + counters.fallback_steps


def test_stops_inside_a_round_commit_the_exact_prefix(tiny, baselines):
    """Stop token, stop string and max_tokens landing mid-round finish exactly like plain decoding."""
    _artifact, _runtime, tokenizer = tiny
    base = baselines[3].output_token_ids
    stop_token = base[6]
    stop_string = tokenizer.decode([base[4]]).strip() or None
    cases = [dict(stop_token_ids=[stop_token]), dict(max_tokens=7)]
    if stop_string:
        cases.append(dict(stop=[stop_string]))
    for extra in cases:
        sampling = dict(temperature=0.0, max_tokens=extra.pop("max_tokens", 14), **extra)
        with make_engine(tiny) as engine:
            plain = engine.submit(GenerationRequest(tuple(PROMPTS[3]), SamplingParams(**sampling))).result(60)
        drafter = OracleDrafter(tiny[1], 5, references(baselines))
        with make_engine(tiny, drafter) as engine:
            spec = engine.submit(GenerationRequest(tuple(PROMPTS[3]), SamplingParams(**sampling))).result(60)
            assert_idle(engine)
        assert spec.output_token_ids == plain.output_token_ids, extra
        assert (spec.finish_reason, spec.stop, spec.text) == (plain.finish_reason, plain.stop, plain.text)
        assert spec.completion_tokens < len(base)
        if "max_tokens" not in sampling or sampling["max_tokens"] == 14:
            assert plain.finish_reason == "stop"


@pytest.mark.parametrize("corrupt", [(), (3, 4)], ids=["accepted", "rejected"])
def test_budget_close_insert_inside_a_round_matches_plain_decoding(tiny, corrupt):
    policy = BudgetClose(limit=4, close_token_id=3, insert_token_ids=(11, 12, 13))
    request = GenerationRequest(tuple(PROMPTS[2]), SamplingParams(temperature=0.0, max_tokens=14), budget_close=policy)
    with make_engine(tiny) as engine:
        plain = engine.submit(request).result(60)
    assert plain.control_tokens == 3
    drafter = OracleDrafter(tiny[1], 5, {tuple(PROMPTS[2]): [*PROMPTS[2], *plain.output_token_ids]}, corrupt)
    with make_engine(tiny, drafter) as engine:
        spec = engine.submit(request).result(60)
        assert_idle(engine)
    assert spec.output_token_ids == plain.output_token_ids
    assert spec.control_tokens == 3


def test_follow_up_turn_reuses_the_checkpoint_of_a_speculative_request(tiny, registries):
    prompt = prompts_of([30], seed=1)[0]
    extra = prompts_of([5], seed=2)[0]
    def greedy(tokens):
        return GenerationRequest(tuple(tokens), SamplingParams(temperature=0.0, max_tokens=9))

    with make_engine(tiny, prefix_reuse=False) as engine:
        first = engine.submit(greedy(prompt)).result(60)
        follow_up = prompt + list(first.output_token_ids) + extra
        plain = engine.submit(greedy(follow_up)).result(60)
    with make_engine(tiny, mtp(tiny, registries, 3)) as engine:
        spec_first = engine.submit(greedy(prompt)).result(60)
        spec_follow = engine.submit(greedy(follow_up)).result(60)
        spec_again = engine.submit(greedy(prompt)).result(60)  # an exact full-prompt checkpoint hit
        assert_idle(engine)
    assert spec_first.output_token_ids == first.output_token_ids
    assert spec_follow.output_token_ids == plain.output_token_ids
    assert spec_follow.cached_tokens > len(prompt)
    assert spec_again.output_token_ids == first.output_token_ids and spec_again.cached_tokens == len(prompt)
    assert spec_again.speculative == spec_first.speculative  # the drafter resumed at the hit: rounds as when cold


# -- T>0 --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 4])
def test_seeded_sampling_reproduces_and_matches_plain_decoding(tiny, k):
    """One-hot proposals draw once per committed token, so seeded outputs equal plain seeded outputs."""
    sampling = dict(
        temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, presence_penalty=0.5, frequency_penalty=0.3, seed=1234
    )
    with make_engine(tiny) as engine:
        plain = run(engine, PROMPTS, MAX_TOKENS, **sampling)
    for corrupt in ((), (1, 4, 8)):
        drafter = OracleDrafter(tiny[1], k, references(plain), corrupt)
        outs = []
        for _ in range(2):
            with make_engine(tiny, drafter) as engine:
                outs.append(run(engine, PROMPTS, MAX_TOKENS, **sampling))
        assert [r.output_token_ids for r in outs[0]] == [r.output_token_ids for r in outs[1]]
        assert [r.output_token_ids for r in outs[0]] == [r.output_token_ids for r in plain]
        assert sum(r.speculative.accepted_tokens for r in outs[0]) > 0


def empirical(verdicts: list[int], size: int) -> torch.Tensor:
    counts = torch.bincount(torch.tensor(verdicts), minlength=size).double()
    return counts / counts.sum()


def total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


SAMPLES = 20_000
VOCAB = 12


def dense(target: TargetDistribution, vocab: int = VOCAB) -> torch.Tensor:
    """The target distribution over the whole (test) vocabulary."""
    out = torch.zeros(vocab, dtype=torch.float64)
    out.index_add_(0, target.ids.to(torch.int64), target.probs.to(torch.float64))
    return out


def sparse(proposal: torch.Tensor) -> Proposal:
    """A dense test proposal as the drafters hand it over: its nonzero ids and their probabilities."""
    ids = torch.nonzero(proposal > 0).flatten()
    return Proposal(ids, proposal[ids])


def target_from(probs: list[float]) -> TargetDistribution:
    p = torch.tensor(probs, dtype=torch.float64)
    ids = torch.nonzero(p > 0).flatten()
    return TargetDistribution(probs=p[ids] / p[ids].sum(), ids=ids)


def sample_outputs(target: TargetDistribution, proposal: torch.Tensor | None, fixed_draft: int | None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    drafts = None
    if proposal is not None:
        drafts = torch.multinomial(proposal, SAMPLES, replacement=True, generator=generator)
    tokens, accepted = [], 0
    for index in range(SAMPLES):
        draft = int(drafts[index]) if drafts is not None else fixed_draft
        verdict = decide(target, draft, generator, sparse(proposal) if proposal is not None else None)
        accepted += verdict.accepted
        tokens.append(verdict.token)
    return empirical(tokens, VOCAB), accepted / SAMPLES


def test_rejection_sampling_with_a_different_proposal_recovers_the_target():
    target = target_from([0.3, 0.25, 0.2, 0.1, 0.1, 0.05] + [0.0] * 6)
    proposal = torch.tensor([0.05, 0.1, 0.3, 0.05, 0.2, 0.1, 0.1, 0.1, 0, 0, 0, 0], dtype=torch.float64)
    dist, acceptance = sample_outputs(target, proposal, None)
    p = dense(target)
    assert total_variation(dist, p) < 0.02
    expected = float(torch.minimum(p, proposal).sum())  # 1 - TV(p, q)
    assert abs(acceptance - expected) < 0.02


def test_rejection_sampling_with_a_one_hot_proposal_recovers_the_target():
    target = target_from([0.1, 0.6, 0.2, 0.1] + [0.0] * 8)
    dist, acceptance = sample_outputs(target, None, fixed_draft=2)
    assert total_variation(dist, dense(target)) < 0.02
    assert abs(acceptance - 0.2) < 0.02


def test_rejection_sampling_respects_top_k_and_top_p_processing():
    params = SamplingParams(temperature=0.7, top_k=4, top_p=0.8)
    sampler = RowSampler(params, 5, VOCAB, torch.device("cpu"))
    logits = torch.tensor([[2.0, 1.5, 1.2, 1.0, 0.9, 0.5, 0.1, 0.0, -1.0, -2.0, 0.3, 0.2]])
    probs, ids = candidate_distribution(logits, [sampler])
    target = TargetDistribution(probs=probs[0].double(), ids=ids[0])
    p = dense(target)
    assert int((p > 0).sum()) <= 4  # top-k/top-p removed candidates
    proposal = torch.full((VOCAB,), 1.0 / VOCAB, dtype=torch.float64)
    dist, _ = sample_outputs(target, proposal, None, seed=3)
    assert total_variation(dist, p) < 0.02
    assert float(dist[p == 0].sum()) == 0.0


def test_greedy_acceptance_takes_the_argmax():
    target = TargetDistribution(argmax=5)
    generator = torch.Generator().manual_seed(0)
    assert decide(target, 5, generator).accepted
    verdict = decide(target, 4, generator)
    assert (verdict.token, verdict.accepted) == (5, False)


# -- startup and the live server ----------------------------------------------------------------------------------


def test_spec_mtp_without_mtp_weights_fails_at_startup(tmp_path, registries):
    path = write_tiny_artifact(tmp_path / "plain.ninfer", TinyOptions(family="qwen3_5", seed=0), registries)
    with pytest.raises(ConfigError, match="mtp"):
        load_engine(path, EngineConfig(pending_timeout_ms=None), speculative=SpeculativeConfig("mtp", 3))
    with pytest.raises(ConfigError, match="out of range"):
        load_engine(path, EngineConfig(pending_timeout_ms=None), speculative=SpeculativeConfig("mtp", 6))


def test_serve_with_spec_mtp_end_to_end(tmp_path, mtp_path):
    log_path = tmp_path / "requests.jsonl"
    args = ["--spec", "mtp", "--draft-tokens", "3", "--request-log-jsonl", str(log_path), "--max-context", "512"]
    (server,) = start_servers(tmp_path, [(mtp_path, args, {})], ["ninfer-tiny-qwen3_5-mtp"])
    try:
        client = server.client()
        model = client.models.list().data[0].id
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hello there"}], max_tokens=12, temperature=0.0
        )
        timings = response.model_extra["timings"]
        assert response.usage.completion_tokens == timings["predicted_n"]
        assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
        assert timings["draft_n"] > 0
    finally:
        assert server.stop() == 0
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    done = [r for r in records if r.get("event") == "request_done"]
    assert len(done) == 1
    speculative = done[0]["timings_seconds"]["speculative"]
    assert speculative["backend"] == "mtp" and speculative["draft_window"] == 3
    assert speculative["drafted_tokens"] == timings["draft_n"]
    assert speculative["accepted_tokens"] == timings["draft_n_accepted"]
    assert len(speculative["accepted_per_position"]) == 3
