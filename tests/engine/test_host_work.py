"""The executor's host-work phase clock, its reports, and the exposure an engine attaches to finished requests.

Unit oracles are hand-computed from a scripted nanosecond clock; engine oracles are invariants of the contract
(exclusive phases, totals that are exact sums, segments charged in full to every participant but counted once by
the worker, request exposure inside the request's engine residence).
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import jsonschema
import pytest
import torch

from paths import DOCS
from ninfer.core.request import BudgetClose, GenerationRequest, SamplingParams
from ninfer.engine import Engine, EngineConfig
from ninfer.engine.host_work import (
    CLASS_NAMES,
    DETAIL_NAMES,
    HOST_PHASES,
    PHASE_NAMES,
    Detail,
    HostWorkClock,
    HostWorkTotals,
    HostPhase,
    RequestHostWork,
    WorkClass,
)
from ninfer.engine.timings import HostExposure, RequestTimings
from ninfer.observability.request_log import HOST_PHASES as LOGGED_PHASES
from ninfer.observability.request_log import engine_timing_fields
from ninfer.observability.throughput import (
    IntervalCounts,
    RoundCounts,
    ThroughputReporter,
    host_work_fields,
    pretty_line,
    throughput_fields,
)
from engine_fakes import ChecksumRuntime, wait_for

SCHEMA = json.loads((DOCS / "request-log.schema.json").read_text())
GREEDY = {"temperature": 0.0}


class ScriptedTime:
    """A nanosecond clock that only moves when told to."""

    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns

    def advance(self, ns: int) -> None:
        self.ns += ns


def slot(phase: int, work_class: int) -> int:
    return phase * len(CLASS_NAMES) + work_class


@pytest.fixture
def timed() -> tuple[HostWorkClock, ScriptedTime]:
    now = ScriptedTime()
    return HostWorkClock(now), now


# -- the clock -------------------------------------------------------------------------------------------------------


def test_every_segment_goes_to_exactly_one_phase_and_class(timed):
    clock, now = timed
    script = [
        (HostPhase.ENGINE_BOUNDARY, WorkClass.CONTROL, 5),
        (HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE, 40),
        (HostPhase.DEVICE_WAIT, WorkClass.DECODE, 300),
        (HostPhase.PROGRAM_POST, WorkClass.DECODE, 7),
        (HostPhase.ENGINE_COMMIT_OUTPUT, WorkClass.DECODE, 11),
        (HostPhase.PROGRAM_SUBMIT, WorkClass.PREFILL, 100),
        (HostPhase.ENGINE_MAINTENANCE, WorkClass.CONTROL, 3),
        (HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE, 60),
    ]
    expected = [0] * (len(PHASE_NAMES) * len(CLASS_NAMES))
    for phase, work_class, duration in script:
        clock.switch(phase, work_class)
        now.advance(duration)
        expected[slot(phase, work_class)] += duration
    clock.idle()
    now.advance(10_000)  # idle time is nobody's
    totals = clock.totals()
    assert list(totals.elapsed_ns) == expected
    assert sum(totals.elapsed_ns) == sum(duration for *_, duration in script)
    assert totals.phase_seconds(HostPhase.PROGRAM_SUBMIT) == 200e-9
    assert totals.phase_seconds(HostPhase.DEVICE_WAIT) == 300e-9
    assert totals.class_host_seconds(WorkClass.DECODE) == pytest.approx(118e-9)
    assert totals.class_device_wait_seconds(WorkClass.DECODE) == pytest.approx(300e-9)
    assert totals.class_host_seconds(WorkClass.PREFILL) == pytest.approx(100e-9)
    assert totals.class_host_seconds(WorkClass.CONTROL) == pytest.approx(8e-9)


def test_the_open_segment_is_not_published_until_it_closes(timed):
    clock, now = timed
    clock.switch(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)
    now.advance(50)
    assert sum(clock.totals().elapsed_ns) == 0
    clock.switch(HostPhase.PROGRAM_POST, WorkClass.DECODE)
    assert clock.totals().elapsed_ns[slot(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)] == 50


def test_members_are_charged_each_segment_in_full_but_the_worker_counts_it_once(timed):
    clock, now = timed
    first, second, late = RequestHostWork(), RequestHostWork(), RequestHostWork()
    clock.charge([first, second])
    clock.switch(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)
    now.advance(100)
    clock.await_device(torch.device("cpu"), WorkClass.DECODE)
    now.advance(30)
    clock.switch(HostPhase.ENGINE_COMMIT_OUTPUT, WorkClass.DECODE)
    now.advance(20)
    clock.join(late)  # joins mid-segment: only what follows is its
    now.advance(5)
    clock.switch(HostPhase.ENGINE_MAINTENANCE, WorkClass.CONTROL)
    now.advance(8)
    clock.charge([late])  # the others leave: later time is not theirs
    now.advance(1000)
    clock.idle()
    for work in (first, second):
        exposure = work.exposure()
        assert exposure.phases == (0.0, 100e-9, 0.0, 25e-9, 8e-9)
        assert exposure.device_wait == 30e-9
        assert exposure.decode_host == 125e-9 and exposure.decode_device_wait == 30e-9
    assert late.exposure().phases == (0.0, 0.0, 0.0, 5e-9, 1008e-9)
    assert late.exposure().decode_host == 5e-9
    totals = clock.totals()
    assert sum(totals.elapsed_ns) == 100 + 30 + 25 + 1008  # once, whatever the number of members


def test_settle_brings_members_up_to_now_without_closing_the_phase(timed):
    clock, now = timed
    work = RequestHostWork()
    clock.charge([work])
    clock.switch(HostPhase.PROGRAM_POST, WorkClass.PREFILL)
    now.advance(40)
    assert work.exposure().phases[HostPhase.PROGRAM_POST] == 0.0
    clock.settle()
    assert work.exposure().phases[HostPhase.PROGRAM_POST] == 40e-9
    now.advance(2)
    assert clock.phase == HostPhase.PROGRAM_POST and clock.work_class == WorkClass.PREFILL
    clock.idle()
    assert work.exposure().phases[HostPhase.PROGRAM_POST] == 42e-9
    assert clock.phase is None


def test_reclassify_moves_the_whole_open_segment(timed):
    clock, now = timed
    clock.switch(HostPhase.ENGINE_COMMIT_OUTPUT, WorkClass.DECODE)
    now.advance(9)
    clock.reclassify(WorkClass.CONTROL)
    now.advance(1)
    clock.idle()
    totals = clock.totals()
    assert totals.elapsed_ns[slot(HostPhase.ENGINE_COMMIT_OUTPUT, WorkClass.CONTROL)] == 10
    assert totals.elapsed_ns[slot(HostPhase.ENGINE_COMMIT_OUTPUT, WorkClass.DECODE)] == 0


def test_details_are_subsets_with_invocation_counts(timed):
    clock, now = timed
    clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.CONTROL)
    for duration in (12, 30):
        with clock.detail(Detail.ADMISSION):
            now.advance(duration)
    with clock.detail(Detail.CONTEXT_TRANSACTION, enabled=False):
        now.advance(5)
    clock.idle()
    totals = clock.totals()
    assert totals.detail_ns[Detail.ADMISSION] == 42 and totals.detail_invocations[Detail.ADMISSION] == 2
    assert totals.detail_invocations[Detail.CONTEXT_TRANSACTION] == 0
    assert sum(totals.elapsed_ns) == 47  # the details are inside the boundary phase, not added to it


def test_interval_deltas(timed):
    clock, now = timed
    clock.switch(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)
    now.advance(10)
    clock.switch(HostPhase.ENGINE_MAINTENANCE, WorkClass.CONTROL)
    earlier = clock.totals(decode_rounds=1, decode_row_rounds=2)
    now.advance(4)
    clock.switch(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)
    now.advance(25)
    clock.idle()
    delta = clock.totals(decode_rounds=3, decode_row_rounds=7).minus(earlier)
    assert delta.decode_rounds == 2 and delta.decode_row_rounds == 5
    assert delta.elapsed_ns[slot(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)] == 25
    assert delta.elapsed_ns[slot(HostPhase.ENGINE_MAINTENANCE, WorkClass.CONTROL)] == 4
    assert HostWorkTotals.zero().minus(HostWorkTotals.zero()) == HostWorkTotals.zero()


# -- the reported fields ---------------------------------------------------------------------------------------------


def scripted_totals(rounds: int, row_rounds: int, admissions: int) -> HostWorkTotals:
    """Every (phase, class) once for ``1000 * (phase + 1) + 100 * class`` ns, then 700 ns per admission."""
    now = ScriptedTime()
    clock = HostWorkClock(now)
    for phase in range(len(PHASE_NAMES)):
        for work_class in range(len(CLASS_NAMES)):
            clock.switch(phase, work_class)
            now.advance(1000 * (phase + 1) + 100 * work_class)
    clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.CONTROL)
    for _ in range(admissions):
        with clock.detail(Detail.ADMISSION):
            now.advance(700)
    clock.idle()
    return clock.totals(rounds, row_rounds)


def test_host_work_fields_sum_exactly_and_normalize():
    fields = host_work_fields(scripted_totals(rounds=4, row_rounds=10, admissions=2))
    elapsed = fields["elapsed_seconds"]
    phases = [elapsed[name] for name in PHASE_NAMES[:5]]
    assert elapsed["total"] == sum(phases)
    assert list(elapsed) == [*PHASE_NAMES[:5], "total"]
    assert elapsed["engine_boundary"] == pytest.approx((1000 + 1100 + 1200 + 2 * 700) * 1e-9)  # details inside
    assert fields["device_wait_seconds"] == pytest.approx((6000 + 6100 + 6200) * 1e-9)
    decode = fields["work_class_seconds"]["decode"]
    assert decode["host_seconds"] == pytest.approx((1000 + 2000 + 3000 + 4000 + 5000) * 1e-9)
    assert decode["device_wait_seconds"] == pytest.approx(6000e-9)
    classes = fields["work_class_seconds"]
    assert sum(c["host_seconds"] for c in classes.values()) == pytest.approx(elapsed["total"])
    normalized = fields["normalized"]
    assert normalized["decode_host_seconds_per_round"] == pytest.approx(decode["host_seconds"] / 4)
    assert normalized["decode_device_wait_seconds_per_row_round"] == pytest.approx(6000e-9 / 10)
    per_invocation = normalized["detail_seconds_per_invocation"]
    assert per_invocation["admission"] == pytest.approx(700e-9)
    assert per_invocation["replica"] is None and per_invocation["stats_publication"] is None
    assert fields["detail_invocations"] == {"admission": 2, "context_transaction": 0, "replica": 0,
                                            "stats_publication": 0}


def test_normalized_values_are_null_at_zero_denominators():
    normalized = host_work_fields(scripted_totals(rounds=0, row_rounds=0, admissions=0))["normalized"]
    assert normalized["decode_host_seconds_per_round"] is None
    assert normalized["decode_device_wait_seconds_per_round"] is None
    assert normalized["decode_host_seconds_per_row_round"] is None
    assert normalized["decode_device_wait_seconds_per_row_round"] is None
    assert set(normalized["detail_seconds_per_invocation"]) == set(DETAIL_NAMES)
    assert all(value is None for value in normalized["detail_seconds_per_invocation"].values())


def test_engine_timing_total_is_the_exact_sum_of_the_printed_phases():
    exposure = HostExposure(phases=(0.1, 0.2, 0.3, 1e-7, 3.3), device_wait=0.25, decode_host=0.4,
                            decode_device_wait=0.2)
    timings = RequestTimings(submitted_at=1.0, admitted_at=1.5, finished_at=6.0, decode_rounds=3, prefill_units=2,
                             host_work=exposure)
    fields = engine_timing_fields(timings, 1.0)
    host = fields["host_exposed_seconds"]
    assert host["total"] == sum(host[name] for name in LOGGED_PHASES)
    assert [host[name] for name in LOGGED_PHASES] == list(exposure.phases)
    assert fields["device_wait_exposed_seconds"] == 0.25 and fields["queue_wait_seconds"] == 0.5
    assert fields["decode"] == {"host_exposed_seconds": 0.4, "device_wait_seconds": 0.2, "rounds": 3}
    never_ran = engine_timing_fields(RequestTimings(submitted_at=1.0, finished_at=2.0), 1.0)
    assert never_ran["host_exposed_seconds"]["total"] == 0.0 and never_ran["device_wait_exposed_seconds"] == 0.0


@attrs.frozen
class _Memory:
    checkpoints: int = 0
    checkpoint_pages: int = 0
    free_pages: int = 8
    total_pages: int = 8
    promised_pages: int = 0


@attrs.frozen
class _Stats:
    host_work: HostWorkTotals
    outstanding: int = 1
    waiting: int = 0
    prefilling: int = 0
    decoding: int = 1
    decode_rounds: int = 0
    decode_row_rounds: int = 0
    memory: _Memory = _Memory()


class _Engine:
    def __init__(self) -> None:
        self.published = HostWorkTotals.zero()

    def stats(self) -> _Stats:
        return _Stats(self.published)


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def write(self, event: str, fields: dict[str, Any]) -> None:
        self.events.append((event, fields))


def test_the_reporter_reports_interval_deltas_of_the_published_totals():
    engine, log = _Engine(), _Log()
    reporter = ThroughputReporter(engine, _counters(), 1000, log)
    engine.published = scripted_totals(rounds=4, row_rounds=10, admissions=1)
    assert reporter.report(2.0)
    first = log.events[-1][1]
    engine.published = scripted_totals(rounds=6, row_rounds=15, admissions=1)  # the same work, two more rounds
    assert reporter.report(2.0)
    second = log.events[-1][1]
    assert first["decode_rounds"] == {"rounds": 4, "row_rounds": 10, "average_size": 2.5}
    assert second["decode_rounds"]["rounds"] == 2
    # the second publication adds rounds but no time: every host-work delta is zero
    assert second["host_work"]["elapsed_seconds"]["total"] == 0.0
    assert second["host_work"]["normalized"]["decode_host_seconds_per_round"] == 0.0
    assert first["host_work"] == host_work_fields(scripted_totals(4, 10, 1))
    validator = jsonschema.Draft202012Validator(SCHEMA)
    for fields in (first, second):
        record = {"schema": "ninfer_serve_request_log", "schema_version": 20, "event": "throughput",
                  "timestamp_unix_ms": 1, "server_instance_id": "x", **fields}
        assert not [error.message for error in validator.iter_errors(record)]


def test_work_done_before_the_reporter_starts_is_not_reported():
    engine, log = _Engine(), _Log()
    engine.published = scripted_totals(rounds=4, row_rounds=10, admissions=1)  # e.g. startup work
    reporter = ThroughputReporter(engine, _counters(), 60_000, log)
    reporter.start()
    reporter.stop()  # reports the final partial interval
    [(event, fields)] = log.events
    assert event == "throughput" and fields["decode_rounds"]["rounds"] == 0
    assert fields["host_work"]["elapsed_seconds"]["total"] == 0.0
    assert fields["host_work"]["detail_invocations"]["admission"] == 0


def _counters() -> Any:
    from ninfer.observability.throughput import ThroughputCounters

    counters = ThroughputCounters()
    counters.add(decode_tokens=3)
    return counters


def test_pretty_line_shows_host_active_time_and_fraction():
    totals = scripted_totals(rounds=1, row_rounds=1, admissions=0)
    active = sum(totals.phase_seconds(phase) for phase in HOST_PHASES)
    line = pretty_line(IntervalCounts(decode_tokens=2), 0.0001, _Stats(totals), RoundCounts(1, 1), totals)
    assert f"host active {active:.2f} s ({100.0 * active / 0.0001:.1f}%)" in line
    assert "host active" not in pretty_line(IntervalCounts(decode_tokens=2), 1.0, _Stats(totals), RoundCounts(1, 1))
    assert throughput_fields(IntervalCounts(), 1.0, _Stats(totals))["host_work"] is None


# -- an engine's measurements ----------------------------------------------------------------------------------------


def run_all(engine: Engine, requests: list[GenerationRequest]) -> list[Any]:
    handles = [engine.submit(request) for request in requests]
    return [handle.result(60) for handle in handles]


def published(engine: Engine) -> HostWorkTotals:
    """The worker totals once the executor published its last iteration (it does so after finishing requests)."""
    wait_for(lambda: engine.stats().host_work.decode_rounds == engine.stats().decode_rounds
             and engine.stats().outstanding == 0)
    wait_for(lambda: engine._executor.clock.phase is None)  # idle: the last iteration has been published
    return engine.stats().host_work


def assert_exposure_is_consistent(outcome: Any) -> HostExposure:
    timings = outcome.timings
    exposure = timings.host_work
    assert exposure is not None
    assert all(value >= 0.0 for value in (*exposure.phases, exposure.device_wait))
    assert 0.0 <= exposure.decode_host <= exposure.host_total
    assert 0.0 <= exposure.decode_device_wait <= exposure.device_wait
    if timings.admitted_at is not None:  # every charged segment lies between admission and the finish
        residence = timings.finished_at - timings.admitted_at
        assert exposure.host_total + exposure.device_wait <= residence + 1e-3
    return exposure


def test_engine_requests_carry_their_exposure_and_the_worker_counts_shared_rounds_once():
    config = EngineConfig(max_concurrency=2, max_context=128, prefill_chunk=8)
    with Engine(ChecksumRuntime(), config) as engine:
        prompts = [tuple(range(1, 20)), tuple(range(30, 49))]
        outcomes = run_all(engine, [GenerationRequest(p, SamplingParams(max_tokens=12, **GREEDY)) for p in prompts])
        before = published(engine)
        exposures = [assert_exposure_is_consistent(outcome) for outcome in outcomes]
        for outcome, exposure in zip(outcomes, exposures):
            assert exposure.phases[HostPhase.PROGRAM_SUBMIT] > 0.0  # the request ran forwards
            assert exposure.decode_host > 0.0 and outcome.timings.decode_rounds == 11
            assert outcome.timings.prefill_units == 3  # 19 tokens in chunks of 8
            assert outcome.timings.host_work.phases[HostPhase.ENGINE_MAINTENANCE] > 0.0  # its own release
        worker_decode = before.class_host_seconds(WorkClass.DECODE)
        # both requests sat in the same decode rounds: each is charged those rounds in full, the worker once
        assert sum(exposure.decode_host for exposure in exposures) > worker_decode
        assert max(exposure.decode_host for exposure in exposures) <= worker_decode
        assert before.decode_row_rounds == sum(outcome.timings.decode_rounds for outcome in outcomes)
        assert before.detail_invocations[Detail.ADMISSION] == 2
        assert before.detail_invocations[Detail.STATS_PUBLICATION] > 0
        assert before.detail_invocations[Detail.REPLICA] == 0 and before.detail_ns[Detail.REPLICA] == 0
        # with prefix reuse on, each prompt end and each finished request is a checkpoint capture
        assert before.detail_invocations[Detail.CONTEXT_TRANSACTION] == 4
        assert before.class_device_wait_seconds(WorkClass.PREFILL) >= 0.0


def test_a_request_cancelled_while_queued_has_no_exposure():
    config = EngineConfig(max_concurrency=1, max_context=128, prefill_chunk=64)
    with Engine(ChecksumRuntime(), config) as engine:
        holder = engine.submit(GenerationRequest(tuple(range(1, 9)), SamplingParams(max_tokens=60, **GREEDY)))
        queued = engine.submit(GenerationRequest(tuple(range(1, 5)), SamplingParams(max_tokens=4, **GREEDY)))
        queued.cancel()
        outcome = queued.result(30)
        holder.result(60)
    assert outcome.finish_reason == "cancelled" and outcome.timings.admitted_at is None
    assert outcome.timings.host_work == HostExposure()


class SwitchSpy:
    """Records the (phase, work class) of every segment the executor opens, and every reclassification."""

    def __init__(self, clock: HostWorkClock) -> None:
        self.segments: list[tuple[int, int]] = []
        self.reclassified: list[tuple[int, int]] = []
        switch, reclassify = clock.switch, clock.reclassify

        def spy_switch(phase: int, work_class: int) -> None:
            self.segments.append((phase, work_class))
            switch(phase, work_class)

        def spy_reclassify(work_class: int) -> None:
            self.reclassified.append((clock.phase, work_class))
            reclassify(work_class)

        clock.switch, clock.reclassify = spy_switch, spy_reclassify  # type: ignore[method-assign]


def test_a_decode_round_runs_through_the_phases_in_order():
    with Engine(ChecksumRuntime(), EngineConfig(max_concurrency=1, max_context=128, prefix_reuse=False)) as engine:
        spy = SwitchSpy(engine._executor.clock)
        [outcome] = run_all(engine, [GenerationRequest(tuple(range(1, 9)), SamplingParams(max_tokens=3, **GREEDY))])
    assert outcome.completion_tokens == 3
    decode = [phase for phase, work_class in spy.segments if work_class == WorkClass.DECODE]
    one_round = [HostPhase.ENGINE_BOUNDARY, HostPhase.PROGRAM_SUBMIT, HostPhase.DEVICE_WAIT, HostPhase.PROGRAM_POST,
                 HostPhase.ENGINE_COMMIT_OUTPUT]
    assert decode == one_round * 2  # two decode rounds after the token sampled from the prompt
    prefill = [phase for phase, work_class in spy.segments if work_class == WorkClass.PREFILL]
    assert prefill[:2] == [HostPhase.ENGINE_BOUNDARY, HostPhase.PROGRAM_SUBMIT]
    assert HostPhase.DEVICE_WAIT in prefill and prefill[-1] == HostPhase.ENGINE_COMMIT_OUTPUT
    assert spy.reclassified == []


def test_a_budget_close_insert_is_committed_as_control_work():
    policy = BudgetClose(limit=2, close_token_id=96, insert_token_ids=(95, 94))
    with Engine(ChecksumRuntime(), EngineConfig(max_concurrency=1, max_context=128, prefix_reuse=False)) as engine:
        spy = SwitchSpy(engine._executor.clock)
        request = GenerationRequest(tuple(range(1, 9)), SamplingParams(max_tokens=8, **GREEDY), budget_close=policy)
        [outcome] = run_all(engine, [request])
        totals = published(engine)
    assert outcome.control_tokens == 2 and outcome.timings.control_units == 1
    assert spy.reclassified == [(HostPhase.ENGINE_COMMIT_OUTPUT, WorkClass.CONTROL)]
    assert totals.detail_invocations[Detail.CONTEXT_TRANSACTION] == 0  # reuse off: nothing captured
    assert_exposure_is_consistent(outcome)


# -- a speculative engine ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory):
    from ninfer.core.plugins import load_plugin_manager
    from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact
    from speculation_support import open_tiny

    registries = load_plugin_manager(entry_points=False).registries
    options = TinyOptions(family="qwen3_5", seed=0, mtp=True, template="qwen3_6")
    path = write_tiny_artifact(tmp_path_factory.mktemp("host-work") / "tiny-mtp.ninfer", options, registries)
    for tiny in open_tiny(path, registries):
        yield tiny, registries


def test_speculative_rounds_are_timed_as_decode_work(tiny_mtp):
    from speculation_support import drafter_for, make_engine, run

    tiny, registries = tiny_mtp
    with make_engine(tiny, drafter_for(tiny, registries, "mtp", 3), max_concurrency=2) as engine:
        spy = SwitchSpy(engine._executor.clock)
        outcomes = run(engine, [[300, 301, 302, 303], [400, 401, 402]], [9, 7], temperature=0.0)
        totals = published(engine)
    rounds = sum(outcome.speculative.rounds + outcome.speculative.fallback_steps for outcome in outcomes)
    assert rounds == totals.decode_row_rounds
    decode = [phase for phase, work_class in spy.segments if work_class == WorkClass.DECODE]
    # one explicit wait for the verify results per round; drafting and verification are program submission
    assert decode.count(HostPhase.DEVICE_WAIT) == totals.decode_rounds
    assert decode.count(HostPhase.PROGRAM_SUBMIT) > decode.count(HostPhase.DEVICE_WAIT)  # verify, plus drafting/observing
    assert totals.elapsed_ns[slot(HostPhase.PROGRAM_POST, WorkClass.DECODE)] > 0
    for outcome in outcomes:
        exposure = assert_exposure_is_consistent(outcome)
        assert exposure.decode_host > 0.0
        assert outcome.timings.decode_rounds == outcome.speculative.rounds + outcome.speculative.fallback_steps
