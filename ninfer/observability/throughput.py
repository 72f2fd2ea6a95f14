"""The fixed-interval throughput report: one stderr line and one JSONL ``throughput`` event per active interval.

Token counters are fed by the protocol layer as it receives engine commits (:class:`ThroughputCounters`);
the scheduler snapshot comes from ``Engine.stats()`` at the end of the interval. Fully idle intervals
(no counter moved and nothing outstanding) are omitted. Decode rounds and host work are deltas of the totals the
engine worker last published (:class:`HostWorkTotals`: each wall-time segment counted once, whatever the batch
size), and so are the context cache's host-tier counters (:class:`HostTierCounters`). Context-cache fields the engine
does not measure yet are reported as null; see ``docs/request-log.md``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import attrs

from ninfer.core.request import REUSE_PATHS
from ninfer.engine import (
    CLASS_NAMES,
    DETAIL_NAMES,
    HOST_PHASES,
    PHASE_NAMES,
    HostPhase,
    HostTierCounters,
    HostWorkTotals,
    SelectionCounters,
)
from ninfer.observability import oplog


@attrs.define
class IntervalCounts:
    """Counter deltas over one interval."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    requests_started: int = 0
    requests_finished: int = 0

    def idle(self) -> bool:
        return not (self.prefill_tokens or self.decode_tokens or self.requests_started or self.requests_finished)


class ThroughputCounters:
    """Thread-safe interval counters: prompt tokens computed by prefill, tokens committed by decode rounds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = IntervalCounts()

    def add(self, *, prefill_tokens: int = 0, decode_tokens: int = 0, started: int = 0, finished: int = 0) -> None:
        with self._lock:
            self._counts.prefill_tokens += prefill_tokens
            self._counts.decode_tokens += decode_tokens
            self._counts.requests_started += started
            self._counts.requests_finished += finished

    def take(self) -> IntervalCounts:
        """The deltas since the previous call; resets them."""
        with self._lock:
            counts, self._counts = self._counts, IntervalCounts()
        return counts


def scheduler_snapshot(stats: Any) -> dict[str, int]:
    """The engine's scheduler state; states the engine does not have yet are 0."""
    return {
        "running": stats.prefilling + stats.decoding,
        "prefilling": stats.prefilling,
        "decode_ready": stats.decoding,
        "waiting": stats.waiting,
        "materializing": 0,
        "capture_pending": 0,
        "terminal_pending": 0,
        "outstanding": stats.outstanding,
    }


@attrs.frozen
class RoundCounts:
    """Decode rounds in an interval and the rows they processed (a round's batch size summed)."""

    rounds: int = 0
    row_rounds: int = 0

    @property
    def average_size(self) -> float | None:
        return self.row_rounds / self.rounds if self.rounds else None


def _per(seconds: float, count: int) -> float | None:
    """A normalized value: null when its denominator is zero."""
    return seconds / count if count > 0 else None


def host_work_fields(work: HostWorkTotals) -> dict[str, Any]:
    """The JSONL ``host_work`` object of one interval's worker deltas."""
    phases = {PHASE_NAMES[phase]: work.phase_seconds(phase) for phase in HOST_PHASES}
    classes = {
        name: {
            "host_seconds": work.class_host_seconds(work_class),
            "device_wait_seconds": work.class_device_wait_seconds(work_class),
        }
        for work_class, name in enumerate(CLASS_NAMES)
    }
    details = {name: work.detail_seconds(detail) for detail, name in enumerate(DETAIL_NAMES)}
    invocations = dict(zip(DETAIL_NAMES, work.detail_invocations))
    decode = classes["decode"]
    return {
        "elapsed_seconds": {**phases, "total": sum(phases.values())},
        "device_wait_seconds": work.phase_seconds(HostPhase.DEVICE_WAIT),
        "work_class_seconds": classes,
        "detail_subset_seconds": details,
        "detail_invocations": invocations,
        "normalized": {
            "decode_host_seconds_per_round": _per(decode["host_seconds"], work.decode_rounds),
            "decode_device_wait_seconds_per_round": _per(decode["device_wait_seconds"], work.decode_rounds),
            "decode_host_seconds_per_row_round": _per(decode["host_seconds"], work.decode_row_rounds),
            "decode_device_wait_seconds_per_row_round": _per(decode["device_wait_seconds"], work.decode_row_rounds),
            "detail_seconds_per_invocation": {name: _per(details[name], invocations[name]) for name in details},
        },
    }


