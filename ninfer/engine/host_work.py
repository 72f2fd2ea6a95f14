"""The executor's phase clock: every wall-time segment of the worker loop in exactly one phase and work class.

The executor thread owns one :class:`HostWorkClock`. :meth:`HostWorkClock.switch` closes the open segment and opens
the next, so segments never overlap and nothing between two switches is lost; :meth:`HostWorkClock.idle` closes the
open segment without opening another (waiting for work is not host work). A segment is one of the five host phases
or the blocking device wait (:class:`HostPhase`), and one work class (:class:`WorkClass`); both are plain ints, so
a switch stays a handful of integer operations.

Two views are kept from the same segments:

- the worker totals (:class:`HostWorkTotals`): each segment counted once, whatever the batch size;
- the per-request exposure (:class:`RequestHostWork`): each segment charged in full to every request the current
  work is for (the *members*: a decode round's rows, a prefilling request, the lanes of a boundary pass). Segments
  accumulate in one group buffer that is added to the members when they change (:meth:`HostWorkClock.charge`) or
  when a member needs its totals now (:meth:`HostWorkClock.settle`), so a switch costs O(1), not O(rows).

Detail subsets (:class:`Detail`) time slow paths that lie inside a phase; they are never part of a phase's total.
Times are ``time.perf_counter_ns`` integers; seconds are derived only when reported.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Final, Iterable

import attrs
import torch

from ninfer.engine.timings import HostExposure


class HostPhase:
    """The five mutually exclusive host phases, then the (non-host) blocking device wait (plain ints: cheap)."""

    ENGINE_BOUNDARY: Final = 0  # inbox drain, cancellation/expiry scan, admission, scheduling, batch building
    PROGRAM_SUBMIT: Final = 1  # the model forward (and drafting) up to the point its outputs are needed
    PROGRAM_POST: Final = 2  # sampling, acceptance, rollback: host work on results that are available
    ENGINE_COMMIT_OUTPUT: Final = 3  # committing tokens, stops, events to request handles
    ENGINE_MAINTENANCE: Final = 4  # checkpoint capture/eviction, freeing, control calls, stats publication
    DEVICE_WAIT: Final = 5  # blocking until the device results are ready (not host work)


class WorkClass:
    """What a segment's work is for."""

    DECODE: Final = 0  # decode and speculative rounds
    PREFILL: Final = 1  # prefill chunks and the first token sampled from the prompt
    CONTROL: Final = 2  # everything else: boundary passes, admission, control inserts, maintenance


class Detail:
    """Slow paths timed inside a phase (subsets, never added to the phase totals)."""

    ADMISSION: Final = 0  # a successful admission: reservation, checkpoint lookup/restore, lane move, admitted event
    CONTEXT_TRANSACTION: Final = 1  # checkpoint captures: chunk frontiers, prompt ends, finished requests
    REPLICA: Final = 2  # host replicas of checkpoints: none exist, always zero
    STATS_PUBLICATION: Final = 3  # publishing the worker's totals to other threads


PHASE_NAMES = (
    "engine_boundary", "program_submit", "program_post", "engine_commit_output", "engine_maintenance", "device_wait"
)
HOST_PHASES = tuple(range(5))  # every phase but the device wait
CLASS_NAMES = ("decode", "prefill", "control")
DETAIL_NAMES = ("admission", "context_transaction", "replica", "stats_publication")
_PHASES, _CLASSES, _DETAILS = len(PHASE_NAMES), len(CLASS_NAMES), len(DETAIL_NAMES)
# slots of a per-request (and group) buffer: the six phases, then the decode-class host and device-wait subsets
_DECODE_HOST = _PHASES
_DECODE_DEVICE_WAIT = _PHASES + 1
_REQUEST_SLOTS = _PHASES + 2
# per phase * classes + work class: the request-buffer slot of its decode subset, or -1
_DECODE_SLOT = tuple(
    (_DECODE_DEVICE_WAIT if phase == HostPhase.DEVICE_WAIT else _DECODE_HOST) if work_class == WorkClass.DECODE else -1
    for phase in range(_PHASES)
    for work_class in range(_CLASSES)
)


def _seconds(ns: int) -> float:
    return ns / 1e9


class RequestHostWork:
    """One request's exposure so far, in nanoseconds (mutated by the executor thread only)."""

    __slots__ = ("ns",)

    def __init__(self) -> None:
        self.ns = [0] * _REQUEST_SLOTS

    def exposure(self) -> HostExposure:
        """The frozen seconds view reported on the request's terminal timings."""
        ns = self.ns
        return HostExposure(
            phases=tuple(_seconds(ns[phase]) for phase in HOST_PHASES),
            device_wait=_seconds(ns[HostPhase.DEVICE_WAIT]),
            decode_host=_seconds(ns[_DECODE_HOST]),
            decode_device_wait=_seconds(ns[_DECODE_DEVICE_WAIT]),
        )


