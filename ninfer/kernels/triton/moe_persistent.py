"""The MoE block of a one-row decode step as one persistent launch: router, experts' gate/up, experts' down.

At one row the block reads ~57 MB (35B-A3B: eight routed experts and the shared one), which the H200 streams in
~14 µs, but the grouped kernels' three dependent launches (``moe_grouped``) take ~30 µs: each waits for its
predecessor's last program, and the router's result passes through one finishing program. Here one grid whose
programs are all resident at once (``PersistentTiles.programs_per_sm``) runs three phases separated by grid barriers
(an arrival counter every program spins on), so no phase waits for a launch, and the weights a phase can already
name are in flight before its barrier:

0. router: each program multiplies a few router rows (and the shared expert's gate row) with the block's input,
   normalised by every program itself (``rms_norm(hidden + pending) * (1 + w)``; program 0 writes the new residual
   stream and the normed row for phase 1). Its router rows and, where its first gate/up unit is the shared
   expert's, that unit's rows are loaded before the wait for the previous kernel (programmatic dependent launch);
   that unit is multiplied between the program's arrival at the first barrier and its wait there, from the normed
   row in registers.
1. gate/up: every program routes the row itself from the logits (one bitonic top-k of (logit, -index) keys: the
   highest logits, the lower index first among equal ones; softmax renormalised over the selection) and runs units
   of ``gate_up_rows`` whole inner rows, the shared expert's first, then the selected experts', writing
   ``silu(gate) * up``; each unit's successor loads while it computes. Before the next barrier it loads the down rows
   of its first down unit (its first two where the grid has more units than programs and both fit).
2. down: each program sums, for its blocks of hidden rows, every selected expert's down projection weighted by the
   routing and the shared expert's gated by ``sigmoid`` of its logit, in a fixed order (deterministic, no atomics on
   data), and writes the block output.

The barriers deadlock unless every program is resident: the first one-launch call of a configuration compiles the
kernel and refuses a grid larger than the SMs hold by its registers and shared memory, and the programs of the next
kernel, launched early by programmatic dependent launch, start only after all of this grid's have (it fires the
launch right after its own wait). Triton's CPU interpreter runs programs one after another, so there
(``one_launch=False``) the same three phases run as three launches and the kernel boundaries are the barriers. The
second barrier's last arrival sets the counter back to zero (the next call touches it only after its own
predecessor wait, so after this grid has ended), so no program ends on an atomic: the 264 acquire-release atomics
that would reset it on the way out cost the H200 step 60 µs. ``trace`` records each program's clock at the phase
boundaries. Twin:
``ninfer.kernels.reference.moe.moe_forward`` (of ``ninfer.kernels.reference.norms.rms_norm`` of the sum with ``norm_weight``); rounding
follows ``moe_grouped``.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from ninfer.kernels.triton import interpreting, next_power_of_2
from ninfer.kernels.triton.moe_grouped import check_router
from ninfer.kernels.triton.norm_gemv import (
    accumulate,
    after_predecessor,
    launch_options,
    norm_weights,
    normed_product,
    normed_tile,
    pdl_supported,
    summed_tile,
    weight_tile,
)

INTERPRETER_PROGRAMS = 5  # the grid in Triton's interpreter (programs run one after another there)
TRACE_SLOTS = 16  # int64 clock stamps per program with ``trace`` (``TRACE_POINTS`` of them used)
TRACE_POINTS = ("start", "waited", "routed_rows", "barrier_1", "routing", "gate_up", "down_issued", "barrier_2", "end")


class NotResidentError(ValueError):
    """The grid does not fit the SMs all at once, so its grid barriers would never open."""


@attrs.frozen
class PersistentTiles:
    """Launch shape of the persistent MoE kernel. A unit's tiles are whole weight rows held in registers, so the row
    counts shrink (powers of two) until four gate/up tiles (a unit's and its successor's) fit
    ``TILE_ELEMENTS_PER_THREAD`` per thread, or one down unit (every selected expert's rows) twice that."""

    gate_up_rows: int = 4  # inner rows (gate and as many up rows) per gate/up unit
    down_rows: int = 8  # hidden rows per down unit (one unit per program at 35B-A3B: one pass of reductions)
    warps: int = 8
    programs_per_sm: int = 2  # the grid (all resident at once: checked against the compiled kernel's resources)
    max_registers: int | None = 128  # per thread (``maxnreg``): two programs fit per SM (sm_90: no spills but in
    # the down loop of grids with more down units than programs)
    pdl: bool = False  # programmatic dependent launch: the kernel starts while its predecessor drains (sm_90+)


TILE_ELEMENTS_PER_THREAD = 128  # weight elements of a program's live tiles per thread (bf16: 64 registers)


def default_tiles(device: torch.device | str = "cpu") -> PersistentTiles:
    """The tiles for ``device``: programmatic dependent launch on sm_90 and newer."""
    return PersistentTiles(pdl=pdl_supported(device))


def default_programs(device: torch.device | str, tiles: PersistentTiles | None = None) -> int:
    """``tiles.programs_per_sm`` programs per SM on CUDA, ``INTERPRETER_PROGRAMS`` in the interpreter."""
    device = torch.device(device)
    if device.type == "cuda":
        per_sm = (tiles or default_tiles(device)).programs_per_sm
        return per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


def resident_programs(compiled, warps: int, device: torch.device) -> int:
    """How many programs of a compiled kernel all SMs hold at once (registers, shared memory, threads, blocks)."""
    properties = torch.cuda.get_device_properties(device)
    compiled._init_handles()  # loads the binary: n_regs is known from here
    warp_registers = -(-compiled.n_regs * 32 // 256) * 256  # allocated per warp in units of 256
    by_registers = 4 * (getattr(properties, "regs_per_multiprocessor", 65536) // 4 // warp_registers) // warps
    shared = getattr(properties, "shared_memory_per_multiprocessor", 233472)
    by_shared = shared // (compiled.metadata.shared + 1024)  # 1 KB reserved per block
    by_threads = properties.max_threads_per_multi_processor // (32 * warps)
    return min(by_registers, by_shared, by_threads, 32) * properties.multi_processor_count


@triton.jit
def _arrive(counter_ptr):
    """Count this program's arrival at a grid barrier (its earlier writes released); returns the count so far."""
    tl.debug_barrier()  # every thread's writes are issued before the release below
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") + 1


@triton.jit
def _wait(counter_ptr, arrived, target):
    """Wait (after ``_arrive``) until ``target`` arrivals are counted; every write that an arrival released is then
    visible (read what other programs wrote through L2, ``.cg``)."""
    while arrived < target:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _last_grid_barrier(counter_ptr, programs):
    """The second barrier, which also resets the counter: its last arrival (the ``2 * programs``-th) sets it to
    zero, and a waiter passes once it reads ``2 * programs`` or a value below ``programs`` (only the reset goes
    there: after the first barrier the count stays in ``[programs, 2 * programs]``)."""
    arrived = _arrive(counter_ptr)
    if arrived == 2 * programs:
        tl.atomic_xchg(counter_ptr, 0, sem="release", scope="gpu")
    while arrived < 2 * programs and arrived >= programs:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _stamp(trace_ptr, index, TRACE: tl.constexpr):
    """With ``TRACE``: this program's SM clock (``%clock64``) into slot ``index`` of its trace row, and at the first
    and last point (0 and 8) the global nanosecond timer into slots 14 and 15 (``TRACE_SLOTS`` wide rows)."""
    if TRACE:
        row = trace_ptr + tl.program_id(0) * 16
        clock = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(row + index, clock)
        if index == 0 or index == 8:
            nanoseconds = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
            )
            tl.store(row + 14 + index // 8, nanoseconds)


@triton.jit
def _pick(values, index, PAD: tl.constexpr):
    """``values[index]`` of a ``[PAD]`` register vector."""
    return tl.sum(tl.where(tl.arange(0, PAD) == index, values, 0), axis=0)


@triton.jit
def _route(
    logits_ptr, num_experts, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
    NARROW_KEYS: tl.constexpr,
):
    """``(experts [TOP_K_PAD] int32, weights [TOP_K_PAD] fp32, shared gate logit)`` from the router logits: the
    ``TOP_K`` highest logits (the lower index first among equal ones), weighted by their softmax renormalised over
    the selection (what the twin's softmax, top-k and renormalisation give). One bitonic top-k (``tl.topk``) over
    integer keys that order like (logit, -index), instead of ``TOP_K`` dependent arg-max reductions: int64 keys, or
    with ``NARROW_KEYS`` (bf16-exact logits, ``BLOCK_E <= 256``) int32 keys of the logit's 16 ordered bits and an
    8-bit index, which halve the sort's exchanges."""
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + e, mask=e < num_experts, other=float("-inf"), cache_modifier=".cg")
    bits = logits.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # integers that order like the floats
    index = BLOCK_E - 1 - e
    if NARROW_KEYS:  # a bf16-exact float's low 16 bits are 0, so ordered's are 0 or (negative) 0xFFFF: drop them
        top = tl.topk(((ordered >> 16) << 8) | index, TOP_K_PAD)
        chosen_index = top & 0xFF
        top_ordered = ((top >> 8) << 16) | tl.where(top < 0, 0xFFFF, 0)
    else:
        top = tl.topk((ordered.to(tl.int64) << 32) | index.to(tl.int64), TOP_K_PAD)
        chosen_index = (top & 0xFFFFFFFF).to(tl.int32)
        top_ordered = (top >> 32).to(tl.int32)
    shared_gate = tl.load(logits_ptr + num_experts, cache_modifier=".cg")
    slots = tl.arange(0, TOP_K_PAD)
    experts = tl.where(slots < TOP_K, BLOCK_E - 1 - chosen_index, 0)
    chosen = (top_ordered ^ ((top_ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)  # the keys' logits
    weights = tl.exp(tl.where(slots < TOP_K, chosen, float("-inf")) - tl.max(chosen, axis=0))
    weights = weights / tl.sum(weights, axis=0)
    return experts, weights, shared_gate


@triton.jit
def _router_phase(
    router_tile, weights, rows, row_valid, hidden_ptr, pending_ptr, hidden_out_ptr, normed_ptr, logits_ptr,
    hidden, eps, write_out, NORM: tl.constexpr, HAS_PENDING: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Logits of the program's router rows (``router_tile [ROWS, BLOCK_H]``, with the norm ``weights`` loaded
    beforehand), rounded as activations; with ``write_out`` the new residual stream and the normed row are stored for
    the expert phases. Returns the experts' input row, fp32 ``[BLOCK_H]`` (what those phases load back)."""
    cols = tl.arange(0, BLOCK_H)
    t = tl.arange(0, 1)
    mask = (cols < hidden)[None, :]
    x = summed_tile(hidden_ptr + t, pending_ptr + t, cols, mask, HAS_PENDING)  # [1, BLOCK_H]
    logits = tl.zeros((1, ROWS), tl.float32)
    if NORM:  # the norm_gemv step: norm the row, store the new residual stream and the normed row, multiply
        values = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(values * values, axis=1) / hidden + eps)
        logits = normed_product(
            logits, router_tile, x, cols, mask, weights, rstd, hidden_out_ptr + t, normed_ptr + t, write_out,
            HAS_PENDING, True, 1,
        )
        x = normed_tile(x, rstd, weights)
    else:
        logits = accumulate(logits, x, router_tile, 1)
    tl.store(logits_ptr + rows[None, :], logits.to(x.dtype).to(tl.float32), mask=row_valid[None, :])
    return tl.reshape(x.to(tl.float32), (BLOCK_H,))


@triton.jit
def _unit_rows(
    unit, experts, gate_up_ptr, shared_gate_up_ptr, hidden, inner, shared_inner, shared_units, expert_units,
    TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, ROWS: tl.constexpr,
):
    """A gate/up unit's routing slot (``TOP_K``: the shared expert, whose units come first), inner rows, their
    validity, gate-row pointers and the offset of the up rows."""
    shared = unit < shared_units
    slot = tl.where(shared, TOP_K, (unit - shared_units) // expert_units)
    block = tl.where(shared, unit, (unit - shared_units) % expert_units)
    expert = _pick(experts, slot, TOP_K_PAD).to(tl.int64)
    width = tl.where(shared, shared_inner, inner)
    rows = block * ROWS + tl.arange(0, ROWS)
    base = tl.where(shared, shared_gate_up_ptr, gate_up_ptr + expert * 2 * inner * hidden)
    return slot, rows, rows < width, base + rows.to(tl.int64) * hidden, width * hidden


@triton.jit
def _gate_up_tiles(
    unit, stop_unit, experts, gate_up_ptr, shared_gate_up_ptr, hidden, inner, shared_inner,
    shared_units, expert_units, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The unit's whole gate and up rows ``([ROWS, BLOCK_H], [ROWS, BLOCK_H])``; zero unless ``unit <
    stop_unit``."""
    _, _, row_valid, gate_rows, up_offset = _unit_rows(
        unit, experts, gate_up_ptr, shared_gate_up_ptr, hidden, inner, shared_inner, shared_units, expert_units,
        TOP_K, TOP_K_PAD, ROWS,
    )
    valid = row_valid & (unit < stop_unit)
    gate = weight_tile(gate_rows, valid, 0, hidden, BLOCK_H)
    return gate, weight_tile(gate_rows + up_offset, valid, 0, hidden, BLOCK_H)


@triton.jit
def _gate_up_store(
    gate_tile, up_tile, x, unit, experts, gate_up_ptr, shared_gate_up_ptr, act_ptr, act_stride, hidden, inner,
    shared_inner, shared_units, expert_units, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, ROWS: tl.constexpr,
):
    """``silu(gate) * up`` of the unit from its tiles and the input row ``x`` (fp32), rounded as the twin rounds."""
    slot, rows, row_valid, _, _ = _unit_rows(
        unit, experts, gate_up_ptr, shared_gate_up_ptr, hidden, inner, shared_inner, shared_units, expert_units,
        TOP_K, TOP_K_PAD, ROWS,
    )
    out_type = act_ptr.dtype.element_ty
    gate = tl.sum(gate_tile.to(tl.float32) * x[None, :], axis=1).to(out_type).to(tl.float32)
    up = tl.sum(up_tile.to(tl.float32) * x[None, :], axis=1).to(out_type).to(tl.float32)
    activated = (gate * tl.sigmoid(gate)).to(out_type).to(tl.float32) * up
    tl.store(act_ptr + slot * act_stride + rows, activated.to(out_type), mask=row_valid)


@triton.jit
def _down_tiles(
    unit, experts, down_ptr, shared_down_ptr, hidden, inner, shared_inner,
    TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """The down-projection rows of hidden-row block ``unit``: every selected expert's ``[ROWS, TOP_K_PAD, BLOCK_I]``
    and the shared expert's ``[ROWS, BLOCK_I]`` (zero past the hidden rows), loaded at once."""
    rows = unit * ROWS + tl.arange(0, ROWS)
    row_valid = rows < hidden
    slots = tl.arange(0, TOP_K_PAD)
    cols = tl.arange(0, BLOCK_I)
    routed = (
        down_ptr + experts.to(tl.int64)[None, :, None] * hidden * inner + rows.to(tl.int64)[:, None, None] * inner
        + cols[None, None, :]
    )
    routed_mask = row_valid[:, None, None] & (slots < TOP_K)[None, :, None] & (cols < inner)[None, None, :]
    shared = shared_down_ptr + rows.to(tl.int64)[:, None] * shared_inner + cols[None, :]
    shared_mask = row_valid[:, None] & (cols < shared_inner)[None, :]
    return tl.load(routed, mask=routed_mask, other=0.0), tl.load(shared, mask=shared_mask, other=0.0)


@triton.jit
def _down_store(
    routed_tile, shared_tile, unit, weights, shared_gate, act_ptr, act_stride, out_ptr, hidden, inner, shared_inner,
    TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """The block output's hidden rows of ``unit`` from their down tiles: routing-weighted expert outputs plus the
    shared one gated by ``sigmoid`` of its logit (each expert's output rounded as the twin rounds it)."""
    out_type = out_ptr.dtype.element_ty
    slots = tl.arange(0, TOP_K_PAD)
    cols = tl.arange(0, BLOCK_I)
    act_mask = (slots < TOP_K)[:, None] & (cols < inner)[None, :]
    act = tl.load(act_ptr + slots[:, None] * act_stride + cols[None, :], mask=act_mask, other=0.0, cache_modifier=".cg")
    routed = tl.sum(routed_tile.to(tl.float32) * act.to(tl.float32)[None, :, :], axis=2).to(out_type).to(tl.float32)
    total = tl.sum(routed * weights[None, :], axis=1)
    shared_act = tl.load(act_ptr + TOP_K * act_stride + cols, mask=cols < shared_inner, other=0.0, cache_modifier=".cg")
    shared = tl.sum(shared_tile.to(tl.float32) * shared_act.to(tl.float32)[None, :], axis=1).to(out_type)
    total += tl.sigmoid(shared_gate) * shared.to(tl.float32)
    rows = unit * ROWS + tl.arange(0, ROWS)
    tl.store(out_ptr + rows, total.to(out_type), mask=rows < hidden)


@triton.jit
def _persistent_moe_kernel(
    hidden_ptr, pending_ptr, norm_weight_ptr, hidden_out_ptr, normed_ptr, eps,
    router_ptr, expert_gate_ptr, gate_up_ptr, down_ptr, shared_gate_up_ptr, shared_down_ptr,
    logits_ptr, act_ptr, out_ptr, counter_ptr, trace_ptr, num_experts, hidden, inner, shared_inner, act_stride,
    TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, BLOCK_E: tl.constexpr, NARROW_KEYS: tl.constexpr,
    ROUTER_ROWS: tl.constexpr, BLOCK_H: tl.constexpr, GATE_UP_ROWS: tl.constexpr, DOWN_ROWS: tl.constexpr,
    DOWN_AHEAD: tl.constexpr, BLOCK_I: tl.constexpr, NORM: tl.constexpr, HAS_PENDING: tl.constexpr,
    PHASE: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr,
):
    # PHASE -1: all three phases with grid barriers between them; 0, 1, 2: that phase alone (the interpreter's form)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    shared_units = tl.cdiv(shared_inner, GATE_UP_ROWS)
    expert_units = tl.cdiv(inner, GATE_UP_ROWS)
    gate_up_units = shared_units + TOP_K * expert_units
    down_units = tl.cdiv(hidden, DOWN_ROWS)
    _stamp(trace_ptr, 0, TRACE)
    # before the predecessor wait: the router rows and the first unit's tiles if it is the shared expert's
    if PHASE <= 0:
        rows = pid * ROUTER_ROWS + tl.arange(0, ROUTER_ROWS)
        row_valid = rows < num_experts + 1
        w_rows = tl.where(rows < num_experts, router_ptr + rows.to(tl.int64) * hidden, expert_gate_ptr)
        router_tile = weight_tile(w_rows, row_valid, 0, hidden, BLOCK_H)
        cols = tl.arange(0, BLOCK_H)
        weights = norm_weights(norm_weight_ptr, cols, (cols < hidden) & NORM)
        no_experts = tl.zeros((TOP_K_PAD,), tl.int32)
        gate_tile, up_tile = _gate_up_tiles(
            pid, shared_units, no_experts, gate_up_ptr, shared_gate_up_ptr, hidden, inner, shared_inner,
            shared_units, expert_units, TOP_K, TOP_K_PAD, GATE_UP_ROWS, BLOCK_H,
        )
    after_predecessor(PDL)
    _stamp(trace_ptr, 1, TRACE)
    if PHASE <= 0:
        x = _router_phase(
            router_tile, weights, rows, row_valid, hidden_ptr, pending_ptr, hidden_out_ptr, normed_ptr,
            logits_ptr, hidden, eps, pid == 0, NORM, HAS_PENDING, ROUTER_ROWS, BLOCK_H,
        )
    _stamp(trace_ptr, 2, TRACE)
    if PHASE == -1:
        arrived = _arrive(counter_ptr)
    if PHASE <= 0:  # the program's first shared-expert unit, while the other programs' logits arrive
        if pid < shared_units:
            _gate_up_store(
                gate_tile, up_tile, x, pid, no_experts, gate_up_ptr, shared_gate_up_ptr, act_ptr, act_stride, hidden,
                inner, shared_inner, shared_units, expert_units, TOP_K, TOP_K_PAD, GATE_UP_ROWS,
            )
    if PHASE == -1:
        _wait(counter_ptr, arrived, programs)
    _stamp(trace_ptr, 3, TRACE)
    if PHASE != 0:
        experts, weights, shared_gate = _route(logits_ptr, num_experts, TOP_K, TOP_K_PAD, BLOCK_E, NARROW_KEYS)
    _stamp(trace_ptr, 4, TRACE)
    if PHASE == -1 or PHASE == 1:  # each unit's successor loads while it computes
        start = tl.where(pid < shared_units, pid + programs, pid)  # the first unit is done
        gate_tile, up_tile = _gate_up_tiles(
            start, gate_up_units, experts, gate_up_ptr, shared_gate_up_ptr, hidden, inner, shared_inner,
            shared_units, expert_units, TOP_K, TOP_K_PAD, GATE_UP_ROWS, BLOCK_H,
        )
        if PHASE == 1:  # the phase's own launch: the input row as phase 0 stored it
            cols = tl.arange(0, BLOCK_H)
            x_ptr = normed_ptr if NORM else hidden_ptr
            x = tl.load(x_ptr + cols, mask=cols < hidden, other=0.0, cache_modifier=".cg").to(tl.float32)
        for unit in range(start, gate_up_units, programs):
            next_gate, next_up = _gate_up_tiles(
                unit + programs, gate_up_units, experts, gate_up_ptr, shared_gate_up_ptr, hidden, inner,
                shared_inner, shared_units, expert_units, TOP_K, TOP_K_PAD, GATE_UP_ROWS, BLOCK_H,
            )
            _gate_up_store(
                gate_tile, up_tile, x, unit, experts, gate_up_ptr, shared_gate_up_ptr, act_ptr, act_stride, hidden,
                inner, shared_inner, shared_units, expert_units, TOP_K, TOP_K_PAD, GATE_UP_ROWS,
            )
            gate_tile, up_tile = next_gate, next_up
    _stamp(trace_ptr, 5, TRACE)
    if PHASE == -1 or PHASE == 2:  # the first down units' rows stream while the other programs finish gate/up
        routed_tile, shared_tile = _down_tiles(
            pid, experts, down_ptr, shared_down_ptr, hidden, inner, shared_inner, TOP_K, TOP_K_PAD, DOWN_ROWS, BLOCK_I,
        )
        if DOWN_AHEAD == 2:
            second_routed, second_shared = _down_tiles(
                pid + programs, experts, down_ptr, shared_down_ptr, hidden, inner, shared_inner, TOP_K, TOP_K_PAD,
                DOWN_ROWS, BLOCK_I,
            )
    _stamp(trace_ptr, 6, TRACE)
    if PHASE == -1:  # the second barrier leaves the counter at zero for the next call
        _last_grid_barrier(counter_ptr, programs)
    _stamp(trace_ptr, 7, TRACE)
    if PHASE == -1 or PHASE == 2:
        if pid < down_units:
            _down_store(
                routed_tile, shared_tile, pid, weights, shared_gate, act_ptr, act_stride, out_ptr, hidden, inner,
                shared_inner, TOP_K, TOP_K_PAD, DOWN_ROWS, BLOCK_I,
            )
        if DOWN_AHEAD == 2:
            if pid + programs < down_units:
                _down_store(
                    second_routed, second_shared, pid + programs, weights, shared_gate, act_ptr, act_stride, out_ptr,
                    hidden, inner, shared_inner, TOP_K, TOP_K_PAD, DOWN_ROWS, BLOCK_I,
                )
        for unit in range(pid + DOWN_AHEAD * programs, down_units, programs):
            routed_tile, shared_tile = _down_tiles(
                unit, experts, down_ptr, shared_down_ptr, hidden, inner, shared_inner, TOP_K, TOP_K_PAD, DOWN_ROWS,
                BLOCK_I,
            )
            _down_store(
                routed_tile, shared_tile, unit, weights, shared_gate, act_ptr, act_stride, out_ptr, hidden, inner,
                shared_inner, TOP_K, TOP_K_PAD, DOWN_ROWS, BLOCK_I,
            )
    _stamp(trace_ptr, 8, TRACE)


_RESIDENT: dict[tuple, int] = {}  # resident_programs per launch configuration


def _check_resident(programs: int, args: tuple, constants: dict, warps: int, device: torch.device) -> None:
    """The grid barriers deadlock unless every program is resident at once: refuse a grid larger than that."""
    if device.type != "cuda":
        raise ValueError("one_launch needs a CUDA device (the interpreter runs programs one after another)")
    key = (device.index, *sorted(constants.items()))
    if key not in _RESIDENT:
        compiled = _persistent_moe_kernel.warmup(*args, PHASE=-1, grid=(programs,), **constants)
        _RESIDENT[key] = resident_programs(compiled, warps, device)
    if programs > _RESIDENT[key]:
        raise NotResidentError(
            f"one_launch needs every program resident: at most {_RESIDENT[key]} programs, got {programs}"
        )


def _rows_within(rows: int, elements_per_row: int, budget: int) -> int:
    """The largest power of two <= ``rows`` (at least 1) whose ``elements_per_row`` fit ``budget``."""
    fitting = next_power_of_2(rows)
    while fitting > 1 and (fitting > rows or fitting * elements_per_row > budget):
        fitting //= 2
    return fitting


def persistent_moe_decode(
    hidden: torch.Tensor,
    pending: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    *,
    shared_gate_up: torch.Tensor,
    shared_down: torch.Tensor,
    shared_expert_gate: torch.Tensor,
    workspace: torch.Tensor,
    tiles: PersistentTiles | None = None,
    programs: int | None = None,
    one_launch: bool | None = None,
    trace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The MoE block of one row ``hidden [1, H]``; returns ``(block output, new hidden, router logits)``.

    With ``norm_weight`` the block's input is ``rms_norm(hidden + pending) * (1 + norm_weight)`` and the new hidden
    is ``hidden + pending`` (``hidden`` itself without ``pending``); without it ``hidden`` is the input (no
    ``pending``) and is returned as the new hidden. Weights as in ``moe_grouped.grouped_moe_decode`` (the shared
    expert is required). Logits ``[E + 1]`` fp32: the router's, then the shared expert's gate logit.
    ``workspace``: a zeroed int32 tensor (``moe_grouped.moe_workspace``: its first entry is the barrier counter,
    left zeroed). ``programs``: the grid (default: ``default_programs``; all resident with ``one_launch``).
    ``one_launch``: the phases in one launch with grid barriers (default everywhere but Triton's interpreter).
    ``trace``: an int64 ``[programs, TRACE_SLOTS]`` tensor that receives each program's SM clock at ``TRACE_POINTS``
    (CUDA only).
    """
    tokens, width = hidden.shape
    if tokens != 1 or not hidden.is_contiguous():
        raise ValueError(f"hidden must be one contiguous row [1, H]; got {tuple(hidden.shape)}")
    norm = norm_weight is not None
    if pending is not None and (not norm or pending.shape != hidden.shape or not pending.is_contiguous()):
        raise ValueError(f"pending needs norm_weight and must be a contiguous [1, {width}]")
    if norm and (norm_weight.shape != (width,) or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight must be a contiguous [{width}]; got {tuple(norm_weight.shape)}")
    num_experts = check_router(router, shared_expert_gate, top_k, width)
    if gate_up.dim() != 3 or gate_up.shape[::2] != (num_experts, width) or not gate_up.is_contiguous():
        raise ValueError(f"gate_up must be a contiguous [{num_experts}, 2I, {width}]; got {tuple(gate_up.shape)}")
    inner = gate_up.shape[1] // 2
    if down.shape != (num_experts, width, inner) or not down.is_contiguous():
        raise ValueError(f"down must be a contiguous [{num_experts}, {width}, {inner}]; got {tuple(down.shape)}")
    shared_inner = shared_gate_up.shape[0] // 2
    if shared_gate_up.shape[1] != width or shared_gate_up.stride() != (width, 1):
        raise ValueError(f"shared_gate_up must be a contiguous [2S, {width}]; got {tuple(shared_gate_up.shape)}")
    if shared_down.shape != (width, shared_inner) or not shared_down.is_contiguous():
        raise ValueError(f"shared_down must be a contiguous [{width}, {shared_inner}]; got {tuple(shared_down.shape)}")
    if workspace.dtype != torch.int32 or workspace.numel() < 1:
        raise ValueError("workspace must be a zeroed int32 tensor")
    device = hidden.device
    tiles = tiles or default_tiles(device)
    one_launch = not interpreting() if one_launch is None else one_launch
    programs = programs or default_programs(device, tiles)
    if trace is not None and (trace.dtype != torch.int64 or trace.shape != (programs, TRACE_SLOTS)):
        raise ValueError(f"trace must be an int64 [{programs}, {TRACE_SLOTS}] tensor")
    has_pending = pending is not None
    new_hidden = torch.empty_like(hidden) if has_pending else hidden
    normed = torch.empty_like(hidden) if norm else hidden
    logits = torch.empty(num_experts + 1, dtype=torch.float32, device=device)
    act_stride = max(inner, shared_inner)
    act = torch.empty((top_k + 1, act_stride), dtype=hidden.dtype, device=device)
    out = torch.empty_like(hidden)
    args = (
        hidden, pending if has_pending else hidden, norm_weight if norm else hidden, new_hidden, normed, eps,
        router, shared_expert_gate, gate_up, down, shared_gate_up, shared_down, logits, act, out, workspace,
        workspace if trace is None else trace,
        num_experts, width, inner, shared_inner, act_stride,
    )
    block_h, block_i, top_k_pad = next_power_of_2(width), next_power_of_2(act_stride), next_power_of_2(top_k)
    budget = TILE_ELEMENTS_PER_THREAD * 32 * tiles.warps
    # the down units loaded before the second barrier take the registers of a gate/up unit and its lookahead and as
    # many again: one unit of ``down_rows``, two where the grid has more units than programs and two fit
    down_elements = (top_k_pad + 1) * block_i
    down_rows = _rows_within(tiles.down_rows, down_elements, 2 * budget)
    down_ahead = 2 if triton.cdiv(width, down_rows) > programs and down_rows * down_elements <= budget else 1
    constants = dict(
        TOP_K=top_k, TOP_K_PAD=top_k_pad, BLOCK_E=next_power_of_2(num_experts),
        NARROW_KEYS=hidden.dtype == torch.bfloat16 and num_experts <= 256,
        ROUTER_ROWS=next_power_of_2(triton.cdiv(num_experts + 1, programs)), BLOCK_H=block_h,
        GATE_UP_ROWS=_rows_within(tiles.gate_up_rows, 4 * block_h, budget),
        DOWN_ROWS=down_rows, DOWN_AHEAD=down_ahead, BLOCK_I=block_i, NORM=norm,
        HAS_PENDING=has_pending, TRACE=trace is not None,
        PDL=tiles.pdl, num_warps=tiles.warps, **launch_options(tiles.pdl),
        **({} if tiles.max_registers is None else {"maxnreg": tiles.max_registers}),
    )
    if one_launch:
        _check_resident(programs, args, constants, tiles.warps, device)
    for phase in (-1,) if one_launch else (0, 1, 2):
        _persistent_moe_kernel[(programs,)](*args, PHASE=phase, **constants)
    return out, new_hidden, logits
