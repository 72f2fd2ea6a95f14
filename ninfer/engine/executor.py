"""The executor thread: the only thread that touches the runtime, the device and the pools.

Each loop iteration is a *boundary*: new submissions and cancellations are taken in, expired waiting
requests fail with a queue timeout, the FIFO head is admitted while a lane and its memory reservation
are free, and then one unit of work runs (one prefill chunk or one batched decode round). Results go to
the request handles, which never block this thread. An exception in a forward is an engine-wide failure:
every in-flight request fails with :class:`EngineUnavailableError` and the engine stops accepting work.

Every segment of the loop is timed by the :class:`HostWorkClock` in one host phase (or the device wait) and one
work class, charged to the requests the work is for; each iteration ends by publishing the worker totals
(:attr:`Executor.host_work`) for the throughput reporter.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

import attrs
import torch

from ninfer.core.drafting import Drafter
from ninfer.core.errors import EngineUnavailableError, NinferError
from ninfer.core.runtime import ModelRuntime
from ninfer.engine.batching import build_ahead_batch, build_batch
from ninfer.engine.commit import Finish, commit_timed
from ninfer.engine.config import EngineConfig
from ninfer.engine.events import AdmittedEvent, ProgressEvent
from ninfer.engine.host_work import Detail, HostPhase, HostWorkClock, HostWorkTotals, RequestHostWork, WorkClass
from ninfer.engine.memory import EngineMemory
from ninfer.engine.prefix_cache import common_prefix
from ninfer.engine.sampler import plain_greedy, sample_token_ids, sample_tokens
from ninfer.engine.scheduler import DecodeStep, PrefillStep, Scheduler
from ninfer.engine.sequence import Sequence
from ninfer.engine.speculative import SpeculativeRound, capture_layers, observed_features
from ninfer.kernels.transfer import HostCopy, to_device

log = logging.getLogger("ninfer.engine")

_IDLE_WAIT_S = 1.0


class _Stop:
    """Inbox marker: finish the loop."""


@attrs.frozen
class AheadRound:
    """A decode forward launched before the previous round's tokens reached the host: row ``i`` of ``logits``
    follows ``rows[i]``'s tokens as long as the row has fed every token it holds."""

    rows: tuple[Sequence, ...]
    logits: torch.Tensor
    greedy_ids: torch.Tensor | None  # the forward's argmax of ``logits`` (``ForwardBatch.greedy_below``)

    def logits_of(self, rows: list[Sequence]) -> dict[Sequence, torch.Tensor]:
        """The rows of ``rows`` whose logits here still hold."""
        index = {seq: i for i, seq in enumerate(self.rows)}
        return {
            seq: self.logits[index[seq]]
            for seq in rows
            if seq in index and seq.fed == len(seq.tokens) and seq.last_logits_at == seq.fed
        }


