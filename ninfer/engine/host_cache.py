"""The host tier of the context cache: prefix checkpoints moved out of device memory under pressure.

When the device prefix cache evicts a checkpoint, the engine moves it here instead of dropping it, if it fits: its
StateImage goes into one of ``state_slots`` host StateImage slots (allocated at startup, pinned on CUDA) and its KV
pages of every cache (Main and the drafter's companions) into host blocks (:mod:`ninfer.engine.host_pages`, pinned
on CUDA) counted against a byte budget in whole page extents. The logits, session and drafter snapshot travel as
they are.

Checkpoints sharing a token prefix share its pages: a store references the leading pages of the held checkpoint
with the longest common prefix (exact token comparison) and copies only the rest, so a system prompt many
conversations share is held once. A page is shared only if every position it holds is before the common prefix
less the last ``rewritten_positions`` positions: a resumable drafter's entry for a position depends on the next
token (MTP), which differs past the common prefix and is not known at a checkpoint's end, where a resumer rewrites
it. A checkpoint with a drafter snapshot vouches for its drafter's paged state, so it shares only the pages of a
checkpoint that vouches too.

To make room the tier evicts its own least recently used anonymous checkpoints first and session endpoints last,
until the bytes a store copies are free (an eviction frees only the blocks no other checkpoint references); a
checkpoint that cannot fit even in an empty tier is dropped.

A host checkpoint is never used in place: admission copies it back into a request's freshly reserved pages and
slot (:meth:`HostCache.restore`); the host copy stays valid and remains in the tier.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence, TypeVar

import attrs
import torch

from ninfer.core.request import ReusePath
from ninfer.core.runtime import KVCache, StateCache
from ninfer.engine.host_pages import HostPages, Segment, blocks, copy_block, leading, restore_pages
from ninfer.engine.pages import pages_for
from ninfer.engine.prefix_cache import common_prefix, eviction_victim

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.engine.prefix_cache import Checkpoint

MIB = 1 << 20


C = TypeVar("C")


def _difference(later: C, earlier: C) -> C:
    """Field-wise ``later - earlier`` of two cumulative counter records: one interval's deltas."""
    fields = attrs.fields(type(later))
    return type(later)(*(getattr(later, field.name) - getattr(earlier, field.name) for field in fields))


@attrs.frozen
class HostTierCounters:
    """Cumulative host-tier activity: checkpoints spilled from Device, hits restored from Host, host evictions, spills
    dropped for lack of room, and the bytes copied each way."""

    spills: int = 0
    hits: int = 0
    evictions: int = 0
    dropped: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0

    def minus(self, earlier: "HostTierCounters") -> "HostTierCounters":
        return _difference(self, earlier)


@attrs.frozen
class SelectionCounters:
    """Cumulative context-cache decisions: admissions by the reuse path they resumed from (``root``: none) and the
    prompt tokens they reused, checkpoints captured, and what the continuation limits removed."""

    root: int = 0
    private_endpoint: int = 0
    private_turn_closure: int = 0
    private_response_replay: int = 0
    private_long_anchor: int = 0
    shared_stable_prefix: int = 0
    reused_prompt_tokens: int = 0
    captures: int = 0
    continuations_evicted: int = 0
    shared_prefixes_dropped: int = 0
    long_anchors_dropped: int = 0

    def minus(self, earlier: "SelectionCounters") -> "SelectionCounters":
        return _difference(self, earlier)

    def add(self, **deltas: int) -> "SelectionCounters":
        return attrs.evolve(self, **{name: getattr(self, name) + value for name, value in deltas.items()})


@attrs.define(eq=False)
class HostCheckpoint:
    """A checkpoint held in host memory: ``segments`` hold its ``num_pages`` KV pages in order; ``kv_bytes``: what
    a restore copies (the whole coverage, shared pages included)."""

    tokens: tuple[int, ...]
    state_slot: int
    segments: tuple[Segment, ...]
    num_pages: int
    kv_bytes: int
    logits: torch.Tensor
    last_used: int
    session: str | None = None
    drafter: Any = None
    path: ReusePath = "private_endpoint"
    hits: int = 0
    superseded: bool = False
    continuation: int | None = None


