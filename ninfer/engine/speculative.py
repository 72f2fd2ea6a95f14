"""The backend-neutral speculative round: draft, verify in one target forward, accept losslessly, roll back.

One round over the decode batch:

1. Each row that can speculate (its drafter state is ready, exactly one committed token is pending, and at least
   two more output tokens are allowed) gets ``k_row = min(k, allowance - 1)`` draft tokens from the drafter; the
   other rows take a plain decode step in the same traversal (a *fallback step*). A drafter that can resume
   (:class:`ResumableDrafter`) is ready right after a prefix-checkpoint hit too: its snapshot travels with the
   checkpoint.
2. ONE target forward verifies every row: the pending token plus its drafts, ``logits="all"``, with the
   recurrent state captured after every new token and the final hidden states returned for the drafter.
3. Per row, position by position, the target distribution the plain sampler would draw from (penalties with the
   tokens committed so far, temperature, top-k/p, min-p) decides each draft (``acceptance.decide``); each
   resulting token is committed through the normal commit path, so stop tokens, stop strings, output limits and
   budget-close inserts end or cut the run exactly where plain decoding would.
4. Rollback: the row is fed up to its last verified token that was committed (the longest prefix of drafts that
   equals the committed tokens). The recurrent state (SSM and conv window) is restored from the per-position
   capture of that token; target KV beyond it is simply overwritten later (the context length is ``fed``); the
   drafter is told which hidden states became committed and drops its own speculative state.

Rollback uses ``capture_states`` rather than replay: it costs one forward, no recompute, and transient memory of
``(k+1) x rows`` state copies per Gated-DeltaNet layer, freed after the round. Where Triton runs, restoring a row is
one kernel launch over every layer's conv window and SSM state (``RowCopy``); elsewhere one copy per layer and kind.

The round reads the verify results back once: the argmax of every position (greedy rows) and, in one more pass,
the candidate distributions of every position of the sampled rows without penalties; only rows with penalties
(which change with each committed token) compute a distribution per position.

Host-work phases (decode class): batch building is ``engine_boundary``; drafting, the verify forward and the
drafter's observation of committed hidden states are ``program_submit`` (the drafter's own result reads are inside
it); the explicit wait for the verify results is device wait; acceptance and rollback are ``program_post``; each
committed token is ``engine_commit_output``.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable
from typing import Sequence as Seq

import attrs
import torch

from ninfer.core.drafting import Draft, Drafter
from ninfer.core.runtime import CapturedStates, ForwardOutput, KVCache, ModelRuntime, RuntimeSpec, StateCache
from ninfer.engine.acceptance import TargetDistribution, decide, sample_target
from ninfer.engine.batching import build_batch
from ninfer.engine.commit import Finish, commit_timed
from ninfer.engine.config import EngineConfig
from ninfer.engine.host_work import HostPhase, HostWorkClock, WorkClass
from ninfer.engine.memory import DrafterMemory, DrafterResume
from ninfer.engine.sampler import RowSampler, candidate_distribution, penalized_logits
from ninfer.engine.sequence import Sequence
from ninfer.kernels.triton import triton_available


def drafter_resume(drafter: Drafter) -> DrafterResume | None:
    """``drafter``'s checkpoint hooks, or None when it cannot resume (it then restarts cold after a hit)."""
    snapshot, restore = getattr(drafter, "snapshot", None), getattr(drafter, "restore", None)
    if snapshot is None or restore is None:
        return None
    return DrafterResume(snapshot, restore, int(getattr(drafter, "resume_rewrites", 0)))


def capture_layers(drafter: Drafter) -> tuple[int, ...]:
    """The target layers ``drafter`` conditions on (none: it observes final-normed hidden states)."""
    return tuple(getattr(drafter, "capture_layers", ()))