def context_cache_counters(delta: HostTierCounters, selections: SelectionCounters) -> dict[str, Any]:
    """The JSONL ``context_cache.counters`` object of one interval's host-tier and selection deltas."""
    chosen = attrs.asdict(selections)
    return {
        "host_tier": attrs.asdict(delta),
        "selections": {name: chosen[name] for name in (*REUSE_PATHS, "reused_prompt_tokens")},
        "captures": {"completed": selections.captures},
        "pressure": {name: chosen[name] for name in (
            "continuations_evicted", "shared_prefixes_dropped", "long_anchors_dropped")},
    }


def _occupancy(memory: Any) -> dict[str, int]:
    occupancy = {
        "checkpoints": memory.checkpoints,
        "checkpoint_pages": memory.checkpoint_pages,
        "free_pages": memory.free_pages,
        "total_pages": memory.total_pages,
        "promised_pages": memory.promised_pages,
    }
    if getattr(memory, "host_tier", None) is not None:  # an engine with the host tier's gauges
        occupancy.update(host_checkpoints=memory.host_checkpoints, host_kv_bytes=memory.host_kv_bytes)
    return occupancy


def _last_selection(memory: Any) -> dict[str, int] | None:
    """The latest admission's reused prompt tokens (a gauge), once there has been one."""
    frontier = getattr(memory, "last_frontier", None)
    return None if frontier is None else {"frontier_tokens": frontier}


def host_active_seconds(work: HostWorkTotals) -> float:
    """The interval's host-active time: the five host phases (device wait excluded)."""
    return sum(work.phase_seconds(phase) for phase in HOST_PHASES)


def throughput_fields(
    counts: IntervalCounts, interval_seconds: float, stats: Any, rounds: RoundCounts = RoundCounts(),
    host_work: HostWorkTotals | None = None, cache_counters: HostTierCounters | None = None,
    selections: SelectionCounters = SelectionCounters(),
) -> dict[str, Any]:
    """The JSONL ``throughput`` event body; ``cache_counters`` are the interval's host-tier deltas (None: null),
    ``selections`` its context-cache decisions."""
    memory = stats.memory
    return {
        "interval_seconds": interval_seconds,
        "tokens": {"prefill": counts.prefill_tokens, "decode": counts.decode_tokens},
        "requests": {"started": counts.requests_started, "finished": counts.requests_finished},
        "decode_rounds": {
            "rounds": rounds.rounds,
            "row_rounds": rounds.row_rounds,
            "average_size": rounds.average_size,
        },
        "scheduler": scheduler_snapshot(stats),
        "context_cache": {
            "occupancy": _occupancy(memory),
            "counters": None if cache_counters is None else context_cache_counters(cache_counters, selections),
            "last_selection": _last_selection(memory),
        },
        "host_work": None if host_work is None else host_work_fields(host_work),
    }


def pretty_line(
    counts: IntervalCounts, interval_seconds: float, stats: Any, rounds: RoundCounts = RoundCounts(),
    host_work: HostWorkTotals | None = None,
) -> str:
    """The rounded stderr summary: nonzero rates and counts, the running composition, nonzero waiting, host-active
    time and its fraction of the interval."""
    parts = []
    if counts.prefill_tokens:
        parts.append(f"prefill {counts.prefill_tokens} tok ({counts.prefill_tokens / interval_seconds:.1f} tok/s)")
    if counts.decode_tokens:
        parts.append(f"decode {counts.decode_tokens} tok ({counts.decode_tokens / interval_seconds:.1f} tok/s)")
    if rounds.average_size is not None:
        parts.append(f"avg batch {rounds.average_size:.1f}")
    if counts.requests_finished:
        parts.append(f"{counts.requests_finished} finished")
    snapshot = scheduler_snapshot(stats)
    parts.append(f"running {snapshot['running']} (prefill {snapshot['prefilling']}, decode {snapshot['decode_ready']})")
    if snapshot["waiting"]:
        parts.append(f"waiting {snapshot['waiting']}")
    if host_work is not None:
        active = host_active_seconds(host_work)
        parts.append(f"host active {active:.2f} s ({100.0 * active / interval_seconds:.1f}%)")
    return f"throughput {interval_seconds:.1f} s: " + ", ".join(parts)


