"""Which requests wait, prefill or decode, and what the executor runs next.

Admission is strictly FIFO: the head of the waiting queue is never overtaken, so a large request is not
starved by smaller ones behind it. One request prefills at a time (alone, in chunks); every decode-ready
request joins one batched decode round. When both kinds of work exist, prefill chunks and decode rounds
alternate so a long prefill does not stall decoding.
"""

from __future__ import annotations

from collections import deque

import attrs

from ninfer.engine.sequence import Sequence


@attrs.frozen
class PrefillStep:
    seq: Sequence


@attrs.frozen
class DecodeStep:
    rows: tuple[Sequence, ...]


class Scheduler:
    def __init__(self, max_concurrency: int) -> None:
        self.max_concurrency = max_concurrency
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.decoding: list[Sequence] = []
        self._last_was_prefill = False

    @property
    def active_count(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    def sequences(self) -> list[Sequence]:
        return [*self.waiting, *self.prefilling, *self.decoding]

    def head_admissible(self) -> Sequence | None:
        """The waiting head, if a lane is free for it."""
        if self.waiting and self.active_count < self.max_concurrency:
            return self.waiting[0]
        return None

    def admitted(self, seq: Sequence) -> None:
        """Move the waiting head into a lane; it prefills until :meth:`start_decoding`."""
        assert self.waiting and self.waiting[0] is seq
        self.waiting.popleft()
        seq.phase = "prefilling"
        self.prefilling.append(seq)

    def start_decoding(self, seq: Sequence) -> None:
        """The prompt is processed: the request joins the decode batch."""
        self.prefilling.remove(seq)
        seq.phase = "decoding"
        self.decoding.append(seq)

    def remove(self, seq: Sequence) -> None:
        for queue in (self.prefilling, self.decoding):
            if seq in queue:
                queue.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.phase = "finished"

    def next_step(self) -> PrefillStep | DecodeStep | None:
        if self.prefilling and (not self.decoding or not self._last_was_prefill):
            self._last_was_prefill = True
            return PrefillStep(self.prefilling[0])
        if self.decoding:
            self._last_was_prefill = False
            return DecodeStep(tuple(self.decoding))
        return None