def observed_features(drafter: Drafter, output: ForwardOutput) -> torch.Tensor | None:
    """What ``drafter.observe`` receives from a target forward: captured layer outputs or final hidden states."""
    return output.layer_hidden if capture_layers(drafter) else output.hidden


def drafter_memory(drafter: Drafter, spec: RuntimeSpec, config: EngineConfig) -> DrafterMemory:
    """The drafter's KV per token, one full verify round's transient bytes (the per-token state captures, the
    all-position fp32 logits and the hidden states of ``(k + 1) x max_concurrency`` tokens) and its checkpoint
    hooks."""
    tokens = (drafter.draft_tokens + 1) * config.max_concurrency
    per_token = spec.state_image_bytes() + spec.vocab_size * 4 + spec.hidden_size * spec.dtype.itemsize
    return DrafterMemory(float(drafter.kv_bytes_per_token), tokens * per_token, drafter_resume(drafter))


def target_distribution(logits: torch.Tensor, sampler: RowSampler, vocab_limit: int | None) -> TargetDistribution:
    """The distribution the plain sampler would draw from after ``logits`` (``[V]``), with current penalties."""
    if vocab_limit is not None and vocab_limit < logits.shape[0]:
        logits = logits[:vocab_limit]
    penalized = penalized_logits(logits[None, :], [sampler])
    if sampler.greedy:
        return TargetDistribution(argmax=int(penalized[0].argmax()))
    probs, ids = candidate_distribution(penalized, [sampler])
    return TargetDistribution(probs=probs[0].to("cpu", torch.float64), ids=ids[0].to("cpu"))


def sampled_distributions(
    logits: torch.Tensor, rows: Seq[int], samplers: Seq[RowSampler], vocab_limit: int | None
) -> list[TargetDistribution]:
    """:func:`target_distribution` of ``logits[rows[i]]`` for samplers without penalties, in one pass and one
    transfer."""
    selected = logits[torch.tensor(rows, device=logits.device), :vocab_limit]
    probs, ids = candidate_distribution(selected, samplers)
    probs, ids = probs.to("cpu", torch.float64), ids.to("cpu")
    return [TargetDistribution(probs=probs[i], ids=ids[i]) for i in range(len(rows))]


class StateRollback:
    """Puts a row's recurrent state back to the one a verify forward captured after one of its tokens.

    Where Triton runs: one launch per row over every layer's conv window and SSM state (``RowCopy``), built once per
    set of captured buffers (a verify runner hands over the same buffers every round; another forward's fresh
    tensors get a new one). Elsewhere: one copy per layer and kind.
    """

    def __init__(self, state: StateCache) -> None:
        self._state = state
        self.destinations = [*state.conv, *state.ssm]
        device = self.destinations[0].device if self.destinations else torch.device("cpu")
        self._kernel = bool(self.destinations) and triton_available(device)
        self._copy: Any = None
        self._identity: tuple = ()

    def restore(self, states: CapturedStates, index: int, slot: int) -> None:
        """``state[slot] = states[index]`` for every recurrent layer."""
        self._state.settle()  # a pending update of the slot must not land on the state put back
        sources = [*states.conv, *states.ssm]
        if not self._kernel:
            for destination, source in zip(self.destinations, sources):
                destination[slot].copy_(source[index])
            return
        self._row_copy(sources)(index, slot)

    def _row_copy(self, sources: list[torch.Tensor]) -> Any:
        """The cached ``RowCopy`` when ``sources`` are the buffers it was built for, else a new one.

        Identity: the first and last tensor of each kind, by the live object they view (held weakly, so a freed
        buffer never matches) and by address; buffers are allocated together, so their ends identify them.
        """
        half = len(sources) // 2
        ends = (sources[0], sources[half - 1], sources[half], sources[-1])
        identity = tuple((end.data_ptr(), end.stride(0)) for end in ends) + (len(sources),)
        roots = [end if end._base is None else end._base for end in ends]
        if self._copy is not None and identity == self._identity[0] and all(
            ref() is root for ref, root in zip(self._identity[1], roots)
        ):
            return self._copy
        from ninfer.kernels.triton.row_copy import RowCopy  # here: CPU-only installs lack triton

        self._copy = RowCopy(sources, self.destinations)
        self._identity = (identity, [weakref.ref(root) for root in roots])
        return self._copy


