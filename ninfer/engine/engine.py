"""The resident Engine: submit requests from any thread; one executor thread runs them on the model."""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Mapping

import attrs

from ninfer.core.descriptors import SamplingPreset
from ninfer.core.drafting import Drafter
from ninfer.core.errors import CapacityError, InvalidRequestError
from ninfer.core.request import GenerationRequest, SamplingParams
from ninfer.core.runtime import ModelRuntime, WarmUpShapes
from ninfer.engine.admission import AdmissionController, AdmissionTicket
from ninfer.engine.config import EngineConfig
from ninfer.engine.executor import Executor
from ninfer.engine.handle import RequestHandle
from ninfer.engine.host_work import HostWorkTotals
from ninfer.engine.memory import EngineMemory, MemoryStats
from ninfer.engine.pages import pages_for
from ninfer.engine.sampler import RowSampler, fresh_seed
from ninfer.engine.sequence import Sequence
from ninfer.engine.speculative import drafter_memory
from ninfer.engine.stops import OutputText
from ninfer.engine.timings import SpeculativeCounters


@attrs.frozen
class EngineStats:
    """A point-in-time view of the engine: scheduler counts and pool occupancy."""

    healthy: bool
    outstanding: int
    waiting: int
    prefilling: int
    decoding: int
    memory: MemoryStats
    decode_rounds: int = 0  # cumulative since start: decode rounds and the rows they processed
    decode_row_rounds: int = 0
    host_work: HostWorkTotals | None = None  # the executor's worker totals as last published