def _ends_at_limit(seq: Sequence) -> bool:
    """Whether committing the next token ends ``seq`` at its output limit, whatever the token is."""
    return seq.output_count + 1 >= seq.max_output


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
        self.clock = HostWorkClock()  # the executor thread's phase clock
        self.host_work = HostWorkTotals.zero()  # the worker totals, published at the end of every iteration
        self.drafter = drafter
        self._speculative: SpeculativeRound | None = None
        self._ahead: AheadRound | None = None  # the decode forward launched before the last round's commits
        if drafter is not None:
            memory.companions.extend(drafter.bind(memory.num_pages, memory.page_size))
            self._speculative = SpeculativeRound(
                runtime, drafter, memory.kv, memory.state, memory.ensure_pages, vocab_limit, self.clock
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
        clock = self.clock
        try:
            while True:
                self._wake.clear()
                clock.charge(self._lanes())
                clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.CONTROL)
                if self._drain_inbox():
                    break
                self._boundary()
                step = self.scheduler.next_step()
                if step is None:
                    self._ahead = None  # every row it ran has finished
                    timeout = self._idle_timeout()
                    self._publish()
                    clock.idle()
                    self._wake.wait(timeout)
                    continue
                if isinstance(step, PrefillStep):
                    self._prefill(step.seq)
                else:
                    self._decode(step)
                self._publish()
        except BaseException as exc:  # an engine-wide failure: nothing in flight can continue
            self._fail_everything(exc)
            return
        self._shutdown_sequences()
        self._publish()
        clock.idle()

    def _publish(self) -> None:
        """Hand the worker totals (closed segments so far) to other threads: one reference assignment."""
        clock = self.clock
        clock.charge(())
        clock.switch(HostPhase.ENGINE_MAINTENANCE, WorkClass.CONTROL)
        with clock.detail(Detail.STATS_PUBLICATION):
            self.host_work = clock.totals(self.decode_rounds, self.decode_row_rounds)

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
                self.clock.switch(HostPhase.ENGINE_MAINTENANCE, WorkClass.CONTROL)
                try:
                    item.result = item.fn()
                except BaseException as exc:
                    item.error = exc
                item.done.set()
                self.clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.CONTROL)
            else:
                self.scheduler.waiting.append(item)

    def _idle_timeout(self) -> float:
        deadlines = [seq.ticket.deadline for seq in self.scheduler.waiting if seq.ticket.deadline is not None]
        if not deadlines:
            return _IDLE_WAIT_S
        return max(min(deadlines) - time.monotonic(), 0.0)

    def _boundary(self) -> None:
        """Cancellations, queue timeouts and admissions (the clock is in ``engine_boundary``, control class)."""
        clock = self.clock
        now = time.monotonic()
        for seq in list(self.scheduler.waiting):
            if seq.handle.cancel_requested:
                self._finish(seq, Finish("cancelled"))
                clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.CONTROL)
            elif seq.ticket.expired(now):
                self.scheduler.remove(seq)
                clock.switch(HostPhase.ENGINE_COMMIT_OUTPUT, WorkClass.CONTROL)
                seq.handle.fail(seq.ticket.timeout_error())
                clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.CONTROL)
        for seq in [*self.scheduler.prefilling, *self.scheduler.decoding]:
            if seq.handle.cancel_requested:
                self._finish(seq, Finish("cancelled"))
                clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.CONTROL)
        while (head := self.scheduler.head_admissible()) is not None:
            if self._awaits_capture(head, now):
                break
            with clock.detail(Detail.ADMISSION):
                admitted = self.memory.try_admit(head, reuse=self.config.prefix_reuse)
                if admitted:
                    self._admitted(head)
            if not admitted:
                break
            if head.prompt_done_at is not None:  # an exact full-prompt checkpoint hit: nothing to prefill
                clock.charge((head.host_work,))
                self._after_prompt(head)
                clock.charge(self._lanes())
                clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.CONTROL)

    def _awaits_capture(self, head: Sequence, now: float) -> bool:
        """Whether the waiting head stays queued until the request now prefilling captures a checkpoint of a prefix
        they share, beyond what the head could reuse today (many conversations sending one system prompt at once).

        Prefill runs one request at a time, so the head could not start before that capture anyway; admitted after
        it, the head resumes from it instead of prefilling the same prefix again. It does not wait when the
        capture is predicted (by the prefill cost) to come after its pending deadline."""
        if not self.config.prefix_reuse:
            return False
        prompt = head.prompt
        for seq in self.scheduler.prefilling:
            shared = min(common_prefix(seq.prompt, prompt), seq.prompt_len - 1, len(prompt) - 1)
            frontier = max((offset for offset in seq.request.frontiers if seq.fed < offset <= shared), default=None)
            if frontier is None or frontier <= self.memory.reusable_tokens(prompt):
                continue
            wait_s = self.memory.cost.prefill.ns(seq.fed, frontier - seq.fed) / 1e9
            if head.ticket.deadline is None or now + wait_s < head.ticket.deadline:
                return True
        return False

    def _lanes(self) -> list[RequestHostWork]:
        """The exposure records of the requests holding a lane (the members of a boundary pass)."""
        return [seq.host_work for seq in (*self.scheduler.prefilling, *self.scheduler.decoding)]

    def _admitted(self, seq: Sequence) -> None:
        """The admission commit: queue wait ends, the request takes a lane and joins the boundary's members."""
        clock = self.clock
        now = time.monotonic()
        seq.admitted_at = now
        clock.join(seq.host_work)
        seq.budget_open = seq.request.budget_close is not None
        self.scheduler.admitted(seq)
        clock.switch(HostPhase.ENGINE_COMMIT_OUTPUT, WorkClass.CONTROL)
        seq.handle.publish(AdmittedEvent(seq.prompt_len, seq.cache_n, now))
        self._progress(seq, now)
        clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.CONTROL)
        if seq.fed == seq.prompt_len:
            seq.prompt_done_at = now

    # -- prefill -----------------------------------------------------------------------------------

    def _prefill(self, seq: Sequence) -> None:
        """One prompt chunk of ``seq`` (every segment is charged to it, prefill class unless maintenance)."""
        clock = self.clock
        clock.charge((seq.host_work,))
        clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.PREFILL)
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
            batch = build_batch([seq], [seq.tokens[start:end]], logits="last" if wants_logits else "none")
        else:  # the drafter needs every prompt position's hidden state; logits come from the last one
            batch = build_batch(
                [seq], [seq.tokens[start : start + count]], logits="none", return_hidden=True,
                capture_layers=capture_layers(drafter),
            )
        clock.switch(HostPhase.PROGRAM_SUBMIT, WorkClass.PREFILL)  # the drafter's LM head and observation are programs too
        output = self.runtime.forward(batch, self.memory.kv, self.memory.state)
        logits = self._chunk_logits(output) if last or frontier is not None else None
        features = None if drafter is None else observed_features(drafter, output)
        if drafter is not None and features is not None:
            drafter.observe(seq, start, features)
        clock.switch(HostPhase.PROGRAM_POST, WorkClass.PREFILL)
        seq.fed = start + count
        now = time.monotonic()
        if frontier is not None:
            assert logits is not None
            clock.switch(HostPhase.ENGINE_MAINTENANCE, WorkClass.CONTROL)
            with clock.detail(Detail.CONTEXT_TRANSACTION):
                self.memory.capture_prefix(seq, logits, seq.request.frontier_path(frontier))
        clock.switch(HostPhase.ENGINE_COMMIT_OUTPUT, WorkClass.PREFILL)
        self._progress(seq, now)
        if not last:
            return
        seq.prompt_done_at = now
        seq.last_logits = logits
        seq.last_logits_at = seq.fed
        if self.config.prefix_reuse:
            clock.switch(HostPhase.ENGINE_MAINTENANCE, WorkClass.CONTROL)
            with clock.detail(Detail.CONTEXT_TRANSACTION):
                self.memory.capture_prompt(seq)
        self._after_prompt(seq)

    def _checkpoint_frontier(self, seq: Sequence, start: int, end: int) -> int | None:
        """The first requested checkpoint frontier this chunk reaches (before the prompt's end), if reuse is on."""
        if not self.config.prefix_reuse:
            return None
        limit = min(end, seq.prompt_len - 1)
        return next((offset for offset in seq.request.frontiers if start < offset <= limit), None)

    def _chunk_logits(self, output: Any) -> Any:
        """The next-token logits after a prefill chunk's last token."""
        if self.drafter is None:
            return output.logits[0]
        assert output.hidden is not None, "the runtime returned no hidden states for a drafting prefill"
        return self.drafter.target_logits(output.hidden[-1:])[0]

    def _after_prompt(self, seq: Sequence) -> None:
        """The prompt is processed: sample the first token from its last logits (or finish at max_tokens 0)."""
        clock = self.clock
        if seq.max_output == 0:
            self._finish(seq, Finish("length"))
            return
        clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.PREFILL)
        self.scheduler.start_decoding(seq)
        assert seq.last_logits is not None
        clock.await_device(self._device, WorkClass.PREFILL)
        clock.switch(HostPhase.PROGRAM_POST, WorkClass.PREFILL)
        token = sample_tokens(seq.last_logits[None, :], [seq.sampler], self._vocab_limit)[0]
        self._commit(seq, token, time.monotonic(), WorkClass.PREFILL)

    # -- decode ------------------------------------------------------------------------------------

    def _decode(self, step: DecodeStep) -> None:
        """One decode (or speculative) round; every segment is charged to all of its rows."""
        clock = self.clock
        rows = list(step.rows)
        clock.charge(seq.host_work for seq in rows)
        clock.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.DECODE)
        self.decode_rounds += 1
        self.decode_row_rounds += len(rows)
        for seq in rows:
            seq.decode_rounds += 1
        if self._speculative is not None:
            for seq, finish in self._speculative.run(rows, time.monotonic):
                self._finish(seq, finish)
            return
        overlap = self._may_overlap(rows)
        logits, greedy_ids = self._round_logits(rows, wait=not overlap)
        if not overlap:
            tokens = sample_tokens(logits, [seq.sampler for seq in rows], self._vocab_limit)
            now = time.monotonic()
            for seq, token in zip(rows, tokens):
                self._commit(seq, token, now, WorkClass.DECODE)
            return
        tokens, fed_ahead = self._sample_and_run_ahead(rows, logits, greedy_ids)
        now = time.monotonic()
        for index, (seq, token) in enumerate(zip(rows, tokens)):
            finish = commit_timed(self.clock, seq, token, now, WorkClass.DECODE)
            if finish is not None and fed_ahead[index] and token in seq.stop_token_ids:
                # the forward ahead did not update the row's state for its stop token (the device saw it)
                seq.fed = len(seq.tokens) - 1
                seq.last_logits, seq.last_logits_at = logits[index], seq.fed
            if finish is not None:
                self._finish(seq, finish)

    def _may_overlap(self, rows: list[Sequence]) -> bool:
        """Whether this round launches the next one before its tokens reach the host (``overlap_decode``): only
        while nothing but the decode batch waits for the device (no queued or prefilling request, nothing in the
        inbox) and no row has stop strings (found only on the host, after the forward ahead has fed the token)."""
        scheduler, overlap = self.scheduler, self.config.overlap_decode
        if overlap is None:
            overlap = self.runtime.spec.device.type == "cuda"
        return (
            overlap and self.runtime.spec.state_update_stops
            and not (scheduler.waiting or scheduler.prefilling or not self._inbox.empty())
            and not any(seq.request.sampling.stop for seq in rows)
        )

    def _round_logits(self, rows: list[Sequence], wait: bool) -> tuple[Any, torch.Tensor | None]:
        """The rows' next-token logits ``[R, V]``: the forward launched ahead last round where it still holds (the
        row has fed every token it holds), one forward over the tokens each other row has not fed yet; ``wait``:
        block on the device after that forward (else the caller waits only for what it needs). With them the
        argmax the forward ahead took, where its rows are these."""
        clock = self.clock
        ahead, self._ahead = self._ahead, None
        ready = {} if ahead is None else ahead.logits_of(rows)
        behind = [seq for seq in rows if seq not in ready]
        output = None
        if behind:
            for seq in behind:
                self.memory.ensure_pages(seq, len(seq.tokens))
            batch = build_batch(behind, [seq.tokens[seq.fed :] for seq in behind], logits="last")
            clock.switch(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)
            output = self.runtime.forward(batch, self.memory.kv, self.memory.state)
        if wait:
            clock.await_device(self._device, WorkClass.DECODE)
        clock.switch(HostPhase.PROGRAM_POST, WorkClass.DECODE)
        for index, seq in enumerate(behind):
            seq.fed = len(seq.tokens)
            seq.last_logits, seq.last_logits_at = output.logits[index], seq.fed
            ready[seq] = output.logits[index]
        if output is not None and len(behind) == len(rows):
            return output.logits, None
        if ahead is not None and not behind and ahead.rows == tuple(rows):
            return ahead.logits, ahead.greedy_ids
        return torch.stack([ready[seq] for seq in rows]), None

    def _sample_and_run_ahead(
        self, rows: list[Sequence], logits: Any, greedy_ids: torch.Tensor | None
    ) -> tuple[list[int], list[bool]]:
        """Sample on the device, launch the next round's forward on those ids (each row fed the token it is about
        to commit), then wait only for the ids' copy to the host: the device runs that forward meanwhile.

        The forward updates a row's state only if the row goes on after this token, so a finished row's endpoint
        checkpoint ends before its last token as without overlap: not where the host knows it ends (the output
        limit), not where the device sees one of the row's stop ids. Returns the tokens and, per row, whether the
        forward could feed its token (then ``seq.fed`` counts it and ``last_logits`` are the forward's; a row that
        takes engine-inserted tokens after it feeds those next round). Where every row samples a plain argmax, the
        forward takes the next round's with its logits (``ForwardBatch.greedy_below``)."""
        clock = self.clock
        samplers = [seq.sampler for seq in rows]
        ids = sample_token_ids(logits, samplers, self._vocab_limit, greedy_ids)
        host_ids = HostCopy(ids)  # queued before the forward below, so it does not wait for it
        feeds = [not _ends_at_limit(seq) for seq in rows]
        width = max(len(seq.stop_token_ids) for seq in rows) or 1
        # one host table, one copy (ForwardBatch.state_update_stops): column 0 whether the row feeds its token,
        # then its stop ids (padded with -1)
        stops = to_device(
            torch.tensor(
                [[int(feed), *sorted(seq.stop_token_ids), *[-1] * (width - len(seq.stop_token_ids))]
                 for feed, seq in zip(feeds, rows)],
                dtype=torch.int64,
            ),
            ids.device,
        )
        for seq in rows:
            self.memory.ensure_pages(seq, len(seq.tokens) + 1)
        vocab = self.runtime.spec.vocab_size
        greedy_below = min(self._vocab_limit or vocab, vocab) if plain_greedy(samplers) else None
        batch = build_ahead_batch(rows, ids, stops, greedy_below)
        clock.switch(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)
        output = self.runtime.forward(batch, self.memory.kv, self.memory.state)
        for index, seq in enumerate(rows):
            if feeds[index]:
                seq.fed = len(seq.tokens) + 1  # the token committed next
                seq.last_logits, seq.last_logits_at = output.logits[index], seq.fed
        self._ahead = AheadRound(tuple(rows), output.logits, output.greedy_ids)
        clock.switch(HostPhase.DEVICE_WAIT, WorkClass.DECODE)
        tokens = host_ids.wait().tolist()
        clock.switch(HostPhase.PROGRAM_POST, WorkClass.DECODE)
        return tokens, feeds

    def _commit(self, seq: Sequence, token: int, now: float, work_class: int) -> None:
        """Commit one sampled token (``engine_commit_output``; control class when it triggered a control insert)."""
        finish = commit_timed(self.clock, seq, token, now, work_class)
        if finish is not None:
            self._finish(seq, finish)

    # -- endings -----------------------------------------------------------------------------------

    def _progress(self, seq: Sequence, now: float) -> None:
        if seq.request.report_progress:
            assert seq.admitted_at is not None
            seq.handle.publish(
                ProgressEvent(seq.prompt_len, seq.cache_n, seq.fed, (now - seq.admitted_at) * 1000.0)
            )

    def _finish(self, seq: Sequence, finish: Finish) -> None:
        """Leave the batch, free (or checkpoint) memory, then publish the outcome with the request's exposure.

        The finish instant is taken after the request's last charged segment, so its exposure lies between its
        admission and its finish."""
        clock = self.clock
        clock.switch(HostPhase.ENGINE_MAINTENANCE, WorkClass.CONTROL)
        self.scheduler.remove(seq)
        with clock.detail(Detail.CONTEXT_TRANSACTION, enabled=self.config.prefix_reuse and seq.slot is not None):
            self.memory.release(seq, checkpoint=self.config.prefix_reuse)  # may keep the drafter's snapshot
        if self.drafter is not None:
            self.drafter.forget(seq)
        clock.switch(HostPhase.ENGINE_COMMIT_OUTPUT, WorkClass.CONTROL)
        clock.settle()
        seq.handle.finish(seq.outcome(finish.reason, finish.stop, time.monotonic()))

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
        for seq in self.scheduler.sequences():
            try:
                self._finish(seq, Finish("cancelled"))
            except NinferError as exc:  # pragma: no cover - releasing memory cannot fail in a healthy engine
                seq.handle.fail(exc)
