"""Engine behaviour against the ChecksumRuntime, whose outputs expose any KV/state/position mistake.

The oracle (``oracle_greedy``) computes the correct continuation from the token list alone.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from ninfer.core.request import BudgetClose, GenerationRequest, SamplingParams

from ninfer.engine import AdmittedEvent, Engine, EngineConfig, FinishEvent, ProgressEvent, StopMatch, TokensEvent
from ninfer.core.errors import (
    CapacityError,
    EngineUnavailableError,
    InvalidRequestError,
    QueueTimeoutError,
    ServerOverloadedError,
)
from engine_fakes import (
    ChecksumRuntime,
    FailingRuntime,
    GatedRuntime,
    LetterTokenizer,
    idle,
    oracle_greedy,
    wait_for,
)

GREEDY = dict(temperature=0.0)


def make_engine(runtime=None, **options) -> Engine:
    config = dict(max_concurrency=8, max_context=256, page_size=4, prefill_chunk=16, pending_timeout_ms=None)
    config.update(options)
    return Engine(runtime or ChecksumRuntime(), EngineConfig(**config), tokenizer=LetterTokenizer())


def prompts_of(lengths, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(n)] for n in lengths]


def greedy(prompt, max_tokens, **extra) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY, **extra))


@pytest.fixture
def engine():
    engine = make_engine()
    yield engine
    engine.shutdown()


def test_batched_equals_alone_equals_oracle():
    runtime = ChecksumRuntime()
    gate = GatedRuntime(runtime)
    gate.open()
    engine = make_engine(gate, prefix_reuse=False, prefill_chunk=64)
    prompts = prompts_of([3, 17, 5, 40, 9, 26, 1, 33])
    alone = [engine.submit(greedy(p, 20)).result(10).output_token_ids for p in prompts]
    runtime.calls.clear()
    gate.close()  # hold the first forward until every request is queued
    handles = [engine.submit(greedy(p, 20)) for p in prompts]
    gate.open()
    batched = [h.result(10).output_token_ids for h in handles]
    assert alone == batched == [tuple(oracle_greedy(p, 20)) for p in prompts]
    decode_rounds = [lens for lens, mode in runtime.calls if len(lens) > 1]
    assert max(len(lens) for lens in decode_rounds) == 8  # all eight rows ran in one traversal
    assert all(len(lens) == 1 for lens, _ in runtime.calls if sum(lens) > len(lens))  # prefill runs alone
    assert idle(engine)
    engine.shutdown()


@pytest.mark.parametrize("chunk", [1, 16, 1024])
def test_prefill_chunk_does_not_change_output(chunk):
    runtime = ChecksumRuntime()
    engine = make_engine(runtime, prefill_chunk=chunk, prefix_reuse=False)
    prompt = prompts_of([37], seed=1)[0]
    assert engine.submit(greedy(prompt, 10)).result(10).output_token_ids == tuple(oracle_greedy(prompt, 10))
    prefill_calls = runtime.calls[: -(-37 // chunk)]
    assert all(lens[0] <= chunk for lens, _ in prefill_calls)
    assert sum(lens[0] for lens, _ in prefill_calls) == 37
    assert [mode for _, mode in prefill_calls] == ["none"] * (len(prefill_calls) - 1) + ["last"]
    engine.shutdown()


def test_prefill_chunks_interleave_with_decode_rounds():
    inner = ChecksumRuntime()
    runtime = GatedRuntime(inner)
    engine = make_engine(runtime, prefill_chunk=4, prefix_reuse=False)
    short, long = prompts_of([2, 40], seed=2)
    first = engine.submit(greedy(short, 30))
    runtime.allow(2)  # its prefill and one decode round
    wait_for(lambda: runtime.started == 3)
    second = engine.submit(greedy(long, 4))
    runtime.open()
    assert first.result(10).output_token_ids == tuple(oracle_greedy(short, 30))
    assert second.result(10).output_token_ids == tuple(oracle_greedy(long, 4))
    modes = [mode for _, mode in inner.calls]
    # While the long prompt prefilled (mode "none" chunks), decode rounds kept running between its chunks.
    none_positions = [i for i, mode in enumerate(modes) if mode == "none"]
    assert len(none_positions) >= 5
    assert all(b - a >= 2 for a, b in zip(none_positions, none_positions[1:]))
    engine.shutdown()


def test_prefix_reuse_is_exact_and_reports_cached_tokens():
    engine = make_engine(page_size=4)
    prompt = prompts_of([22], seed=3)[0]
    first = engine.submit(greedy(prompt, 9)).result(10)
    again = engine.submit(greedy(prompt, 9)).result(10)
    assert first.cached_tokens == 0 and again.cached_tokens == len(prompt)
    assert again.output_token_ids == first.output_token_ids == tuple(oracle_greedy(prompt, 9))
    assert again.timings.timings_dict()["prompt_n"] == 0
    follow_up = prompt + list(first.output_token_ids) + [5, 6, 7]
    extended = engine.submit(greedy(follow_up, 9)).result(10)
    assert extended.cached_tokens == len(prompt) + 8  # everything fed: prompt + all outputs but the last
    assert extended.output_token_ids == tuple(oracle_greedy(follow_up, 9))
    diverged = prompt[:10] + [1, 2, 3]
    partial = engine.submit(greedy(diverged, 5)).result(10)
    assert partial.cached_tokens == 0 and partial.output_token_ids == tuple(oracle_greedy(diverged, 5))
    assert idle(engine)
    engine.shutdown()


def test_checkpoint_offsets_capture_reusable_frontiers():
    engine = make_engine(page_size=4)
    shared = prompts_of([10], seed=11)[0]
    first_prompt, second_prompt = shared + [1, 2, 3, 4, 5], shared + [9, 8, 7]
    request = GenerationRequest(first_prompt, SamplingParams(max_tokens=3, **GREEDY), checkpoint_offsets=(10, 0, 99))
    first = engine.submit(request).result(10)
    assert first.output_token_ids == tuple(oracle_greedy(first_prompt, 3))  # the extra chunk cut changes nothing
    second = engine.submit(greedy(second_prompt, 3)).result(10)
    assert second.cached_tokens == 10  # diverges after the frontier: only the breakpoint checkpoint matches
    assert second.output_token_ids == tuple(oracle_greedy(second_prompt, 3))
    assert idle(engine)
    engine.shutdown()


def test_requests_queued_behind_a_shared_prefix_prefill_resume_from_its_checkpoint():
    """Four conversations sent at once with one system prompt: the first prefills it, the rest wait for its
    checkpoint and resume there (without the wait they would start at root, prefilling the prefix again)."""
    runtime = ChecksumRuntime()
    gate = GatedRuntime(runtime)
    engine = make_engine(gate, max_concurrency=4, prefill_chunk=16)
    shared = prompts_of([40], seed=13)[0]
    prompts = [shared + [index + 1, 7, index + 3] for index in range(4)]
    handles = [engine.submit(GenerationRequest(p, SamplingParams(max_tokens=4, **GREEDY), checkpoint_offsets=(40,)))
               for p in prompts]  # the first request's first chunk waits at the gate until all are queued
    gate.open()
    outcomes = [handle.result(10) for handle in handles]
    assert [o.cached_tokens for o in outcomes] == [0, 40, 40, 40]
    assert [o.output_token_ids for o in outcomes] == [tuple(oracle_greedy(p, 4)) for p in prompts]
    assert idle(engine)
    engine.shutdown()


def test_checkpoint_offsets_are_ignored_without_prefix_reuse():
    engine = make_engine(page_size=4, prefix_reuse=False)
    prompt = prompts_of([12], seed=12)[0]
    out = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=2, **GREEDY), checkpoint_offsets=(6,))).result(10)
    assert out.output_token_ids == tuple(oracle_greedy(prompt, 2)) and engine.stats().memory.checkpoints == 0
    engine.shutdown()


def test_no_prefix_reuse_never_caches():
    engine = make_engine(prefix_reuse=False)
    prompt = prompts_of([20], seed=4)[0]
    outcomes = [engine.submit(greedy(prompt, 5)).result(10) for _ in range(2)]
    assert [o.cached_tokens for o in outcomes] == [0, 0]
    assert engine.stats().memory.checkpoints == 0
    engine.shutdown()


def test_checkpoints_are_evicted_under_page_pressure():
    # 12 pages of 4 tokens; each request reserves 8 pages, so a retained checkpoint must be evicted.
    engine = make_engine(max_concurrency=1, max_context=32, kv_capacity=48, page_size=4)
    a, b = prompts_of([20, 20], seed=5)
    engine.submit(greedy(a, 12)).result(10)
    assert engine.stats().memory.checkpoints > 0
    out = engine.submit(greedy(b, 12)).result(10)
    assert out.output_token_ids == tuple(oracle_greedy(b, 12))
    assert idle(engine)
    engine.shutdown()


def test_checkpoint_is_consumed_when_sharing_it_would_block_the_reservation():
    # The follow-up is entitled to the whole pool; the matching checkpoint ends mid-page, so sharing it (which
    # copies the partial page) would leave one page short forever. Admission takes the checkpoint over instead.
    engine = make_engine(max_concurrency=1, max_context=32, kv_capacity=32, page_size=4)
    prompt = prompts_of([13], seed=8)[0]
    engine.submit(greedy(prompt, 1)).result(10)
    assert engine.stats().memory.checkpoints > 0
    out = engine.submit(greedy(prompt, 32 - len(prompt))).result(10)
    assert out.cached_tokens == len(prompt)
    assert out.output_token_ids == tuple(oracle_greedy(prompt, 32 - len(prompt)))
    fed = prompt + list(out.output_token_ids[:-1])  # the finished request's checkpoint: everything it fed
    again = engine.submit(greedy(fed + [7], 0)).result(10)
    assert again.cached_tokens == len(fed) == 31
    assert idle(engine)
    engine.shutdown()


def test_shared_pages_survive_when_their_first_owner_finishes():
    engine = make_engine(max_concurrency=2, page_size=4, prefill_chunk=3)
    base = prompts_of([13], seed=6)[0]
    engine.submit(greedy(base, 1)).result(10)  # leaves a checkpoint of the 13-token prompt
    long_run = engine.submit(greedy(base + [1, 2], 40))
    other = engine.submit(greedy(base + [3], 20))
    assert long_run.result(10).output_token_ids == tuple(oracle_greedy(base + [1, 2], 40))
    assert other.result(10).output_token_ids == tuple(oracle_greedy(base + [3], 20))
    assert long_run.outcome.cached_tokens == other.outcome.cached_tokens == 13
    assert idle(engine)
    engine.shutdown()


def test_over_capacity_is_server_overloaded():
    runtime = GatedRuntime(ChecksumRuntime())
    engine = make_engine(runtime, max_concurrency=1, max_pending_requests=1)
    tickets = [engine.reserve_slot(), engine.reserve_slot()]
    with pytest.raises(ServerOverloadedError) as info:
        engine.reserve_slot()
    assert info.value.status == 429 and info.value.code == "server_overloaded"
    with pytest.raises(ServerOverloadedError):
        engine.submit(greedy([1, 2], 3))
    tickets[0].release()
    tickets[0].release()  # idempotent
    handle = engine.submit(greedy([1, 2], 3), tickets[1])
    extra = engine.submit(greedy([1, 2], 3))
    with pytest.raises(ServerOverloadedError):
        engine.reserve_slot()
    runtime.open()
    handle_outcome = handle.result(10)
    wait_for(lambda: extra.done)
    # A finished result that has not been consumed still holds capacity.
    assert engine.stats().outstanding == 1
    last = engine.reserve_slot()
    with pytest.raises(ServerOverloadedError):
        engine.reserve_slot()
    extra.close()
    last.release()
    assert engine.stats().outstanding == 0
    assert handle_outcome.output_token_ids == tuple(oracle_greedy([1, 2], 3))
    engine.shutdown()


def test_queue_timeout_while_waiting_behind_a_busy_engine():
    runtime = GatedRuntime(ChecksumRuntime())
    engine = make_engine(runtime, max_concurrency=1, pending_timeout_ms=50, max_context=2048)
    running = engine.submit(greedy([1, 2, 3], 2000))  # holds the only lane far longer than the timeout
    wait_for(lambda: runtime.started >= 1)
    waiting = engine.submit(greedy([4, 5, 6], 5))

    def tick() -> None:  # let the engine step slowly: deadlines are checked at every step boundary
        while not waiting.done:
            runtime.allow(1)
            time.sleep(0.005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    with pytest.raises(QueueTimeoutError) as info:
        waiting.result(10)
    ticker.join()
    assert info.value.status == 503 and info.value.code == "request_queue_timeout"
    running.cancel()
    runtime.open()
    outcome = running.result(10)  # an admitted request has no pending deadline
    assert outcome.finish_reason == "cancelled" and outcome.completion_tokens > 0
    assert engine.stats().outstanding == 0
    engine.shutdown()


def test_queue_deadline_starts_before_preparation():
    engine = make_engine(pending_timeout_ms=1)
    ticket = engine.reserve_slot()
    wait_for(lambda: ticket.expired())
    with pytest.raises(QueueTimeoutError):
        engine.submit(greedy([1], 2), ticket)
    assert engine.stats().outstanding == 0
    engine.shutdown()


def test_cancel_waiting_prefilling_and_decoding_frees_everything():
    runtime = GatedRuntime(ChecksumRuntime())
    engine = make_engine(runtime, max_concurrency=2, prefill_chunk=2, page_size=4)
    prompt = prompts_of([12], seed=7)[0]
    decoding = engine.submit(greedy(prompt, 100))
    runtime.allow(6 + 3)  # 6 prefill chunks, then 3 decode rounds
    wait_for(lambda: runtime.finished == 9 and runtime.started == 10)
    prefilling = engine.submit(greedy(prompts_of([20], seed=8)[0], 10))
    waiting = engine.submit(greedy([1, 2, 3], 10))
    runtime.allow(2)  # the decode round in flight, then the first prefill chunk
    wait_for(lambda: runtime.finished == 11 and runtime.started == 12)
    stats = engine.stats()
    assert (stats.prefilling, stats.decoding, stats.waiting) == (1, 1, 1)
    for handle in (waiting, prefilling, decoding):
        handle.cancel()
    runtime.open()
    outcomes = [h.result(10) for h in (waiting, prefilling, decoding)]
    assert [o.finish_reason for o in outcomes] == ["cancelled"] * 3
    assert outcomes[0].completion_tokens == outcomes[1].completion_tokens == 0
    assert outcomes[2].output_token_ids == tuple(oracle_greedy(prompt, len(outcomes[2].output_token_ids)))
    assert 4 <= outcomes[2].completion_tokens < 100
    assert idle(engine)
    assert engine.stats().outstanding == 0
    engine.shutdown()


def test_close_cancels_and_releases():
    runtime = GatedRuntime(ChecksumRuntime())
    engine = make_engine(runtime, max_concurrency=1)
    handle = engine.submit(greedy([1, 2, 3], 50))
    handle.close()
    runtime.open()
    wait_for(lambda: handle.done)
    assert handle.outcome.finish_reason == "cancelled"
    assert engine.stats().outstanding == 0 and idle(engine)
    engine.shutdown()


def test_engine_failure_fails_everything_in_flight():
    runtime = GatedRuntime(FailingRuntime(ChecksumRuntime(), fail_at=3))
    engine = make_engine(runtime, max_concurrency=1, prefill_chunk=100)
    handles = [engine.submit(greedy([1, 2, 3], 20)), engine.submit(greedy([4, 5], 20))]  # one runs, one waits
    runtime.open()
    for handle in handles:
        with pytest.raises(EngineUnavailableError) as info:
            handle.result(10)
        assert info.value.status == 503 and "simulated device fault" in info.value.message
    assert not engine.healthy and "simulated device fault" in engine.failure
    with pytest.raises(EngineUnavailableError):
        engine.submit(greedy([1], 2))
    with pytest.raises(EngineUnavailableError):
        engine.reserve_slot()
    engine.shutdown()


def test_shutdown_cancels_in_flight_and_refuses_new_work():
    runtime = GatedRuntime(ChecksumRuntime())
    engine = make_engine(runtime, max_concurrency=1)
    handle = engine.submit(greedy([1, 2, 3], 50))
    wait_for(lambda: runtime.started >= 1)
    engine.shutdown(timeout=0)  # the stop is queued behind the forward in flight
    runtime.open()
    assert handle.result(10).finish_reason == "cancelled"
    wait_for(lambda: not engine.healthy)
    with pytest.raises(EngineUnavailableError):
        engine.submit(greedy([1], 2))


def test_stop_token_counts_in_usage_but_its_text_is_withheld(engine):
    prompt = prompts_of([10], seed=9)[0]
    expected = oracle_greedy(prompt, 8)
    stop_id = expected[3]
    cut = expected.index(stop_id)
    outcome = engine.submit(greedy(prompt, 8, stop_token_ids=[stop_id])).result(10)
    assert outcome.finish_reason == "stop" and outcome.stop == StopMatch(token_id=stop_id)
    assert outcome.output_token_ids == tuple(expected[: cut + 1])
    assert outcome.usage.completion_tokens == cut + 1
    assert outcome.text == LetterTokenizer().decode(expected[:cut])


def test_eos_ids_stop_unless_ignored():
    prompt = prompts_of([10], seed=9)[0]
    expected = oracle_greedy(prompt, 8)
    engine = Engine(ChecksumRuntime(), EngineConfig(max_context=64, page_size=4), tokenizer=LetterTokenizer(), eos_token_ids=[expected[2]])
    assert engine.submit(greedy(prompt, 8)).result(10).finish_reason == "stop"
    assert engine.submit(greedy(prompt, 8, ignore_eos=True)).result(10).output_token_ids == tuple(expected)
    engine.shutdown()


def test_stop_string_across_token_boundary_is_withheld(engine):
    tok = LetterTokenizer()
    prompt = prompts_of([10], seed=10)[0]
    expected = oracle_greedy(prompt, 10)
    stop = tok.text_of(expected[4])[1] + tok.text_of(expected[5])[0]  # spans tokens 4 and 5
    handle = engine.submit(greedy(prompt, 10, stop=[stop]))
    events = [e for e in handle if isinstance(e, TokensEvent)]
    outcome = handle.outcome
    full = tok.decode(expected)
    assert full.index(stop) == 9  # the prompt is chosen so that the first occurrence spans tokens 4 and 5
    assert outcome.finish_reason == "stop" and outcome.stop == StopMatch(string=stop)
    assert outcome.text == full[: full.index(stop)]
    assert "".join(e.text for e in events) == outcome.text
    assert events[4].text == tok.text_of(expected[4])[0]  # the possible stop prefix was held back
    assert outcome.completion_tokens == full.index(stop) // 2 + 2


def test_max_tokens_zero_processes_the_prompt_only(engine):
    prompt = prompts_of([9], seed=11)[0]
    outcome = engine.submit(greedy(prompt, 0)).result(10)
    assert outcome.finish_reason == "length" and outcome.completion_tokens == 0
    assert outcome.timings.timings_dict()["prompt_n"] == 9
    assert engine.submit(greedy(prompt, 3)).result(10).cached_tokens == 9  # the prompt was really processed


def test_context_exhaustion_finishes_with_length():
    engine = make_engine(max_context=20)
    prompt = prompts_of([15], seed=12)[0]
    outcome = engine.submit(greedy(prompt, 100)).result(10)
    assert outcome.finish_reason == "length" and outcome.completion_tokens == 5
    assert outcome.output_token_ids == tuple(oracle_greedy(prompt, 5))
    with pytest.raises(CapacityError) as info:
        engine.submit(greedy(list(range(21)), 1))
    assert info.value.code == "context_length_exceeded" and "21" in info.value.message
    engine.shutdown()


def test_request_larger_than_kv_capacity_fails_immediately():
    engine = make_engine(max_context=64, kv_capacity=16, page_size=4)
    with pytest.raises(CapacityError) as info:
        engine.submit(greedy(list(range(10)), 10))
    assert "10 tokens" in info.value.message and "16" in info.value.message
    assert engine.stats().outstanding == 0
    engine.shutdown()


def test_large_head_request_is_not_overtaken():
    runtime = GatedRuntime(ChecksumRuntime())
    engine = make_engine(runtime, max_concurrency=2, max_context=40, kv_capacity=48, page_size=4)
    small = engine.submit(greedy([1, 2], 14))  # 4 of 12 pages
    wait_for(lambda: runtime.started >= 1)
    big = engine.submit(greedy([3, 4], 38))  # needs 10 pages: waits for the first
    later = engine.submit(greedy([5, 6], 2))  # fits now, but must not overtake the big head
    runtime.open()
    outcomes = [h.result(10) for h in (small, big, later)]
    assert outcomes[2].timings.admitted_at >= outcomes[1].timings.admitted_at
    assert [o.output_token_ids for o in outcomes] == [
        tuple(oracle_greedy([1, 2], 14)),
        tuple(oracle_greedy([3, 4], 38)),
        tuple(oracle_greedy([5, 6], 2)),
    ]
    engine.shutdown()


def test_budget_close_inserts_control_tokens(engine):
    prompt = prompts_of([8], seed=13)[0]
    natural = oracle_greedy(prompt, 3)
    insert = (90, 91, 92)
    close = 96 if 96 not in natural else 95
    policy = BudgetClose(limit=3, close_token_id=close, insert_token_ids=insert)
    handle = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=10, **GREEDY), budget_close=policy))
    events = [e for e in handle if isinstance(e, TokensEvent)]
    outcome = handle.outcome
    after = oracle_greedy(prompt + natural + list(insert), 4)
    assert outcome.output_token_ids == tuple(natural) + insert + tuple(after)
    assert outcome.usage.completion_tokens == 10 and outcome.control_tokens == 3
    assert [e.control for e in events] == [False, False, False, True, False, False, False, False]
    assert events[3].token_ids == insert
    timings = outcome.timings
    assert (timings.prefill_units, timings.control_units) == (1, 1)
    assert timings.decode_rounds == 10 - len(insert) - 1  # one round per sampled token after the first


def test_budget_close_is_skipped_when_the_model_closes_first(engine):
    prompt = prompts_of([8], seed=13)[0]
    natural = oracle_greedy(prompt, 6)
    policy = BudgetClose(limit=3, close_token_id=natural[1], insert_token_ids=(90, 91))
    outcome = engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=6, **GREEDY), budget_close=policy)).result(10)
    assert outcome.output_token_ids == tuple(natural) and outcome.control_tokens == 0


def test_budget_close_without_room_is_rejected_at_submit(engine):
    policy = BudgetClose(limit=4, close_token_id=96, insert_token_ids=(90, 91, 92))
    with pytest.raises(InvalidRequestError) as info:
        engine.submit(GenerationRequest([1, 2], SamplingParams(max_tokens=7), budget_close=policy))
    assert info.value.code == "thinking_budget_capacity_insufficient"
    # Room for the insert plus one token, or a budget the output limit never reaches, is fine.
    engine.submit(GenerationRequest([1, 2], SamplingParams(max_tokens=8, **GREEDY), budget_close=policy)).result(10)
    engine.submit(GenerationRequest([1, 2], SamplingParams(max_tokens=4, **GREEDY), budget_close=policy)).result(10)
    assert engine.stats().outstanding == 0


def test_progress_events_follow_prefill_chunks():
    engine = make_engine(prefill_chunk=4)
    prompt = prompts_of([10], seed=14)[0]
    events = list(engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=2, **GREEDY), report_progress=True)))
    assert events[0] == AdmittedEvent(10, 0, events[0].time)
    progress = [e for e in events if isinstance(e, ProgressEvent)]
    assert [(p.total, p.cache, p.processed) for p in progress] == [(10, 0, 0), (10, 0, 4), (10, 0, 8), (10, 0, 10)]
    assert events.index(progress[-1]) < min(i for i, e in enumerate(events) if isinstance(e, TokensEvent))
    assert isinstance(events[-1], FinishEvent)
    events = list(engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=2, **GREEDY), report_progress=True)))
    assert isinstance(events[0], AdmittedEvent) and events[0].cached_tokens == 10
    assert [(p.total, p.cache, p.processed) for p in events if isinstance(p, ProgressEvent)] == [(10, 10, 10)]
    engine.shutdown()


def test_async_events_match_blocking_results(engine):
    prompts = prompts_of([5, 12, 7], seed=15)

    async def consume(prompt):
        handle = engine.submit(greedy(prompt, 6))
        tokens = []
        async for event in handle.events():
            if isinstance(event, TokensEvent):
                tokens.extend(event.token_ids)
            last = event
        return tokens, last

    async def main():
        return await asyncio.gather(*(consume(p) for p in prompts))

    results = asyncio.run(main())
    for prompt, (tokens, last) in zip(prompts, results):
        assert tokens == oracle_greedy(prompt, 6)
        assert isinstance(last, FinishEvent) and list(last.outcome.output_token_ids) == tokens
    assert engine.stats().outstanding == 0


def test_seeded_sampling_reproduces_independently_of_batching():
    engine = make_engine(prefix_reuse=False)
    prompt = prompts_of([6], seed=16)[0]
    sampled = dict(temperature=1.0, top_k=0, max_tokens=16)

    def run(seed, company=0):
        others = [engine.submit(GenerationRequest(p, SamplingParams(seed=seed + 1 + i, **sampled))) for i, p in enumerate(prompts_of([3] * company, seed=17))]
        handle = engine.submit(GenerationRequest(prompt, SamplingParams(seed=seed, **sampled)))
        out = handle.result(10)
        for other in others:
            other.result(10)
        return out.output_token_ids, out.seed

    assert run(7) == run(7) == run(7, company=5)
    assert run(7)[0] != run(8)[0]
    unseeded = [engine.submit(GenerationRequest(prompt, SamplingParams(**sampled))).result(10) for _ in range(2)]
    assert unseeded[0].seed != unseeded[1].seed and isinstance(unseeded[0].seed, int)
    engine.shutdown()


def test_greedy_config_forces_argmax():
    engine = make_engine(greedy=True)
    prompt = prompts_of([6], seed=18)[0]
    outcome = engine.submit(GenerationRequest(prompt, SamplingParams(temperature=1.0, max_tokens=8))).result(10)
    assert outcome.output_token_ids == tuple(oracle_greedy(prompt, 8))
    engine.shutdown()


def test_timings_of_a_finished_request(engine):
    outcome = engine.submit(greedy(prompts_of([12], seed=19)[0], 6)).result(10)
    timings = outcome.timings
    assert timings.submitted_at <= timings.admitted_at <= timings.prompt_done_at <= timings.first_token_at
    assert timings.first_token_at <= timings.last_token_at <= timings.finished_at
    data = timings.timings_dict()
    assert (data["cache_n"], data["prompt_n"], data["predicted_n"]) == (0, 12, 6)


def test_invalid_prompts_are_rejected(engine):
    with pytest.raises(InvalidRequestError):
        engine.submit(greedy([], 2))
    with pytest.raises(InvalidRequestError):
        engine.submit(greedy([97], 2))
    with Engine(ChecksumRuntime(), EngineConfig(max_context=64)) as without_tokenizer:
        with pytest.raises(InvalidRequestError) as info:
            without_tokenizer.submit(greedy([1], 2, stop=["x"]))
        assert info.value.param == "stop"
    assert engine.stats().outstanding == 0