class Engine:
    """Batches up to ``max_concurrency`` requests over one model runtime.

    ``tokenizer`` (a :class:`ninfer.core.tokenizer.Tokenizer`) enables text output and stop strings and
    bounds sampling to real token ids; ``eos_token_ids`` end every request that does not set ``ignore_eos``.
    """

    def __init__(
        self,
        runtime: ModelRuntime,
        config: EngineConfig | None = None,
        *,
        tokenizer: Any | None = None,
        eos_token_ids: Iterable[int] = (),
        drafter: Drafter | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.policy = self.config.request_policy
        self.runtime = runtime
        self.spec = runtime.spec
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(int(token) for token in eos_token_ids)
        self.vocab_limit = min(self.spec.vocab_size, tokenizer.vocab_size) if tokenizer is not None else None
        self._admission = AdmissionController(
            self.config.max_concurrency, self.config.max_pending_requests, self.config.pending_timeout_ms
        )
        self._memory = EngineMemory(
            self.spec, self.config, None if drafter is None else drafter_memory(drafter, self.spec, self.config)
        )
        self.drafter = drafter
        self._executor = Executor(
            runtime, self.config, self._memory, self.vocab_limit, self._admission.close, drafter
        )
        self._ids = itertools.count(1)
        self._executor.start()

    # -- state ---------------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False after an engine-wide failure or shutdown: the engine accepts no more work."""
        return self._executor.failure is None and self._executor.alive

    @property
    def failure(self) -> str | None:
        return self._executor.failure

    @property
    def kv_capacity_tokens(self) -> int:
        return self._memory.kv_capacity_tokens

    def stats(self) -> EngineStats:
        scheduler = self._executor.scheduler
        return EngineStats(
            healthy=self.healthy,
            outstanding=self._admission.outstanding,
            waiting=len(scheduler.waiting),
            prefilling=len(scheduler.prefilling),
            decoding=len(scheduler.decoding),
            memory=self._memory.stats(),
            decode_rounds=self._executor.decode_rounds,
            decode_row_rounds=self._executor.decode_row_rounds,
            host_work=self._executor.host_work,
        )

    def warm_up(self) -> None:
        """Run, before any request, everything the first requests would otherwise compile, autotune or capture,
        then forget it (no checkpoint, no counter survives).

        The runtime's own ``warm_up`` (if it has one) covers every shape the configuration allows; then, on CUDA,
        one request per lane runs through the whole engine (admission, prefill, decode at every batch size as they
        finish one after another, greedy and sampled rows) for the engine's own kernels. Elsewhere nothing compiles."""
        warm = getattr(self.runtime, "warm_up", None)
        if warm is not None:
            shapes = WarmUpShapes(
                max_rows=self.config.max_concurrency,
                max_pages=pages_for(self.config.max_context, self._memory.page_size),
                prefill_chunk=min(self.config.prefill_chunk, self.config.max_context),
            )
            self._executor.call(lambda: warm(self._memory.kv, self._memory.state, shapes))
        if self.spec.device.type != "cuda":
            return
        vocab = self.vocab_limit or self.spec.vocab_size
        handles = []
        for lane in range(self.config.max_concurrency):
            sampled = dict(temperature=1.0, top_p=0.9, top_k=20, seed=lane) if lane % 2 else dict(temperature=0.0)
            params = SamplingParams(max_tokens=2 + lane, ignore_eos=True, **sampled)
            prompt = [(lane * 31 + index) % vocab for index in range(8 + lane)]
            handles.append(self.submit(GenerationRequest(prompt, params)))
        for handle in handles:
            handle.result()
        self._executor.call(self._memory.forget)

    def clear_prefix_cache(self) -> None:
        """Drop every prefix checkpoint of the device and host tiers (runs on the executor between steps)."""
        self._executor.call(self._memory.clear_cache)

    # -- sampling ----------------------------------------------------------------------------------

    def resolve_sampling(self, preset: SamplingPreset | None, request_fields: Mapping[str, Any]) -> SamplingParams:
        """Family preset -> this engine's process overrides -> request fields -> ``greedy``."""
        return self.policy.sampling(preset, request_fields)

    # -- submission ----------------------------------------------------------------------------------

    def reserve_slot(self) -> AdmissionTicket:
        """Take lifetime capacity before preparing a prompt; raises ServerOverloadedError when full.

        The pending deadline starts now. Pass the ticket to :meth:`submit` (which then owns it) or
        release it if preparation fails.
        """
        return self._admission.reserve()

    def submit(self, request: GenerationRequest, ticket: AdmissionTicket | None = None) -> RequestHandle:
        """Queue ``request``; events and the outcome arrive through the returned handle.

        Errors decidable now (invalid request, a request that can never fit, a passed deadline, an
        unavailable engine) are raised here and release the ticket; later ones arrive through the handle.
        """
        ticket = ticket if ticket is not None else self._admission.reserve()
        try:
            if ticket.released:
                raise InvalidRequestError("this admission ticket has already been released")
            if ticket.expired():
                raise ticket.timeout_error()
            seq = self._sequence(request, ticket)
            self._executor.post(seq)
        except BaseException:
            ticket.release()
            raise
        return seq.handle

    def _sequence(self, request: GenerationRequest, ticket: AdmissionTicket) -> Sequence:
        prompt = request.prompt_token_ids
        self._check_prompt(prompt)
        params = self.policy.complete(request.sampling)
        if params.seed is None:
            params = attrs.evolve(params, seed=fresh_seed())
        max_output = self.policy.output_budget(params.max_tokens, len(prompt))
        self._check_fits(len(prompt), max_output)
        self._check_stops(params)
        self._check_budget_close(request, max_output)
        request_id = request.request_id or f"req-{next(self._ids)}"
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        assert params.seed is not None
        handle = RequestHandle(request_id, ticket, self._executor.wake)
        drafter = self.drafter
        return Sequence(
            request_id=request_id,
            request=request,
            handle=handle,
            ticket=ticket,
            sampler=RowSampler(params, params.seed, self.spec.vocab_size, self.spec.device),
            text=OutputText(self._detokenizer(), params.stop),
            stop_token_ids=frozenset(stop_ids),
            max_output=max_output,
            tokens=list(prompt),
            prompt_len=len(prompt),
            speculative=None if drafter is None else SpeculativeCounters(drafter.backend, drafter.draft_tokens),
        )

    def _detokenizer(self) -> Any | None:
        if self.tokenizer is None:
            return None
        from ninfer.core.tokenizer import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer)

    def _check_prompt(self, prompt: tuple[int, ...]) -> None:
        if not prompt:
            raise InvalidRequestError("the prompt must contain at least one token", code="invalid_prompt")
        vocab = self.spec.vocab_size
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"prompt token id {token!r} is outside the model vocabulary [0, {vocab})", code="invalid_prompt"
                )
        self.policy.check_prompt(len(prompt))

    def _check_fits(self, prompt_len: int, max_output: int) -> None:
        page_size = self._memory.page_size
        needed = pages_for(prompt_len + max_output, page_size)
        if needed > self._memory.num_pages:
            raise CapacityError(
                f"the prompt ({prompt_len} tokens) plus the output budget ({max_output} tokens) needs "
                f"{needed * page_size} KV tokens, more than the KV capacity of {self._memory.num_pages * page_size} "
                "tokens (--kv-capacity)",
                param="max_tokens",
            )

    def _check_stops(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this engine has none", param="stop")
        vocab = self.spec.vocab_size
        for token in params.stop_token_ids:
            if token >= vocab:
                raise InvalidRequestError(
                    f"stop token id {token} is outside the model vocabulary [0, {vocab})", param="stop_token_ids"
                )

    def _check_budget_close(self, request: GenerationRequest, max_output: int) -> None:
        policy = request.budget_close
        if policy is None:
            return
        vocab = self.vocab_limit or self.spec.vocab_size
        for token in (policy.close_token_id, *policy.insert_token_ids):
            if not 0 <= token < vocab:
                raise InvalidRequestError(
                    f"budget-close token id {token} is outside the vocabulary [0, {vocab})",
                    param="budget_close",
                )
        policy.check_capacity(max_output)

    # -- lifecycle -----------------------------------------------------------------------------------

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the executor: requests still in flight end as cancelled; later submits are refused."""
        self._admission.close("the engine has shut down and accepts no more work")
        self._executor.stop(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
