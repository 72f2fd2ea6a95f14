"""Gated DeltaNet states with their last rank-one updates pending instead of stored.

A decode step of the gated delta rule turns a head's fp32 state into ``S' = g * S + k' delta^T``: it reads the
state (``Dk * Dv * 4`` bytes) and writes it back. The write is DRAM traffic of the same size as the read, which the
decode roofline does not count (2 MB per layer and row at 35B-A3B). Here a decode step may instead append its
update's factors, ``k'`` (``Dk``), ``delta`` (``Dv``) and ``g``, to the head's record of pending updates (about 1 KB)
and leave the stored state as it was; the next step replays the records onto the stored state while it waits for
its inputs, so the state it computes with is the same. When a head's record is full, the step stores the state
and empties the record: the state is written once every ``capacity + 1`` steps.

``PendingStateUpdates`` holds the records of every Gated DeltaNet layer of a ``StateCache``; ``settle`` applies them
all (the cache calls it before anyone but the decode kernel reads or writes a state). A record's count is kept per
program of the decode kernel (slot, value head, block of value columns), so that no program reads a count that
another program of the same launch may already have advanced.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl


@attrs.frozen
class PendingLayer:
    """One layer's records: ``keys [S, Hv, P, Dk]``, ``deltas [S, Hv, P, Dv]``, ``decays [S, Hv, P]`` fp32 and
    ``counts [S, Hv, splits]`` int32 (updates pending per slot, head and block of value columns)."""

    keys: torch.Tensor
    deltas: torch.Tensor
    decays: torch.Tensor
    counts: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def value_split(self) -> int:
        return self.counts.shape[2]


@triton.jit
def replay_pending(state, keys_ptr, deltas_ptr, decays_ptr, count, dk, dv, CAPACITY: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr):
    """``state`` (a ``[DK, block]`` tile at value columns ``dv``) after the first ``count`` of its head's records:
    the same products, in the same order, as the decode steps that left them. Every record is loaded (the ones past
    ``count`` are finite leftovers, or zeros) and the count only selects, so no load waits for it."""
    for j in tl.static_range(CAPACITY):
        live = j < count
        decay = tl.where(live, tl.load(decays_ptr + j), 1.0)
        key = tl.where(live, tl.load(keys_ptr + j * DK + dk), 0.0)
        delta = tl.load(deltas_ptr + j * DV + dv)
        state = state * decay + key[:, None] * delta[None, :]
    return state


@triton.jit
def _settle_kernel(
    state_ptr, keys_ptr, deltas_ptr, decays_ptr, counts_ptr,
    VALUE_HEADS: tl.constexpr, CAPACITY: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    slot, head, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    record = slot * VALUE_HEADS + head
    count_at = counts_ptr + record * tl.num_programs(2) + split
    count = tl.load(count_at)
    if count > 0:
        dk = tl.arange(0, DK)
        dv = split * BLOCK_DV + tl.arange(0, BLOCK_DV)
        tile = state_ptr + record * (DK * DV) + dk[:, None] * DV + dv[None, :]
        state = replay_pending(
            tl.load(tile), keys_ptr + record * (CAPACITY * DK), deltas_ptr + record * (CAPACITY * DV),
            decays_ptr + record * CAPACITY, count, dk, dv, CAPACITY, DK, DV,
        )
        tl.store(tile, state)
        tl.store(count_at, 0)


def settle_layer(state: torch.Tensor, pending: PendingLayer) -> None:
    """Apply ``pending``'s records to ``state [S, Hv, Dk, Dv]`` in place and empty them."""
    slots, heads, key_dim, value_dim = state.shape
    splits = pending.value_split
    _settle_kernel[(slots, heads, splits)](
        state, pending.keys, pending.deltas, pending.decays, pending.counts,
        VALUE_HEADS=heads, CAPACITY=pending.capacity, DK=key_dim, DV=value_dim, BLOCK_DV=value_dim // splits,
    )


@attrs.define
class PendingStateUpdates:
    """The pending records of every Gated DeltaNet layer of a ``StateCache`` (``layers[i]`` belongs to
    ``states[i]``); ``dirty`` is set by whoever launches kernels that leave records, and cleared by ``settle``."""

    states: list[torch.Tensor]
    layers: list[PendingLayer]
    dirty: bool = False

    @classmethod
    def allocate(cls, states: list[torch.Tensor], capacity: int, value_split: int) -> "PendingStateUpdates":
        """Empty records of ``capacity`` updates for ``states`` (each ``[S, Hv, Dk, Dv]`` fp32), kept per block of
        ``value_split`` value columns (the decode kernel's split, which must stay the same)."""
        if capacity < 1 or value_split < 1:
            raise ValueError(f"capacity ({capacity}) and value_split ({value_split}) must be >= 1")
        layers = []
        for state in states:
            slots, heads, key_dim, value_dim = state.shape
            if value_dim % value_split:
                raise ValueError(f"value_split {value_split} must divide the value dim {value_dim}")
            zeros = dict(dtype=torch.float32, device=state.device)
            layers.append(PendingLayer(
                keys=torch.zeros((slots, heads, capacity, key_dim), **zeros),
                deltas=torch.zeros((slots, heads, capacity, value_dim), **zeros),
                decays=torch.zeros((slots, heads, capacity), **zeros),
                counts=torch.zeros((slots, heads, value_split), dtype=torch.int32, device=state.device),
            ))
        return cls(states=list(states), layers=layers)

    @property
    def capacity(self) -> int:
        return self.layers[0].capacity

    @property
    def value_split(self) -> int:
        return self.layers[0].value_split

    def settle(self) -> None:
        """Apply every pending update to its state (launched on the current stream) and empty the records."""
        if not self.dirty:
            return
        for state, layer in zip(self.states, self.layers):
            settle_layer(state, layer)
        self.dirty = False
