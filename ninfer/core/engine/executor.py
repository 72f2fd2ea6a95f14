"""The executor thread: the only thread that touches the runtime, the device and the pools.

Each loop iteration is a *boundary*: new submissions and cancellations are taken in, expired waiting
requests fail with a queue timeout, the FIFO head is admitted while a lane and its memory reservation
are free, and then one unit of work runs (one prefill chunk or one batched decode round). Results go to
the request handles, which never block this thread. An exception in a forward is an engine-wide failure:
every in-flight request fails with :class:`EngineUnavailableError` and the engine stops accepting work.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from ninfer.core.engine.batching import build_batch
from ninfer.core.engine.commit import Finish, commit_sampled
from ninfer.core.engine.config import EngineConfig
from ninfer.core.engine.memory import EngineMemory
from ninfer.core.engine.request import AdmittedEvent, ProgressEvent
from ninfer.core.engine.sampler import sample_tokens
from ninfer.core.engine.scheduler import DecodeStep, PrefillStep, Scheduler
from ninfer.core.engine.sequence import Sequence
from ninfer.core.engine.speculative import Drafter, SpeculativeRound, capture_layers, observed_features
from ninfer.core.errors import EngineUnavailableError, NinferError
from ninfer.core.runtime import ForwardBatch, ModelRuntime

log = logging.getLogger("ninfer.engine")

_IDLE_WAIT_S = 1.0


class _Stop:
    """Inbox marker: finish the loop."""


class _Call:
    """Inbox item: run ``fn`` on the executor thread and hand back its result."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class Executor:
    def __init__(
        self,
        runtime: ModelRuntime,
        config: EngineConfig,
        memory: EngineMemory,
        vocab_limit: int | None,
        on_failure: Callable[[str], None],
        drafter: Drafter | None = None,
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.memory = memory
        self.scheduler = Scheduler(config.max_concurrency)
        self._vocab_limit = vocab_limit
        self._on_failure = on_failure
        self._device = runtime.spec.device
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._accepting = True
        self._post_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="ninfer-engine-executor", daemon=True)
        self.failure: str | None = None
        self.decode_rounds = 0  # cumulative decode (or speculative) rounds, read by throughput reports
        self.decode_row_rounds = 0  # cumulative rows processed by those rounds
        self.drafter = drafter
        self._speculative: SpeculativeRound | None = None
        if drafter is not None:
            memory.companions.extend(drafter.bind(memory.num_pages, memory.page_size))
            self._speculative = SpeculativeRound(
                runtime, drafter, memory.kv, memory.state, memory.ensure_pages, vocab_limit
            )

    # -- other threads -----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def wake(self) -> None:
        self._wake.set()

    def post(self, item: Any) -> None:
        """Hand a new :class:`Sequence` (or a control item) to the executor."""
        with self._post_lock:
            if not self._accepting:
                raise EngineUnavailableError(self.failure or "the engine has shut down and accepts no more work")
            self._inbox.put(item)
        self._wake.set()

    def call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run ``fn`` on the executor thread between steps and return its result."""
        item = _Call(fn)
        self.post(item)
        if not item.done.wait(timeout):
            raise TimeoutError("the engine executor did not answer in time")
        if item.error is not None:
            raise item.error
        return item.result

    def stop(self, timeout: float | None = None) -> None:
        with self._post_lock:
            was_accepting, self._accepting = self._accepting, False
            if was_accepting:
                self._inbox.put(_Stop())
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the loop ----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                if self._drain_inbox():
                    break
                self._boundary()
                step = self.scheduler.next_step()
                if step is None:
                    self._wake.wait(self._idle_timeout())
                elif isinstance(step, PrefillStep):
                    self._prefill(step.seq)
                else:
                    self._decode(step)
        except BaseException as exc:  # an engine-wide failure: nothing in flight can continue
            self._fail_everything(exc)
            return
        self._shutdown_sequences()

    def _drain_inbox(self) -> bool:
        """Take in queued items; True when a stop was requested."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return False
            if isinstance(item, _Stop):
                return True
            if isinstance(item, _Call):
                try:
                    item.result = item.fn()
                except BaseException as exc:
                    item.error = exc
                item.done.set()
            else:
                self.scheduler.waiting.append(item)

    def _idle_timeout(self) -> float:
        deadlines = [seq.ticket.deadline for seq in self.scheduler.waiting if seq.ticket.deadline is not None]
        if not deadlines:
            return _IDLE_WAIT_S
        return max(min(deadlines) - time.monotonic(), 0.0)

    def _boundary(self) -> None:
        now = time.monotonic()
        for seq in list(self.scheduler.waiting):
            if seq.handle.cancel_requested:
                self._finish(seq, Finish("cancelled"), now)
            elif seq.ticket.expired(now):
                self.scheduler.remove(seq)
                seq.handle.fail(seq.ticket.timeout_error())
        for seq in [*self.scheduler.prefilling, *self.scheduler.decoding]:
            if seq.handle.cancel_requested:
                self._finish(seq, Finish("cancelled"), now)
        while (head := self.scheduler.head_admissible()) is not None:
            if not self.memory.try_admit(head, reuse=self.config.prefix_reuse):
                break
            self._admitted(head)

    def _admitted(self, seq: Sequence) -> None:
        now = time.monotonic()
        seq.admitted_at = now
        seq.budget_open = seq.request.budget_close is not None
        self.scheduler.admitted(seq)
        seq.handle.publish(AdmittedEvent(seq.prompt_len, seq.cache_n, now))
        self._progress(seq, now)
        if seq.fed == seq.prompt_len:  # an exact full-prompt checkpoint hit: nothing to prefill
            seq.prompt_done_at = now
            self._after_prompt(seq, now)

    # -- prefill -----------------------------------------------------------------------------------

    def _prefill(self, seq: Sequence) -> None:
        start = seq.fed
        end = min(start + self.config.prefill_chunk, seq.prompt_len)
        frontier = self._checkpoint_frontier(seq, start, end)
        if frontier is not None:
            end = frontier
        count = end - start
        last = end == seq.prompt_len
        seq.prefill_units += 1
        self.memory.ensure_pages(seq, end)
        drafter = self.drafter
        if drafter is None:
            wants_logits = last or frontier is not None
            batch = self._batch([seq], [seq.tokens[start:end]], logits="last" if wants_logits else "none")
        else:  # the drafter needs every prompt position's hidden state; logits come from the last one
            batch = self._batch(
                [seq], [seq.tokens[start : start + count]], logits="none", return_hidden=True,
                capture_layers=capture_layers(drafter),
            )
        output = self.runtime.forward(batch, self.memory.kv, self.memory.state)
        features = None if drafter is None else observed_features(drafter, output)
        if drafter is not None and features is not None:
            drafter.observe(seq, start, features)
        seq.fed = start + count
        now = time.monotonic()
        if frontier is not None:
            self.memory.capture_prefix(seq, self._chunk_logits(output))
        self._progress(seq, now)
        if not last:
            return
        seq.prompt_done_at = now
        seq.last_logits = self._chunk_logits(output)
        seq.last_logits_at = seq.fed
        if self.config.prefix_reuse:
            self.memory.capture_prompt(seq)
        self._after_prompt(seq, now)

    def _checkpoint_frontier(self, seq: Sequence, start: int, end: int) -> int | None:
        """The first requested checkpoint frontier inside this chunk (before the prompt's end), if reuse is on."""
        if not self.config.prefix_reuse:
            return None
        return next((offset for offset in seq.request.checkpoint_offsets if start < offset < end), None)

    def _chunk_logits(self, output: Any) -> Any:
        """The next-token logits after a prefill chunk's last token."""
        if self.drafter is None:
            return output.logits[0]
        assert output.hidden is not None, "the runtime returned no hidden states for a drafting prefill"
        return self.drafter.target_logits(output.hidden[-1:])[0]

    def _after_prompt(self, seq: Sequence, now: float) -> None:
        """The prompt is processed: sample the first token from its last logits (or finish at max_tokens 0)."""
        if seq.max_output == 0:
            self._finish(seq, Finish("length"), now)
            return
        self.scheduler.start_decoding(seq)
        assert seq.last_logits is not None
        token = sample_tokens(seq.last_logits[None, :], [seq.sampler], self._vocab_limit)[0]
        finish = commit_sampled(seq, token, time.monotonic())
        if finish is not None:
            self._finish(seq, finish, time.monotonic())

    # -- decode ------------------------------------------------------------------------------------

    def _decode(self, step: DecodeStep) -> None:
        rows = list(step.rows)
        self.decode_rounds += 1
        self.decode_row_rounds += len(rows)
        for seq in rows:
            seq.decode_rounds += 1
        if self._speculative is not None:
            for seq, finish in self._speculative.run(rows, time.monotonic):
                self._finish(seq, finish, time.monotonic())
            return
        feeds = [seq.tokens[seq.fed :] for seq in rows]
        for seq in rows:
            self.memory.ensure_pages(seq, len(seq.tokens))
        output = self.runtime.forward(self._batch(rows, feeds, logits="last"), self.memory.kv, self.memory.state)
        for index, seq in enumerate(rows):
            seq.fed = len(seq.tokens)
            seq.last_logits, seq.last_logits_at = output.logits[index], seq.fed
        tokens = sample_tokens(output.logits, [seq.sampler for seq in rows], self._vocab_limit)
        now = time.monotonic()
        for seq, token in zip(rows, tokens):
            finish = commit_sampled(seq, token, now)
            if finish is not None:
                self._finish(seq, finish, now)

    def _batch(self, rows: list[Sequence], feeds: list[list[int]], logits: str, **flags: Any) -> ForwardBatch:
        return build_batch(rows, feeds, self._device, logits, **flags)

    # -- endings -----------------------------------------------------------------------------------

    def _progress(self, seq: Sequence, now: float) -> None:
        if seq.request.report_progress:
            assert seq.admitted_at is not None
            seq.handle.publish(
                ProgressEvent(seq.prompt_len, seq.cache_n, seq.fed, (now - seq.admitted_at) * 1000.0)
            )

    def _finish(self, seq: Sequence, finish: Finish, now: float) -> None:
        """Leave the batch, free (or checkpoint) memory, then publish the outcome."""
        self.scheduler.remove(seq)
        if self.drafter is not None:
            self.drafter.forget(seq)
        self.memory.release(seq, checkpoint=self.config.prefix_reuse)
        seq.handle.finish(seq.outcome(finish.reason, finish.stop, now))

    def _fail_everything(self, exc: BaseException) -> None:
        reason = f"engine-wide failure: {type(exc).__name__}: {exc}"
        log.error("%s; failing every in-flight request", reason, exc_info=exc)
        self.failure = reason
        self._on_failure(reason)
        with self._post_lock:
            self._accepting = False
        self._drain_inbox_after_stop()
        error = EngineUnavailableError(reason)
        for seq in self.scheduler.sequences():
            self.scheduler.remove(seq)
            seq.handle.fail(error)

    def _drain_inbox_after_stop(self) -> None:
        error = EngineUnavailableError(self.failure or "the engine has shut down")
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Call):
                item.error = error
                item.done.set()
            elif isinstance(item, Sequence):
                self.scheduler.waiting.append(item)

    def _shutdown_sequences(self) -> None:
        """A clean stop: every request still in flight ends as cancelled."""
        self._drain_inbox_after_stop()
        now = time.monotonic()
        for seq in self.scheduler.sequences():
            try:
                self._finish(seq, Finish("cancelled"), now)
            except NinferError as exc:  # pragma: no cover - releasing memory cannot fail in a healthy engine
                seq.handle.fail(exc)