def page_extent_bytes(caches: Sequence[KVCache]) -> int:
    """Bytes one page occupies across every layer of every cache (keys and values)."""
    return sum(
        tensor[0].numel() * tensor.element_size() for cache in caches for tensor in (*cache.key, *cache.value)
    )


def state_bytes(state: StateCache) -> int:
    """Bytes of one StateImage (every recurrent layer's conv window and state)."""
    return sum(tensor[0].numel() * tensor.element_size() for tensor in (*state.conv, *state.ssm))


class HostCache:
    """At most ``state_slots`` host checkpoints whose distinct KV pages fit ``kv_budget_bytes`` counted in whole
    page extents; ``rewritten_positions``: a checkpoint's last positions a resumed drafter rewrites (0: none)."""

    def __init__(
        self,
        state_slots: int,
        kv_budget_bytes: int,
        device_state: StateCache,
        page_size: int,
        rewritten_positions: int = 0,
    ) -> None:
        self.state_slots = state_slots
        self.kv_budget_bytes = kv_budget_bytes
        self.page_size = page_size
        self.rewritten_positions = rewritten_positions
        self.enabled = state_slots > 0 and kv_budget_bytes > 0
        self._pin = any(tensor.is_cuda for tensor in (*device_state.conv, *device_state.ssm))
        count = state_slots if self.enabled else 0
        self._state = StateCache(
            conv=[self._empty((count, *tensor.shape[1:]), tensor.dtype) for tensor in device_state.conv],
            ssm=[self._empty((count, *tensor.shape[1:]), tensor.dtype) for tensor in device_state.ssm],
        )
        self._free_slots = list(range(count - 1, -1, -1))
        self._entries: list[HostCheckpoint] = []
        self._pages = HostPages()
        self._clock = 0
        self.protected: HostCheckpoint | None = None  # an entry being restored: never evicted meanwhile
        self.counters = HostTierCounters()

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=self._pin)

    @property
    def entries(self) -> tuple[HostCheckpoint, ...]:
        return tuple(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_kv_bytes(self) -> int:
        """Bytes of the live blocks (pages shared by several checkpoints count once)."""
        return self._pages.used_bytes

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _count(self, **deltas: int) -> None:
        self.counters = attrs.evolve(
            self.counters, **{name: getattr(self.counters, name) + delta for name, delta in deltas.items()}
        )

    # -- lookup ------------------------------------------------------------------------------------

    def matches(self, prompt: Sequence[int], longer_than: int = 0) -> list[HostCheckpoint]:
        """Every host checkpoint longer than ``longer_than`` tokens whose tokens prefix (or equal) ``prompt``."""
        return [
            entry for entry in self._entries
            if longer_than < len(entry.tokens) <= len(prompt) and tuple(prompt[: len(entry.tokens)]) == entry.tokens
        ]

    def touch(self, entry: HostCheckpoint) -> None:
        """``entry`` was just selected: it is now the most recently used."""
        entry.last_used = self._tick()

    def holds(self, tokens: tuple[int, ...]) -> bool:
        """Whether a host checkpoint of exactly ``tokens`` is held (a device copy of it is a redundant replica)."""
        return any(entry.tokens == tokens for entry in self._entries)

    def demote(self, session: str) -> None:
        """The host endpoint of ``session`` (if any) becomes anonymous: a newer endpoint exists elsewhere."""
        for entry in self._entries:
            if entry.session == session:
                entry.session = None

    # -- moving checkpoints ------------------------------------------------------------------------

    def store(self, checkpoint: "Checkpoint", device_state: StateCache, caches: Sequence[KVCache]) -> bool:
        """Copy a device checkpoint here (its caller then releases the device pages and slot); False: dropped.

        A checkpoint already held is not copied again: the host copy is identical; it becomes the most recently
        used and takes over the device copy's session. Otherwise the leading pages a held checkpoint shares
        (:meth:`_shared`) are referenced and only the rest is copied, unless the blocks referenced would leave no
        room for that rest: then every page is copied."""
        if not self.enabled:
            return False
        tokens, session = checkpoint.tokens, checkpoint.session
        for entry in self._entries:
            if entry.tokens == tokens:
                entry.last_used = self._tick()
                if session is not None:
                    self.demote(session)
                    entry.session = session
                return True
        used_pages = checkpoint.pages[: pages_for(len(tokens), self.page_size)]
        extent = page_extent_bytes(caches)
        shared = self._shared(checkpoint)
        copied = used_pages[sum(segment.count for segment in shared) :]
        if len(copied) * extent + sum(block.nbytes for block in blocks(shared)) > self.kv_budget_bytes:
            shared, copied = (), used_pages
        self._pages.acquire(shared)  # making room below cannot free what the new entry references
        if not self._make_room(len(copied) * extent):
            self._pages.release(shared)
            self._count(dropped=1)
            return False
        if session is not None:
            self.demote(session)
        host_slot = self._free_slots.pop()
        for host, device in zip((*self._state.conv, *self._state.ssm), (*device_state.conv, *device_state.ssm)):
            host[host_slot].copy_(device[checkpoint.slot])
        segments = shared
        if copied:
            own = Segment(copy_block(caches, copied, extent, self._empty), 0, len(copied))
            self._pages.acquire((own,))
            segments += (own,)
        entry = HostCheckpoint(
            tokens, host_slot, segments, len(used_pages), len(used_pages) * extent, checkpoint.logits, self._tick(),
            session, checkpoint.drafter, checkpoint.path, checkpoint.hits, checkpoint.superseded,
            checkpoint.continuation,
        )
        self._entries.append(entry)
        self._count(spills=1, bytes_to_host=len(copied) * extent + state_bytes(device_state))
        return True

    def _shared(self, checkpoint: "Checkpoint") -> tuple[Segment, ...]:
        """The segments of the most leading pages a held checkpoint shares with ``checkpoint``: whole pages before
        their common token prefix less the last ``rewritten_positions`` positions, from a checkpoint that vouches
        for its drafter's paged state when ``checkpoint`` does (both have a snapshot)."""
        best: tuple[Segment, ...] = ()
        best_pages = 0
        for entry in self._entries:
            if checkpoint.drafter is not None and entry.drafter is None:
                continue
            exact = common_prefix(entry.tokens, checkpoint.tokens) - self.rewritten_positions
            pages = max(exact, 0) // self.page_size
            if pages > best_pages:
                best, best_pages = leading(entry.segments, pages), pages
        return best

    def _make_room(self, kv_bytes: int) -> bool:
        """Evict host checkpoints (anonymous LRU first, then endpoints) until a slot and ``kv_bytes`` are free; an
        eviction frees only the blocks no other checkpoint references, so it may take several."""
        if kv_bytes > self.kv_budget_bytes:
            return False
        while not self._free_slots or self.used_kv_bytes + kv_bytes > self.kv_budget_bytes:
            candidates = [entry for entry in self._entries if entry is not self.protected]
            if not candidates:
                return False
            victim = eviction_victim(candidates)
            self.remove(victim)
            self._count(evictions=1)
        return True

    def restore(
        self,
        entry: HostCheckpoint,
        device_state: StateCache,
        slot: int,
        caches: Sequence[KVCache],
        pages: Sequence[int],
    ) -> None:
        """Copy ``entry``'s StateImage into device ``slot`` and its KV into ``pages`` (one per held page) of
        ``caches``."""
        if any(len(block.kv) != len(caches) for block in blocks(entry.segments)) or len(pages) != entry.num_pages:
            raise RuntimeError("a host checkpoint no longer matches the device caches it would be restored into")
        for host, device in zip((*self._state.conv, *self._state.ssm), (*device_state.conv, *device_state.ssm)):
            device[slot].copy_(host[entry.state_slot], non_blocking=self._pin)
        restore_pages(entry.segments, caches, pages, self._pin)
        entry.last_used = self._tick()
        self._count(hits=1, bytes_to_device=entry.kv_bytes + state_bytes(device_state))

    # -- removal -----------------------------------------------------------------------------------

    def remove(self, entry: HostCheckpoint) -> None:
        """Forget ``entry``; its host slot is free again, and so is each of its blocks no other entry references."""
        self._entries.remove(entry)
        self._pages.release(entry.segments)
        self._free_slots.append(entry.state_slot)

    def clear(self) -> None:
        for entry in list(self._entries):
            self.remove(entry)