@attrs.frozen
class _RowPlan:
    seq: Sequence
    offset: int  # flat index of the row's first new token in the verify batch
    pending: int  # committed tokens not yet fed (fed first)
    draft: Draft


class SpeculativeRound:
    """Runs decode rounds with a drafter over the engine's pools (the executor thread only)."""

    def __init__(
        self,
        runtime: ModelRuntime,
        drafter: Drafter,
        kv: KVCache,
        state: StateCache,
        ensure_pages: Callable[[Sequence, int], None],
        vocab_limit: int | None,
        host_work: HostWorkClock,
    ) -> None:
        self.runtime = runtime
        self.drafter = drafter
        self.kv = kv
        self.state = state
        self.ensure_pages = ensure_pages
        self.vocab_limit = vocab_limit
        self.device = runtime.spec.device
        self.host_work = host_work
        self.rollback = StateRollback(state)

    def draft_count(self, seq: Sequence) -> int:
        """How many tokens ``seq`` drafts this round (0: a fallback step)."""
        allowance = seq.max_output - seq.output_count
        if len(seq.tokens) - seq.fed != 1 or allowance < 2 or not self.drafter.ready(seq):
            return 0
        return min(self.drafter.draft_tokens, allowance - 1)

    def run(self, rows: Seq[Sequence], clock: Callable[[], float]) -> list[tuple[Sequence, Finish]]:
        """One round over the decode batch; returns the rows that finished, with how (the caller releases them)."""
        work = self.host_work
        work.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.DECODE)
        counts = [self.draft_count(seq) for seq in rows]
        for seq, count in zip(rows, counts):
            self.ensure_pages(seq, len(seq.tokens) + count)
        drafting = [index for index, count in enumerate(counts) if count > 0]
        drafts = [Draft(())] * len(rows)
        if drafting:
            work.switch(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)
            made = self.drafter.draft([rows[i] for i in drafting], [counts[i] for i in drafting])
            for index, draft in zip(drafting, made):
                drafts[index] = draft
            work.switch(HostPhase.ENGINE_BOUNDARY, WorkClass.DECODE)
        plans, feeds, offset = [], [], 0
        for seq, draft in zip(rows, drafts):
            feed = [*seq.tokens[seq.fed :], *draft.tokens]
            plans.append(_RowPlan(seq, offset, len(seq.tokens) - seq.fed, draft))
            feeds.append(feed)
            offset += len(feed)
        batch = build_batch(
            rows, feeds, "all", capture_states=True, return_hidden=True, capture_layers=capture_layers(self.drafter)
        )
        work.switch(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)
        output = self.runtime.forward(batch, self.kv, self.state)
        assert output.logits is not None and output.states is not None
        work.await_device(self.device, WorkClass.DECODE)
        work.switch(HostPhase.PROGRAM_POST, WorkClass.DECODE)
        finished = []
        now = clock()
        limited = output.logits[:, : self.vocab_limit] if self.vocab_limit is not None else output.logits
        argmax = limited.argmax(dim=-1).tolist()  # one device sync for every unpenalized greedy position
        targets = self._sampled_targets(plans, output.logits)
        features = observed_features(self.drafter, output)
        for plan in plans:
            finish = self._settle(plan, output.logits, argmax, targets, features, output.states, now)
            if finish is not None:
                finished.append((plan.seq, finish))
        return finished

    def _sampled_targets(self, plans: Seq[_RowPlan], logits: torch.Tensor) -> dict[int, TargetDistribution]:
        """The target distribution at every verified position (flat index) of the sampled rows without penalties."""
        positions: list[int] = []
        samplers: list[RowSampler] = []
        for plan in plans:
            sampler = plan.seq.sampler
            if not sampler.greedy and sampler.penalty is None:
                base = plan.offset + plan.pending - 1
                positions.extend(range(base, base + len(plan.draft.tokens) + 1))
                samplers.extend([sampler] * (len(plan.draft.tokens) + 1))
        if not positions:
            return {}
        return dict(zip(positions, sampled_distributions(logits, positions, samplers, self.vocab_limit)))

    def _settle(
        self,
        plan: _RowPlan,
        logits: torch.Tensor,
        argmax: list[int],
        targets: dict[int, TargetDistribution],
        hidden: torch.Tensor | None,
        states: CapturedStates,
        now: float,
    ) -> Finish | None:
        """Accept, commit and roll back one row; returns how it finishes (None: it continues)."""
        work = self.host_work
        seq, drafted = plan.seq, plan.draft.tokens
        base = plan.offset + plan.pending - 1  # flat index of the logits after the last pending token
        old_fed = seq.fed
        accepted = 0
        finish: Finish | None = None
        for position in range(len(drafted) + 1):
            work.switch(HostPhase.PROGRAM_POST, WorkClass.DECODE)
            index = base + position
            target = targets.get(index)
            if target is None and seq.sampler.penalty is None:
                target = TargetDistribution(argmax=argmax[index])  # a greedy row
            elif target is None:  # penalties follow the tokens committed so far
                target = target_distribution(logits[index], seq.sampler, self.vocab_limit)
            if position < len(drafted):
                proposal = plan.draft.proposals[position] if plan.draft.proposals is not None else None
                verdict = decide(target, drafted[position], seq.sampler.generator, proposal)
                token, ok = verdict.token, verdict.accepted
            else:
                token, ok = sample_target(target, seq.sampler.generator), False
            length = len(seq.tokens)
            finish = commit_timed(work, seq, token, now, WorkClass.DECODE)
            if ok:
                accepted += 1
                self._count_accept(seq, position)
            if finish is not None or not ok or len(seq.tokens) != length + 1:
                break
        work.switch(HostPhase.PROGRAM_POST, WorkClass.DECODE)
        verified = self._verified_prefix(seq, old_fed + plan.pending, drafted)
        last = base + verified  # flat index of the last committed token that was fed
        seq.fed = old_fed + plan.pending + verified
        seq.last_logits, seq.last_logits_at = logits[last], seq.fed
        if last != plan.offset + plan.pending + len(drafted) - 1:
            assert seq.slot is not None
            self.rollback.restore(states, last, seq.slot)
        if hidden is not None:
            work.switch(HostPhase.PROGRAM_SUBMIT, WorkClass.DECODE)
            self.drafter.observe(seq, old_fed, hidden[plan.offset : last + 1])
            work.switch(HostPhase.PROGRAM_POST, WorkClass.DECODE)
        self._count_round(seq, len(drafted), accepted)
        return finish

    @staticmethod
    def _verified_prefix(seq: Sequence, start: int, drafted: tuple[int, ...]) -> int:
        """How many drafts (fed in the verify pass) equal the tokens now committed after ``start``."""
        count = 0
        while count < len(drafted) and start + count < len(seq.tokens) and seq.tokens[start + count] == drafted[count]:
            count += 1
        return count

    @staticmethod
    def _count_accept(seq: Sequence, position: int) -> None:
        if seq.speculative is not None:
            seq.speculative.accepted_per_position[position] += 1

    @staticmethod
    def _count_round(seq: Sequence, drafted: int, accepted: int) -> None:
        counters = seq.speculative
        if counters is None:
            return
        if drafted == 0:
            counters.fallback_steps += 1
            return
        counters.rounds += 1
        counters.drafted_tokens += drafted
        counters.accepted_tokens += accepted
