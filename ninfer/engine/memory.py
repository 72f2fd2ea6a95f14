"""The engine's device memory: the paged KV pool, the StateImage slots, the prefix checkpoints, reservations.

Admission reserves a request's full prompt + effective-output page entitlement up front: the pages it
will allocate are *promised*, and a new request is admitted only when ``free - promised`` covers its own
fresh pages (after evicting prefix checkpoints: anonymous ones least recently used first, then session
endpoints). An admitted request therefore never waits for memory.

A speculative drafter that can resume (:class:`DrafterResume`) has its snapshot kept with every checkpoint and
restored with it, so a request whose prompt ends exactly at a checkpoint drafts from its first decode round. The
pages holding the checkpoint's last ``rewritten_positions`` positions are copied, not shared, for such a request:
the drafter rewrites its own paged state there (MTP's entry for the last position depends on the next token).

Checkpoints the device cache evicts move to the host tier (:class:`HostCache`) when it is enabled and they fit. A
host checkpoint longer than the best device hit is restored at admission into a request reserved like a cold one
(same reservation, same pressure evictions); if that reservation does not fit now, admission falls back to the
device hit or a cold prefill.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Any, Callable

import attrs
import torch

from ninfer.core.errors import ConfigError
from ninfer.core.request import ReusePath
from ninfer.core.runtime import KVCache, RuntimeSpec, StateCache
from ninfer.engine.config import AUTO, AUTO_HEADROOM_BYTES, EngineConfig
from ninfer.engine.events import DegradationUnit, Materialization, ReuseLimit
from ninfer.engine.host_cache import (
    MIB,
    HostCache,
    HostCheckpoint,
    HostTierCounters,
    SelectionCounters,
    page_extent_bytes,
    state_bytes,
)
from ninfer.engine.pages import PagePool, SlotPool, copy_kv_page, pages_for
from ninfer.engine.prefix_cache import Checkpoint, PrefixCache, common_prefix, longest_prefix
from ninfer.engine.sequence import Sequence
from ninfer.quant.kv_codecs import pool_codec

SHARED: ReusePath = "shared_stable_prefix"
ANCHOR: ReusePath = "private_long_anchor"


def _endpoint_reusable(seq: Sequence) -> bool:
    """Whether ``seq``'s endpoint is likely a prefix of the conversation's next prompt (its request's hint)."""
    markers = seq.request.endpoint_reuse_tokens
    if markers is None:
        return True
    return not set(markers).isdisjoint(seq.tokens[seq.prompt_len :])


def resolve_kv_capacity(config: EngineConfig, spec: RuntimeSpec, drafter: DrafterMemory | None = None) -> int:
    """The KV pool size in tokens: explicit, or ``auto`` (CUDA: free memory less 1 GiB; CPU: C * max_context).

    With a drafter, ``auto`` also leaves its transient bytes free and counts its KV bytes per pool token.
    """
    if config.kv_capacity != AUTO:
        return int(config.kv_capacity)
    if spec.device.type != "cuda":
        return config.max_context * config.max_concurrency
    free_bytes, _total = torch.cuda.mem_get_info(spec.device)
    per_token = spec.kv_bytes_per_token(pool_codec(config.kv_dtype))
    headroom = AUTO_HEADROOM_BYTES
    if drafter is not None:
        per_token += drafter.kv_bytes_per_token
        headroom += drafter.transient_bytes
    tokens = int((free_bytes - headroom) // per_token) if per_token > 0 else config.max_context
    if tokens < config.max_context:
        raise ConfigError(
            f"--kv-capacity auto: only {max(tokens, 0)} KV tokens fit in the free device memory "
            f"({free_bytes / 2**30:.1f} GiB free, {headroom / 2**30:.1f} GiB headroom, "
            f"{per_token:.0f} bytes per token), fewer than --max-context {config.max_context}",
            param="kv_capacity",
        )
    return tokens


@attrs.frozen
class DrafterResume:
    """How a drafter's state travels with prefix checkpoints: ``snapshot(seq)`` (None: not resumable now) at
    capture, ``restore(seq, snapshot)`` at a hit; a resumer rewrites the drafter's paged state of the
    checkpoint's last ``rewritten_positions`` positions."""

    snapshot: Callable[[Sequence], Any]
    restore: Callable[[Sequence, Any], None]
    rewritten_positions: int = 0


@attrs.frozen
class DrafterMemory:
    """What a speculative drafter adds: KV bytes per pool token, transient bytes of one verify round, and its
    checkpoint hooks (None: the drafter restarts cold after every checkpoint hit)."""

    kv_bytes_per_token: float
    transient_bytes: int
    resume: DrafterResume | None = None


@attrs.frozen
class MemoryStats:
    """Pool occupancy: pages and slots free/total, what checkpoints hold, what admission promised."""

    total_pages: int
    free_pages: int
    promised_pages: int
    checkpoint_pages: int
    total_slots: int
    free_slots: int
    checkpoints: int
    page_size: int
    kv_capacity_tokens: int
    host_checkpoints: int = 0
    host_kv_bytes: int = 0
    host_tier: HostTierCounters = HostTierCounters()  # cumulative since start
    selections: SelectionCounters = SelectionCounters()  # cumulative since start
    last_frontier: int | None = None  # prompt tokens the latest admission reused (None before the first)


class EngineMemory:
    """Owns the KV and state tensors and decides which page/slot belongs to whom."""

    def __init__(self, spec: RuntimeSpec, config: EngineConfig, drafter: DrafterMemory | None = None) -> None:
        self.page_size = config.page_size
        num_slots = config.max_concurrency + config.checkpoint_slots
        self.state = StateCache.allocate(spec, num_slots)
        self.kv_capacity_tokens = resolve_kv_capacity(config, spec, drafter)
        num_pages = pages_for(self.kv_capacity_tokens, self.page_size)
        self.kv = KVCache.allocate(spec, num_pages, self.page_size, codec=pool_codec(config.kv_dtype))
        self.pages = PagePool(num_pages)
        self.slots = SlotPool(num_slots)
        self._resume = None if drafter is None else drafter.resume
        self.host = HostCache(
            config.host_state_slots if config.checkpoint_slots else 0, config.host_kv_mib * MIB, self.state,
            self.page_size, 0 if self._resume is None else self._resume.rewritten_positions,
        )
        self.cache = PrefixCache(
            config.checkpoint_slots, self.page_size, self.pages, self.slots, self.state,
            spill=self._spill if self.host.enabled else None,
            replicated=lambda entry: self.host.holds(entry.tokens),
        )
        self.cost = config.context_cost
        self._state_bytes = state_bytes(self.state)
        self._degradation: list[tuple[DegradationUnit, float]] = []  # what the admission being planned evicted
        self.promised = 0
        self.companions: list[KVCache] = []  # drafter caches indexed by the same page ids (copied alongside)
        self.private_continuations = config.private_continuations
        self.shared_prefixes = config.shared_prefixes
        self.long_anchors = config.max_long_anchors_per_continuation
        self._continuation_ids = itertools.count(1)
        self._recency = itertools.count()
        self._continuation_used: dict[int, int] = {}  # continuation -> when a request last joined it
        self._continuation_active: Counter[int] = Counter()  # continuation -> admitted requests in it
        self.selections = SelectionCounters()
        self.last_frontier: int | None = None

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    def stats(self) -> MemoryStats:
        return MemoryStats(
            total_pages=self.pages.num_pages,
            free_pages=self.pages.free_count,
            promised_pages=self.promised,
            checkpoint_pages=self.cache.held_pages,
            total_slots=self.slots.num_slots,
            free_slots=self.slots.free_count,
            checkpoints=len(self.cache),
            page_size=self.page_size,
            kv_capacity_tokens=self.kv_capacity_tokens,
            host_checkpoints=len(self.host),
            host_kv_bytes=self.host.used_kv_bytes,
            host_tier=self.host.counters,
            selections=self.selections,
            last_frontier=self.last_frontier,
        )

    def clear_cache(self) -> None:
        """Drop every prefix checkpoint of both tiers."""
        self.cache.clear()
        self.host.clear()

    def forget(self) -> None:
        """Drop every checkpoint and zero every counter: as after startup (the engine's warm-up is not history)."""
        self.clear_cache()
        self.host.counters = HostTierCounters()
        self.selections = SelectionCounters()
        self.last_frontier = None
        self._continuation_used.clear()

    def reusable_tokens(self, prompt: list[int]) -> int:
        """How many leading tokens of ``prompt`` a retained checkpoint of either tier covers (recency untouched)."""
        device = longest_prefix(self.cache.entries, prompt)
        host = self.host.matches(prompt, len(device.tokens) if device is not None else 0)
        return max([len(device.tokens) if device is not None else 0, *(len(entry.tokens) for entry in host)])

    @property
    def _page_extent(self) -> int:
        return page_extent_bytes((self.kv, *self.companions))

    @property
    def _restore_ops(self) -> int:
        """Tensors one host restore copies: every StateImage tensor and each cache's keys and values per layer."""
        caches = (self.kv, *self.companions)
        return len(self.state.conv) + len(self.state.ssm) + sum(len(c.key) + len(c.value) for c in caches)

    def _spill(self, entry: Checkpoint) -> DegradationUnit:
        """Move an evicted device checkpoint's state and KV (all caches) to the host tier, if it fits there."""
        replica = self.host.holds(entry.tokens)
        if self.host.store(entry, self.state, (self.kv, *self.companions)):
            return "drop_replica" if replica else "demote_to_host"
        return "drop_checkpoint"

    # -- admission ---------------------------------------------------------------------------------

    def try_admit(self, seq: Sequence, reuse: bool) -> bool:
        """Reserve ``seq``'s pages and a slot, resuming from the candidate that leaves the least work; False if it
        must wait.

        The candidates are root, the longest matching device checkpoint and every longer matching host checkpoint
        (all verified by exact token comparison), ranked by restore plus suffix prefill cost
        (:class:`ContextCost`); admission takes the first that fits now. A device hit is normally shared (full pages
        referenced, the partial last page copied). When sharing would leave the reservation short — e.g. a request
        entitled to the whole pool — a checkpoint whose partial page no one else references is consumed instead:
        the request takes over its pages and the checkpoint is dropped. Failing both, the request starts at root
        (the maximal root fallback). The committed decision is ``seq.materialization``.
        """
        started = time.perf_counter_ns()
        self._degradation = []
        seq.reuse_limit = None
        candidates, compared = self._ranked_candidates(seq, reuse)
        fallback = False
        for cost_ns, source in candidates:
            if isinstance(source, HostCheckpoint):
                if not self._admit_from_host(seq, source):
                    continue
            elif isinstance(source, Checkpoint):
                admitted = self._admit_from_device(seq, source)
                if admitted is None:
                    return False
                if not admitted:
                    fallback = True
                    seq.reuse_limit = ReuseLimit("capacity")
                    continue
            elif not self._admit_at_root(seq):
                return False
            else:
                self._selected("root", 0)
                if seq.reuse_limit is None:
                    seq.reuse_limit = self._diagnose(seq.prompt, 0) if reuse else ReuseLimit("disabled")
            if source is not None:
                seq.reuse_limit = self._diagnose(seq.prompt, len(source.tokens))
            units = tuple(unit for unit, _loss in self._degradation)
            seq.materialization = Materialization(
                predicted_immediate_ns=round(cost_ns),
                predicted_future_loss_ns=round(sum(loss for _unit, loss in self._degradation)),
                evaluated_targets=len(candidates),
                projection_work=compared,
                planning_ns=time.perf_counter_ns() - started,
                stop_reason="queue_exhausted" if units else "no_pressure",
                degradation_units=units,
                maximal_root_fallback=fallback and source is None,
            )
            return True
        return False

    def _ranked_candidates(self, seq: Sequence, reuse: bool) -> tuple[list[tuple[float, Any]], int]:
        """``(cost ns, source)`` of root (None) and each matching checkpoint, cheapest first (ties: more reused),
        and how many retained checkpoints were compared with the prompt."""
        prompt = seq.prompt
        cost = self.cost
        ranked: list[tuple[float, Any]] = [(cost.prefill.ns(0, len(prompt)), None)]
        if not reuse:
            return ranked, 0
        hit = self.cache.lookup(prompt)
        if hit is not None:
            ranked.append((cost.prefill.ns(len(hit.tokens), len(prompt) - len(hit.tokens)), hit))
        held = self.host.matches(prompt, longer_than=0 if hit is None else len(hit.tokens))
        for entry in held:
            restore = cost.transfer.ns(entry.kv_bytes + self._state_bytes, self._restore_ops)
            ranked.append((restore + cost.prefill.ns(len(entry.tokens), len(prompt) - len(entry.tokens)), entry))
        ranked.sort(key=lambda item: (item[0], -(0 if item[1] is None else len(item[1].tokens))))
        return ranked, len(self.cache) + len(self.host)

    def _admit_at_root(self, seq: Sequence) -> bool:
        """Reserve ``seq`` with a fresh state and no reused pages; False if it does not fit now."""
        if not self._fits(seq, None, 0):
            return False
        self._reserve_room(seq, pages_for(seq.reserved_tokens, self.page_size), keep=None)
        self.state.reset(seq.slot)
        self._join(seq, None)
        return True

    def _admit_from_device(self, seq: Sequence, hit: Checkpoint) -> bool | None:
        """Resume ``seq`` from device checkpoint ``hit``: True; False if it cannot within the reservation (try
        root); None if even that is short now (wait)."""
        consume = False
        if not self._fits(seq, hit, self._shareable_pages(hit)):
            consume = self._consumable(hit) and self._fits(seq, hit, len(hit.pages))
            if not consume:
                return False
        reused = len(hit.pages) if consume else self._shareable_pages(hit)
        self._reserve_room(seq, pages_for(seq.reserved_tokens, self.page_size) - reused, keep=hit)
        size = len(hit.tokens)
        if consume:
            self.cache.take(hit)  # its page references move to the request
            seq.pages.extend(hit.pages)
        else:
            for page in hit.pages[:reused]:
                self.pages.ref(page)
                seq.pages.append(page)
            for index in range(reused, len(hit.pages)):  # the partial last page, or any page the drafter rewrites
                source, target = hit.pages[index], self._allocate(seq)
                for kv in (self.kv, *self.companions):
                    copy_kv_page(kv, source, target, min(self.page_size, size - index * self.page_size))
        self.state.copy(hit.slot, seq.slot)
        if consume:
            self.slots.release(hit.slot)
        self._resume_at(seq, size, hit.logits, hit.drafter)
        self._resumed(seq, hit)
        return True

    def _reserve_room(self, seq: Sequence, fresh: int, keep: Checkpoint | None) -> None:
        """Evict device checkpoints other than ``keep`` until ``fresh`` pages are free beyond the promised ones,
        then promise them and give ``seq`` a slot (the caller checked that they fit)."""
        while self.pages.free_count - self.promised < fresh:
            if not self._evict(keep):
                raise RuntimeError("admission found reclaimable checkpoint pages that eviction did not free")
        self._reserve(seq, fresh)

    def _evict(self, keep: Checkpoint | None) -> bool:
        """Evict one device checkpoint (other than ``keep``) and note the degradation unit it cost."""
        evicted = self.cache.evict(keep=keep)
        if evicted is None:
            return False
        entry, unit = evicted
        if unit == "drop_checkpoint":
            loss = self.cost.prefill.ns(0, len(entry.tokens))
        else:
            loss = self.cost.transfer.ns(len(entry.pages) * self._page_extent + self._state_bytes, self._restore_ops)
        self._degradation.append((unit, loss))
        return True

    def _admit_from_host(self, seq: Sequence, entry: HostCheckpoint) -> bool:
        """Reserve ``seq`` like a cold request and copy the host checkpoint into it; False if it does not fit now."""
        if not self._fits(seq, None, 0):
            return False
        self.host.protected = entry  # device evictions below spill to the host tier: keep this entry there
        try:
            self._reserve_room(seq, pages_for(seq.reserved_tokens, self.page_size), keep=None)
        finally:
            self.host.protected = None
        self.host.touch(entry)
        assert seq.slot is not None
        pages = [self._allocate(seq) for _ in range(entry.num_pages)]
        self.host.restore(entry, self.state, seq.slot, (self.kv, *self.companions), pages)
        self._resume_at(seq, len(entry.tokens), entry.logits, entry.drafter)
        self._resumed(seq, entry)
        return True

    def _reserve(self, seq: Sequence, fresh: int) -> None:
        """Give ``seq`` a state slot and promise it ``fresh`` pages."""
        seq.slot = self.slots.acquire()
        self.promised += fresh
        seq.promised_pages = fresh

    def _resume_at(self, seq: Sequence, size: int, logits: torch.Tensor, drafter_snapshot: Any) -> None:
        """``seq`` continues after a restored checkpoint of ``size`` tokens (and its drafter snapshot, if any)."""
        seq.fed = seq.cache_n = size
        seq.last_logits, seq.last_logits_at = logits, size
        if drafter_snapshot is not None and self._resume is not None:
            self._resume.restore(seq, drafter_snapshot)

    def _resumed(self, seq: Sequence, source: Checkpoint | HostCheckpoint) -> None:
        """``seq`` resumed from ``source``: count the hit; the first longer checkpoint ``seq`` keeps supersedes it."""
        source.hits += 1
        seq.reuse_path = source.path
        seq.resumed_from = source
        self._join(seq, source.continuation)
        self._selected(source.path, len(source.tokens))

    def _diagnose(self, prompt: list[int], reused: int) -> ReuseLimit:
        """Why ``reused`` tokens is all the retained checkpoints (both tiers) could give ``prompt``."""
        shared = max((common_prefix(entry.tokens, prompt) for entry in (*self.cache.entries, *self.host.entries)),
                     default=0)
        if shared > reused:
            return ReuseLimit("diverged", shared)
        return ReuseLimit("longest_available" if shared else "no_checkpoint")

    def _selected(self, path: str, reused: int) -> None:
        self.selections = self.selections.add(**{path: 1}, reused_prompt_tokens=reused)
        self.last_frontier = reused

    def _join(self, seq: Sequence, continuation: int | None) -> None:
        """``seq`` continues the private continuation it resumed from, or starts one (from root or a shared
        prefix); either way that continuation is now the most recently used."""
        seq.continuation = continuation if continuation is not None else next(self._continuation_ids)
        self._continuation_used[seq.continuation] = next(self._recency)
        self._continuation_active[seq.continuation] += 1

    def _bound(self, seq: Sequence) -> None:
        """Keep at most ``private_continuations`` conversation histories (the least recently joined one loses every
        checkpoint it has, in both tiers; never ``seq``'s own, and one holding a session endpoint only when every
        other holds one too), ``long_anchors`` anchors per history (host copies first, least recently used first)
        and ``shared_prefixes`` shared-prefix checkpoints
        (host copies first, each tier least recently used first)."""
        entries = [*self.cache.entries, *self.host.entries]
        live = {entry.continuation for entry in entries if entry.continuation is not None}
        sessions = {entry.continuation for entry in entries if entry.session is not None}
        while len(live) > self.private_continuations:
            others = [continuation for continuation in live if continuation != seq.continuation]
            if not others:
                break
            victim = min(others, key=lambda continuation: (continuation in sessions,
                                                           self._continuation_used.get(continuation, -1)))
            self._forget(lambda entry: entry.continuation == victim)
            self.selections = self.selections.add(continuations_evicted=1)
            live.discard(victim)
        anchors = sorted((e for e in (*self.host.entries, *self.cache.entries) if e.path == ANCHOR),
                         key=lambda entry: (isinstance(entry, Checkpoint), entry.last_used))
        for continuation in live:
            own = [entry for entry in anchors if entry.continuation == continuation]
            for entry in own[: max(len(own) - self.long_anchors, 0)]:
                self._forget(lambda candidate: candidate is entry)
                self.selections = self.selections.add(long_anchors_dropped=1)
        for continuation in list(self._continuation_used):  # histories with no checkpoint and no request left
            if continuation not in live and not self._continuation_active[continuation]:
                del self._continuation_used[continuation]
        shared = [
            *sorted((e for e in self.host.entries if e.path == SHARED), key=lambda entry: entry.last_used),
            *sorted((e for e in self.cache.entries if e.path == SHARED), key=lambda entry: entry.last_used),
        ]
        for entry in shared[: max(len(shared) - self.shared_prefixes, 0)]:
            self._forget(lambda candidate: candidate is entry)
            self.selections = self.selections.add(shared_prefixes_dropped=1)

    def _forget(self, matches: Callable[[Any], bool]) -> None:
        for entry in self.cache.entries:
            if matches(entry):
                self.cache.drop(entry)
        for held in self.host.entries:
            if matches(held):
                self.host.remove(held)

    def _supersede(self, seq: Sequence) -> None:
        if seq.resumed_from is not None and seq.fed > len(seq.resumed_from.tokens):
            seq.resumed_from.superseded = True
            seq.resumed_from = None

    def _shareable_pages(self, hit: Any) -> int:
        """The checkpoint's pages a request may reference: its full pages, less those holding positions the
        drafter rewrites when it resumes from the checkpoint's snapshot."""
        kept = len(hit.tokens)
        if hit.drafter is not None and self._resume is not None:
            kept -= self._resume.rewritten_positions
        return max(kept, 0) // self.page_size

    def _consumable(self, hit: Any) -> bool:
        """A checkpoint can be taken over when the pages a request could not share are referenced by it alone."""
        return all(self.pages.ref_count(page) == 1 for page in hit.pages[self._shareable_pages(hit) :])

    def _fits(self, seq: Sequence, hit: Any, reused_pages: int) -> bool:
        """Whether ``seq``'s reservation, less ``reused_pages``, fits free pages plus checkpoints other than ``hit``."""
        fresh = pages_for(seq.reserved_tokens, self.page_size) - reused_pages
        available = self.pages.free_count - self.promised
        return available >= fresh or available + self.cache.reclaimable_pages(keep=hit) >= fresh

    def ensure_pages(self, seq: Sequence, tokens: int) -> None:
        """Allocate pages (from the reservation) until ``seq`` can hold ``tokens`` tokens."""
        while len(seq.pages) * self.page_size < tokens:
            self._allocate(seq)

    def _allocate(self, seq: Sequence) -> int:
        if seq.promised_pages <= 0:
            raise RuntimeError(f"request {seq.request_id} outgrew its admission reservation")
        page = self.pages.allocate()
        seq.promised_pages -= 1
        self.promised -= 1
        seq.pages.append(page)
        return page

    # -- checkpoints and release -------------------------------------------------------------------

    def capture_prompt(self, seq: Sequence) -> None:
        """Checkpoint the end of ``seq``'s prompt (its state is copied into a spare slot). With continuation
        frontiers it serves only an exact repeat (the response-prologue frontier serves the rest), so it is kept
        as the first to evict."""
        assert seq.last_logits is not None
        self.capture_prefix(seq, seq.last_logits, redundant=bool(seq.request.continuation_offsets))

    def capture_prefix(
        self, seq: Sequence, logits: torch.Tensor, path: ReusePath = "private_endpoint", *, redundant: bool = False
    ) -> None:
        """Checkpoint ``seq``'s fed tokens for reuse ``path``; ``logits`` are the next-token logits after the last
        of them. A shared prefix belongs to no continuation; a ``redundant`` checkpoint is evicted first."""
        assert seq.slot is not None
        if self.cache.capture(
            seq.tokens[: seq.fed], seq.pages, seq.slot, logits, take_slot=False,
            drafter_snapshot=self._drafter_snapshot(seq), path=path,
            continuation=None if path == SHARED else seq.continuation, superseded=redundant,
        ):
            self.selections = self.selections.add(captures=1)
            self._supersede(seq)
            self._bound(seq)

    def _drafter_snapshot(self, seq: Sequence) -> Callable[[], Any] | None:
        """Takes the drafter's snapshot of ``seq`` at ``seq.fed`` when called (None without a resumable drafter)."""
        resume = self._resume
        if resume is None:
            return None
        return lambda: resume.snapshot(seq)

    def release(self, seq: Sequence, *, checkpoint: bool) -> None:
        """Free ``seq``'s pages and slot; with ``checkpoint`` first keep its fed prefix as a checkpoint.

        The checkpoint becomes the endpoint of the request's session when that session may replace it. A drafter
        must still hold ``seq``'s state here (it forgets ``seq`` afterwards) for the checkpoint to keep a snapshot.
        """
        if seq.slot is None:
            return
        if seq.continuation is not None:
            self._continuation_active[seq.continuation] -= 1
            if not self._continuation_active[seq.continuation]:
                del self._continuation_active[seq.continuation]
        kept = False
        if checkpoint and seq.fed > 0 and seq.last_logits is not None and seq.last_logits_at == seq.fed:
            session = seq.request.session
            endpoint_of = session.key if session is not None and session.may_replace_endpoint else None
            if endpoint_of is not None:
                self.host.demote(endpoint_of)
            kept = self.cache.capture(
                seq.tokens[: seq.fed], seq.pages, seq.slot, seq.last_logits, take_slot=True, session=endpoint_of,
                drafter_snapshot=self._drafter_snapshot(seq), continuation=seq.continuation,
                superseded=endpoint_of is None and not _endpoint_reusable(seq),
            )
            if kept:
                self.selections = self.selections.add(captures=1)
                self._supersede(seq)
                self._bound(seq)
        for page in seq.pages:
            self.pages.release(page)
        seq.pages = []
        self.promised -= seq.promised_pages
        seq.promised_pages = 0
        if not kept:
            self.slots.release(seq.slot)
        seq.slot = None
