"""Prefix checkpoints: KV pages + a StateImage snapshot + the logits after the last fed token.

A hybrid model can only resume where a recurrent-state snapshot exists, so reuse is checkpoint-based:
a request whose prompt starts with (or equals) a checkpoint's exact tokens restores it and prefills only
the rest. Checkpoints live in the H spare StateImage slots; one is evicted when a slot is needed or when
KV pages are short.

A checkpoint may be a session *endpoint*: the latest finished turn of an engine-local reuse session (a
stored Responses chain). Each session has at most one endpoint; a new one demotes the previous endpoint to
an ordinary anonymous checkpoint. Eviction takes the least recently used anonymous checkpoint first and a
session endpoint (least recently used) only when no anonymous one is left, so the number of sessions kept
is bounded by the capacity itself. Sessions never change lookup: it is by exact token prefix only.

An evicted checkpoint is first handed to ``spill`` (the engine moves it to the host tier, see
:mod:`ninfer.engine.host_cache`); its device pages and slot are released either way. The mildest eviction comes
first: a checkpoint the host tier already holds (a redundant replica, ``replicated``) goes before any other.

With speculative decoding a checkpoint may also keep the drafter's *snapshot*: what the drafter needs (beyond the
pages, which carry its paged state) to draft right after the checkpoint's last token. The engine treats it as opaque.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence, TypeVar

import attrs
import torch

from ninfer.core.request import ReusePath
from ninfer.core.runtime import StateCache
from ninfer.engine.pages import PagePool, SlotPool, pages_for

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.engine.events import DegradationUnit

R = TypeVar("R", bound="Retained")


class Retained(Protocol):
    """What both cache tiers keep per checkpoint and choose by."""

    tokens: tuple[int, ...]
    session: str | None
    last_used: int
    hits: int
    superseded: bool


def longest_prefix(entries: Iterable[R], prompt: Sequence[int], longer_than: int = 0) -> R | None:
    """The longest entry (longer than ``longer_than`` tokens) whose tokens are a prefix of (or equal to) ``prompt``."""
    best: R | None = None
    for entry in entries:
        size = len(entry.tokens)
        if size <= longer_than or size > len(prompt) or (best is not None and size <= len(best.tokens)):
            continue
        if tuple(prompt[:size]) == entry.tokens:
            best = entry
    return best


def common_prefix(tokens: Sequence[int], prompt: Sequence[int], block: int = 512) -> int:
    """How many leading tokens ``tokens`` and ``prompt`` share (block-wise slice comparisons, then one block)."""
    size = min(len(tokens), len(prompt))
    start = 0
    while start < size and tuple(tokens[start : start + block]) == tuple(prompt[start : start + block]):
        start += block
    end = min(start + block, size)
    while start < end and tokens[start] == prompt[start]:
        start += 1
    return min(start, size)


def eviction_victim(entries: Iterable[R]) -> R:
    """The entry to evict first, least recently used within the first non-empty group: anonymous checkpoints that
    a later request resumed from and extended (superseded), then anonymous ones never hit, then anonymous ones hit,
    then session endpoints. A conversation's newest checkpoints outlive its older ones and the cold captures that
    never recur (an endpoint whose reasoning the next turn drops), and a hit one outlives a cold one."""

    def rank(entry: R) -> tuple[bool, int, int]:
        group = 0 if entry.superseded else 1 if entry.hits == 0 else 2
        return entry.session is not None, group, entry.last_used

    return min(entries, key=rank)


@attrs.define(eq=False)
class Checkpoint:
    """A resumable prefix: ``pages`` hold its tokens' KV, ``slot`` its recurrent state."""

    tokens: tuple[int, ...]
    pages: list[int]
    slot: int
    logits: torch.Tensor  # [V] fp32: the next-token logits after tokens[-1]
    last_used: int
    session: str | None = None  # the session whose endpoint this is; None: anonymous
    drafter: Any = None  # the speculative drafter's snapshot at the checkpoint's end; None: it restarts cold
    path: ReusePath = "private_endpoint"  # the reuse path a hit on it reports
    hits: int = 0  # admissions that resumed from it
    # a request that resumed from it kept a longer checkpoint of the same history, or it repeats a frontier a few
    # tokens before it (a prompt end after the response's prologue frontier): either way it is evicted first
    superseded: bool = False
    continuation: int | None = None  # the private continuation (one conversation history) it belongs to