@attrs.frozen
class HostWorkTotals:
    """Cumulative worker totals at one publication: each segment counted once.

    ``elapsed_ns[phase * 3 + work_class]``; ``detail_ns`` / ``detail_invocations`` indexed by :class:`Detail`;
    the decode rounds and row-rounds counted up to the same instant (the normalization denominators).
    """

    elapsed_ns: tuple[int, ...]
    detail_ns: tuple[int, ...]
    detail_invocations: tuple[int, ...]
    decode_rounds: int = 0
    decode_row_rounds: int = 0

    @classmethod
    def zero(cls) -> "HostWorkTotals":
        return cls((0,) * (_PHASES * _CLASSES), (0,) * _DETAILS, (0,) * _DETAILS)

    def minus(self, earlier: "HostWorkTotals") -> "HostWorkTotals":
        """The deltas since ``earlier`` (an interval's worth of work)."""
        return HostWorkTotals(
            tuple(a - b for a, b in zip(self.elapsed_ns, earlier.elapsed_ns)),
            tuple(a - b for a, b in zip(self.detail_ns, earlier.detail_ns)),
            tuple(a - b for a, b in zip(self.detail_invocations, earlier.detail_invocations)),
            self.decode_rounds - earlier.decode_rounds,
            self.decode_row_rounds - earlier.decode_row_rounds,
        )

    def phase_seconds(self, phase: int) -> float:
        start = phase * _CLASSES
        return _seconds(sum(self.elapsed_ns[start : start + _CLASSES]))

    def class_host_seconds(self, work_class: int) -> float:
        return _seconds(sum(self.elapsed_ns[phase * _CLASSES + work_class] for phase in HOST_PHASES))

    def class_device_wait_seconds(self, work_class: int) -> float:
        return _seconds(self.elapsed_ns[HostPhase.DEVICE_WAIT * _CLASSES + work_class])

    def detail_seconds(self, detail: int) -> float:
        return _seconds(self.detail_ns[detail])


class _DetailTimer:
    """A reusable ``with`` block adding its duration and one invocation to a detail subset."""

    __slots__ = ("_clock", "_detail", "_start")

    def __init__(self, clock: "HostWorkClock", detail: int) -> None:
        self._clock, self._detail, self._start = clock, detail, 0

    def __enter__(self) -> None:
        self._start = self._clock.now()

    def __exit__(self, *exc: object) -> None:
        self._clock.add_detail(self._detail, self._clock.now() - self._start)


_NO_TIMER = contextlib.nullcontext()


class HostWorkClock:
    """Attributes the executor thread's wall time to phases, work classes and participating requests."""

    def __init__(self, now: Callable[[], int] = time.perf_counter_ns) -> None:
        self.now = now
        self._elapsed = [0] * (_PHASES * _CLASSES)
        self._detail_ns = [0] * _DETAILS
        self._detail_calls = [0] * _DETAILS
        self._timers = tuple(_DetailTimer(self, detail) for detail in range(_DETAILS))
        self._slot = -1  # phase * classes + work class of the open segment; -1 while idle
        self._start = 0
        self._group = [0] * _REQUEST_SLOTS
        self._members: list[RequestHostWork] = []

    @property
    def phase(self) -> int | None:
        """The open segment's phase (None while idle)."""
        return None if self._slot < 0 else self._slot // _CLASSES

    @property
    def work_class(self) -> int | None:
        return None if self._slot < 0 else self._slot % _CLASSES

    def switch(self, phase: int, work_class: int) -> None:
        """Close the open segment and open one of ``phase`` and ``work_class``."""
        now = self.now()
        if self._slot >= 0:
            self._close(now)
        self._slot, self._start = phase * _CLASSES + work_class, now

    def reclassify(self, work_class: int) -> None:
        """Count the open segment (from its start) in ``work_class`` instead."""
        assert self._slot >= 0, "no open segment to reclassify"
        self._slot = self._slot - self._slot % _CLASSES + work_class

    def idle(self) -> None:
        """Close the open segment and open none; the members are released."""
        self.settle()
        self._slot = -1
        self._members = []

    def charge(self, members: Iterable[RequestHostWork]) -> None:
        """From now on charge segments to ``members`` (time so far goes to the previous members)."""
        self.settle()
        self._members = list(members)

    def join(self, member: RequestHostWork) -> None:
        """Add ``member`` to the participants from now on."""
        self.settle()
        self._members.append(member)

    def settle(self) -> None:
        """Bring every member's totals up to now; the open segment continues."""
        if self._slot >= 0:
            now = self.now()
            self._close(now)
            self._start = now
        added = [(index, value) for index, value in enumerate(self._group) if value]
        if added:
            for member in self._members:
                ns = member.ns
                for index, value in added:
                    ns[index] += value
            self._group = [0] * _REQUEST_SLOTS

    def _close(self, now: int) -> None:
        elapsed = now - self._start
        slot = self._slot
        self._elapsed[slot] += elapsed
        if self._members:
            group = self._group
            group[slot // _CLASSES] += elapsed
            decode_slot = _DECODE_SLOT[slot]
            if decode_slot >= 0:
                group[decode_slot] += elapsed

    def await_device(self, device: torch.device, work_class: int) -> None:
        """A device-wait segment that blocks until the device's queued work is done (CPU work already is)."""
        self.switch(HostPhase.DEVICE_WAIT, work_class)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def detail(self, detail: int, enabled: bool = True) -> contextlib.AbstractContextManager[None]:
        """A ``with`` block timing one invocation of ``detail`` (not reentrant per detail)."""
        return self._timers[detail] if enabled else _NO_TIMER

    def add_detail(self, detail: int, elapsed_ns: int) -> None:
        self._detail_ns[detail] += elapsed_ns
        self._detail_calls[detail] += 1

    def totals(self, decode_rounds: int = 0, decode_row_rounds: int = 0) -> HostWorkTotals:
        """The closed segments so far (the open one is not included), with the round counters of this instant."""
        return HostWorkTotals(
            tuple(self._elapsed), tuple(self._detail_ns), tuple(self._detail_calls), decode_rounds, decode_row_rounds
        )
