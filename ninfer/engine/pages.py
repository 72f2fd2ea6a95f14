"""Host-side bookkeeping of the device pools: ref-counted KV pages and StateImage slots.

The tensors live in :class:`~ninfer.core.runtime.KVCache` / :class:`~ninfer.core.runtime.StateCache`;
these classes only decide which page or slot is whose. A page is shared by every sequence or checkpoint
holding a reference; it returns to the free list when the last reference is released.
"""

from __future__ import annotations

from ninfer.core.runtime import KVCache


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` tokens."""
    return -(-tokens // page_size)


class PagePool:
    """Ref-counted pages of the Main Text KV pool."""

    def __init__(self, num_pages: int) -> None:
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low page numbers first

    @property
    def num_pages(self) -> int:
        return len(self._refs)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A fresh page with one reference. Admission guarantees one is free; running out is a bug."""
        if not self._free:
            raise RuntimeError("KV page pool exhausted: admission reserved more pages than exist")
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def ref(self, page: int) -> None:
        if self._refs[page] <= 0:
            raise RuntimeError(f"KV page {page} is not allocated and cannot be shared")
        self._refs[page] += 1

    def release(self, page: int) -> None:
        refs = self._refs[page]
        if refs <= 0:
            raise RuntimeError(f"KV page {page} released more often than referenced")
        self._refs[page] = refs - 1
        if refs == 1:
            self._free.append(page)

    def ref_count(self, page: int) -> int:
        return self._refs[page]


class SlotPool:
    """StateImage slots: C guarantee active requests, the rest hold prefix checkpoints."""

    def __init__(self, num_slots: int) -> None:
        self._num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._taken: set[int] = set()

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def free_count(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError("StateImage slot pool exhausted: more holders than C + H slots")
        slot = self._free.pop()
        self._taken.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._taken:
            raise RuntimeError(f"StateImage slot {slot} released but not held")
        self._taken.remove(slot)
        self._free.append(slot)


def copy_kv_page(kv: KVCache, src: int, dst: int, tokens: int) -> None:
    """Copy the first ``tokens`` positions of page ``src`` into page ``dst`` in every attention layer."""
    for tensor in (*kv.key, *kv.value):
        tensor[dst, :tokens].copy_(tensor[src, :tokens])