class PrefixCache:
    """At most ``capacity`` checkpoints; anonymous ones are evicted (LRU) before session endpoints (LRU)."""

    def __init__(
        self,
        capacity: int,
        page_size: int,
        pages: PagePool,
        slots: SlotPool,
        state: StateCache,
        spill: "Callable[[Checkpoint], DegradationUnit] | None" = None,
        replicated: Callable[[Checkpoint], bool] | None = None,
    ) -> None:
        self.capacity = capacity
        self.page_size = page_size
        self._pages = pages
        self._slots = slots
        self._state = state
        self._spill = spill
        self._replicated = replicated
        self._entries: list[Checkpoint] = []
        self._clock = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> tuple[Checkpoint, ...]:
        return tuple(self._entries)

    def endpoint(self, session: str) -> Checkpoint | None:
        """The current endpoint of ``session``, if it is retained."""
        return next((entry for entry in self._entries if entry.session == session), None)

    @property
    def held_pages(self) -> int:
        """Distinct pages referenced by checkpoints."""
        return len({page for entry in self._entries for page in entry.pages})

    def reclaimable_pages(self, keep: Checkpoint | None = None) -> int:
        """Pages that evicting every checkpoint except ``keep`` would return to the free list."""
        refs = Counter(page for entry in self._entries if entry is not keep for page in entry.pages)
        kept = set(keep.pages) if keep is not None else set()
        return sum(1 for page, count in refs.items() if page not in kept and self._pages.ref_count(page) == count)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def lookup(self, prompt: Sequence[int]) -> Checkpoint | None:
        """The longest checkpoint whose tokens are a prefix of (or equal to) ``prompt``."""
        best = longest_prefix(self._entries, prompt)
        if best is not None:
            best.last_used = self._tick()
        return best

    def capture(
        self,
        tokens: Sequence[int],
        pages: Sequence[int],
        slot: int,
        logits: torch.Tensor,
        *,
        take_slot: bool,
        session: str | None = None,
        drafter_snapshot: Callable[[], Any] | None = None,
        path: ReusePath = "private_endpoint",
        continuation: int | None = None,
        superseded: bool = False,
    ) -> bool:
        """Keep a checkpoint of ``tokens`` whose KV is in ``pages`` and whose state is in ``slot``.

        ``take_slot`` hands the slot itself to the cache (a finished request); otherwise the state is
        copied into a spare slot. With ``session`` the checkpoint becomes that session's endpoint (an
        identical existing checkpoint is promoted instead) and the previous endpoint turns anonymous.
        ``drafter_snapshot`` is called only when a new checkpoint is kept; its result is kept with it.
        Returns False (and takes nothing) when there is no room or an identical checkpoint exists.
        """
        if self.capacity == 0 or not tokens:
            return False
        key = tuple(tokens)
        for entry in self._entries:
            if entry.tokens == key:
                entry.last_used = self._tick()
                if session is not None:
                    self._make_endpoint(entry, session)
                return False
        drafter = None if drafter_snapshot is None else drafter_snapshot()
        if session is not None:
            self._demote(session)
        while len(self._entries) >= self.capacity:
            self.evict()
        if take_slot:
            snapshot_slot = slot
        else:
            snapshot_slot = self._slots.acquire()
            self._state.copy(slot, snapshot_slot)
        kept_pages = list(pages[: pages_for(len(key), self.page_size)])
        for page in kept_pages:
            self._pages.ref(page)
        entry = Checkpoint(
            key, kept_pages, snapshot_slot, logits.detach().clone(), self._tick(), session, drafter, path,
            superseded=superseded, continuation=continuation,
        )
        self._entries.append(entry)
        return True

    def _make_endpoint(self, entry: Checkpoint, session: str) -> None:
        if entry.session == session:
            return
        self._demote(session)
        entry.session = session

    def _demote(self, session: str) -> None:
        """The current endpoint of ``session`` (if any) becomes an ordinary anonymous checkpoint."""
        previous = self.endpoint(session)
        if previous is not None:
            previous.session = None

    def evict(self, keep: Checkpoint | None = None) -> "tuple[Checkpoint, DegradationUnit] | None":
        """Evict one checkpoint other than ``keep`` (a redundant replica first, then by ``eviction_victim``),
        offered to ``spill`` first: the victim and what its eviction did; None when there is none."""
        candidates = [entry for entry in self._entries if entry is not keep]
        if not candidates:
            return None
        replicas = [entry for entry in candidates if self._replicated is not None and self._replicated(entry)]
        victim = eviction_victim(replicas or candidates)
        unit: DegradationUnit = "drop_checkpoint" if self._spill is None else self._spill(victim)
        self._drop(victim)
        return victim, unit

    def drop(self, entry: Checkpoint) -> None:
        """Forget ``entry`` (not spilled): its pages and slot are released."""
        self._drop(entry)

    def take(self, entry: Checkpoint) -> None:
        """Remove ``entry`` without releasing its pages or slot: the caller now owns them."""
        self._entries.remove(entry)

    def clear(self) -> None:
        for entry in list(self._entries):
            self._drop(entry)

    def _drop(self, entry: Checkpoint) -> None:
        self._entries.remove(entry)
        for page in entry.pages:
            self._pages.release(page)
        self._slots.release(entry.slot)