class ThroughputReporter:
    """A daemon thread reporting every ``interval_ms`` until :meth:`stop`."""

    def __init__(self, engine: Any, counters: ThroughputCounters, interval_ms: int, request_log: Any | None) -> None:
        if interval_ms <= 0:
            raise ValueError("the throughput interval must be positive (0 disables the reporter: do not start it)")
        self.engine = engine
        self.counters = counters
        self.interval_s = interval_ms / 1000.0
        self.request_log = request_log
        self._stop = threading.Event()
        self._last = time.monotonic()
        self._last_rounds = RoundCounts()
        self._last_host = HostWorkTotals.zero()
        self._last_cache = HostTierCounters()
        self._last_selections = SelectionCounters()
        self._thread = threading.Thread(target=self._run, name="ninfer-throughput", daemon=True)

    def start(self) -> None:
        """Start reporting; work the engine did before now (startup) is not reported."""
        stats = self.engine.stats()
        self._last_cache = getattr(stats.memory, "host_tier", None) or HostTierCounters()
        self._last_selections = getattr(stats.memory, "selections", None) or SelectionCounters()
        host = stats.host_work
        if host is not None:
            self._last_host = host
            self._last_rounds = RoundCounts(host.decode_rounds, host.decode_row_rounds)
        self._last = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and report the final partial interval (unless it was idle)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._safe_report(time.monotonic() - self._last)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            self._safe_report(now - self._last)
            self._last = now

    def _safe_report(self, interval_seconds: float) -> None:
        try:
            self.report(max(interval_seconds, 1e-6))
        except Exception as exc:  # reporting must never take the server down
            oplog.get_logger().warning(f"throughput report failed: {type(exc).__name__}: {exc}")

    def report(self, interval_seconds: float) -> bool:
        """Emit one report unless the interval was fully idle; returns whether it reported."""
        counts = self.counters.take()
        stats = self.engine.stats()
        host = stats.host_work
        host_delta = None if host is None else host.minus(self._last_host)
        if host is not None:  # rounds at the instant the host work was published, so the two are consistent
            self._last_host = host
            total = RoundCounts(host.decode_rounds, host.decode_row_rounds)
        else:
            total = RoundCounts(stats.decode_rounds, stats.decode_row_rounds)
        rounds = RoundCounts(total.rounds - self._last_rounds.rounds, total.row_rounds - self._last_rounds.row_rounds)
        self._last_rounds = total
        cache_total: HostTierCounters | None = getattr(stats.memory, "host_tier", None)
        cache_delta = None if cache_total is None else cache_total.minus(self._last_cache)
        if cache_total is not None:
            self._last_cache = cache_total
        selections_total = getattr(stats.memory, "selections", None) or SelectionCounters()
        selections = selections_total.minus(self._last_selections)
        self._last_selections = selections_total
        cache_idle = (cache_delta is None or cache_delta == HostTierCounters()) and selections == SelectionCounters()
        if counts.idle() and stats.outstanding == 0 and rounds.rounds == 0 and cache_idle:
            return False
        oplog.get_logger().info(pretty_line(counts, interval_seconds, stats, rounds, host_delta))
        if self.request_log is not None:
            fields = throughput_fields(counts, interval_seconds, stats, rounds, host_delta, cache_delta, selections)
            self.request_log.write("throughput", fields)
        return True
