"""On-device token sampling: penalties, temperature, top-k, top-p, min-p and the inverse-CDF pick in two launches.

Twin: ``ninfer.kernels.reference.sampling.sample_rows`` (same arguments, same rule). Stage 1 splits every row into chunks
(2048 columns below 4 rows, else 8192), one program each: it subtracts the row's penalty on the fly and extracts
the chunk's top ``TOP_K_CAP`` candidates. Stage 2, one program per row, merges the chunks' candidates into the row's
sorted top ``TOP_K_CAP`` and applies temperature, top-k, softmax, top-p, min-p and the pick with the row's uniform;
a row with temperature 0 takes its best candidate. So a 248320-wide row is read once, by 31 to 122 programs. Both
stages select with a bound instead of twenty passes over their block (see ``_top_keys``).

A candidate travels as one int64 key (``argmax_keys``): the order-preserving integer image of its fp32 penalized
logit in the high 32 bits and ``2**31 - 1 - column`` in the low bits, so the largest key is the largest logit and,
among equal logits, the lowest column (which is ``argmax``'s first-index rule; ``torch.topk`` leaves the order of
equal logits unspecified, so sampled rows agree with the twin exactly only where the top candidates are tie-free).
``-0.0`` ranks just below ``+0.0``.

Softmax exponentials use Triton's ``exp``, so probabilities differ from torch's in the last bits: a uniform or a
top-p/min-p threshold falling within ~1e-6 of a boundary can resolve differently; otherwise the ids are identical.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.kernels.reference.sampling import TOP_K_CAP
from ninfer.kernels.triton.argmax_keys import INT64_MIN, key_column, sortable_key

SMALL_BATCH_CHUNK, CHUNK = 2048, 8192  # below 4 rows narrower chunks spread one row over more programs
_KEY_LANES = 32  # >= TOP_K_CAP, a power of two
_GROUPS = 64  # strided groups whose maxima bound a block's top keys
_SLOTS = 64  # candidates ranked directly; more fall back to one maximum at a time
_INT64_MAX = tl.constexpr(2**63 - 1)


@triton.jit
def _key_value(keys):
    ordered = (keys >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _top_keys_iterative(keys, K: tl.constexpr, LANES: tl.constexpr):
    """The ``K`` largest keys sorted descending in ``LANES`` lanes (int64 minimum past them), one maximum at a time."""
    lanes = tl.arange(0, LANES)
    top = tl.full([LANES], INT64_MIN, tl.int64)
    for slot in tl.static_range(K):
        best = tl.max(keys, axis=0)
        top = tl.where(lanes == slot, best, top)
        keys = tl.where(keys == best, INT64_MIN, keys)
    return top


@triton.jit
def _top_keys_by_rank(candidates, K: tl.constexpr, LANES: tl.constexpr):
    """The same for a short vector: each key's rank is the number of larger keys; rank ``r`` goes to lane ``r``."""
    rank = tl.sum((candidates[None, :] > candidates[:, None]).to(tl.int32), axis=1)
    lanes = tl.arange(0, LANES)
    placed = (rank[:, None] == lanes[None, :]) & (lanes[None, :] < K)
    return tl.max(tl.where(placed, candidates[:, None], INT64_MIN), axis=0)


@triton.jit
def _top_keys(
    keys,
    scratch_ptr,
    K: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """The ``K`` largest of ``keys [BLOCK]`` (distinct apart from int64-minimum padding) sorted descending.

    Strided groups (column ``i`` in group ``i % GROUPS``) bound the answer from below: the K-th largest group
    maximum is at most the K-th largest key, so only keys at or above it are candidates. Those (usually a few
    more than K) are compacted through ``scratch_ptr`` (``SLOTS`` keys of this program's own) and ranked; when
    more than ``SLOTS`` qualify (heavily clustered input) the keys are extracted one maximum at a time.
    """
    group_max = tl.max(tl.reshape(keys, [BLOCK // GROUPS, GROUPS]), axis=0)
    group_rank = tl.sum((group_max[None, :] > group_max[:, None]).to(tl.int32), axis=1)
    floor = tl.min(tl.where(group_rank < K, group_max, _INT64_MAX), axis=0)
    chosen = (keys >= floor) & (keys != INT64_MIN)
    count = tl.sum(chosen.to(tl.int32), axis=0)
    if count <= SLOTS:
        slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        tl.store(scratch_ptr + slot, keys, mask=chosen)
        tl.debug_barrier()
        offsets = tl.arange(0, SLOTS)
        candidates = tl.load(scratch_ptr + offsets, mask=offsets < count, other=INT64_MIN)
        top = _top_keys_by_rank(candidates, K, LANES)
    else:
        top = _top_keys_iterative(keys, K, LANES)
    return top


@triton.jit
def _chunk_candidates_kernel(
    logits_ptr,
    penalty_ptr,
    penalty_rows_ptr,
    keys_ptr,
    scratch_ptr,
    n_cols,
    logits_stride,
    penalty_stride,
    penalty_cols,
    n_chunks,
    HAS_PENALTY: tl.constexpr,
    K: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
    SLOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    columns = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = columns < n_cols
    values = tl.load(logits_ptr + row * logits_stride + columns, mask=inside, other=0.0).to(tl.float32)
    if HAS_PENALTY:
        penalty_row = tl.load(penalty_rows_ptr + row).to(tl.int64)
        penalized = inside & (columns < penalty_cols) & (penalty_row >= 0)
        safe_row = tl.maximum(penalty_row, 0)
        values -= tl.load(penalty_ptr + safe_row * penalty_stride + columns, mask=penalized, other=0.0).to(tl.float32)
    keys = tl.where(inside, sortable_key(values, columns), INT64_MIN)
    program = row * n_chunks + chunk
    top = _top_keys(keys, scratch_ptr + program * SLOTS, K, LANES, BLOCK, GROUPS, SLOTS)
    lanes = tl.arange(0, LANES)
    tl.store(keys_ptr + program * K + lanes, top, mask=lanes < K)


@triton.jit
def _pick_kernel(
    keys_ptr,
    scratch_ptr,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    uniform_ptr,
    out_ptr,
    n_keys,
    cap,
    K: tl.constexpr,
    LANES: tl.constexpr,
    BLOCK: tl.constexpr,
    GROUPS: tl.constexpr,
    SLOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    keys = tl.load(keys_ptr + row * n_keys + offsets, mask=offsets < n_keys, other=INT64_MIN)
    top = _top_keys(keys, scratch_ptr + row * SLOTS, K, LANES, BLOCK, GROUPS, SLOTS)
    lanes = tl.arange(0, LANES)
    columns = key_column(top)
    best_column = tl.sum(tl.where(lanes == 0, columns, 0), axis=0)

    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if temperature > 0:
        keep = tl.load(top_k_ptr + row).to(tl.int32)
        keep = tl.where((keep <= 0) | (keep > cap), cap, keep)
        values = tl.where(lanes < keep, _key_value(top) / temperature, float("-inf"))
        exps = tl.exp(values - tl.max(values, axis=0))
        probs = exps / tl.sum(exps, axis=0)

        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        top_p = tl.where(top_p < 1.0, top_p, float("inf"))  # top-p 1 keeps every candidate
        mass_before = tl.cumsum(probs, axis=0) - probs
        probs = tl.where((mass_before >= top_p) & (lanes > 0), 0.0, probs)
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        first = tl.sum(tl.where(lanes == 0, probs, 0.0), axis=0)
        probs = tl.where(probs < first * min_p, 0.0, probs)
        probs = probs / tl.sum(probs, axis=0)

        cdf = tl.cumsum(probs.to(tl.float64), axis=0)
        target = tl.load(uniform_ptr + row).to(tl.float64) * tl.max(cdf, axis=0)
        pick = tl.minimum(tl.sum((cdf <= target).to(tl.int32), axis=0), cap - 1)
        tl.store(out_ptr + row, tl.sum(tl.where(lanes == pick, columns, 0), axis=0))
    else:
        tl.store(out_ptr + row, best_column)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniform: torch.Tensor,
    *,
    penalty: torch.Tensor | None = None,
    penalty_rows: torch.Tensor | None = None,
    vocab_limit: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits [R, V]`` (``[R]`` int64 on the logits' device); see the twin for the rule.

    ``logits`` and ``penalty`` (``[P, W]``) need unit column stride; ``penalty_rows [R]`` indexes ``penalty``
    (negative: no penalty; omitted: row ``i`` uses ``penalty[i]``). The per-row tensors must be on the logits'
    device; ``chunk`` (a power of two, by default chosen from the row count) is the stage-1 width.
    """
    rows, width = _check_inputs(logits, (temperature, top_k, top_p, min_p, uniform), penalty, penalty_rows)
    n_cols = width if vocab_limit is None else max(1, min(width, vocab_limit))
    chunk = _stage_chunk(rows, chunk)
    device = logits.device
    out = torch.empty(rows, dtype=torch.int64, device=device)
    if rows == 0:
        return out
    block = max(_KEY_LANES, min(chunk, triton.next_power_of_2(n_cols)))
    n_chunks = triton.cdiv(n_cols, block)
    n_keys = n_chunks * TOP_K_CAP
    workspace = torch.empty(rows * (n_keys + (n_chunks + 1) * _SLOTS), dtype=torch.int64, device=device)
    keys, scratch = workspace[: rows * n_keys], workspace[rows * n_keys :]
    if penalty is not None and penalty_rows is None:
        penalty_rows = torch.arange(rows, device=device)
    has_penalty = penalty is not None
    _chunk_candidates_kernel[(rows, n_chunks)](
        logits,
        penalty if has_penalty else logits,
        penalty_rows if has_penalty else out,
        keys,
        scratch,
        n_cols,
        logits.stride(0),
        penalty.stride(0) if has_penalty else 0,
        penalty.shape[1] if has_penalty else 0,
        n_chunks,
        HAS_PENALTY=has_penalty,
        K=TOP_K_CAP,
        LANES=_KEY_LANES,
        BLOCK=block,
        GROUPS=min(_GROUPS, block),
        SLOTS=_SLOTS,
        num_warps=4,
    )
    merge_block = max(_KEY_LANES, triton.next_power_of_2(n_keys))
    _pick_kernel[(rows,)](
        keys,
        scratch[rows * n_chunks * _SLOTS :],
        temperature,
        top_k,
        top_p,
        min_p,
        uniform,
        out,
        n_keys,
        min(TOP_K_CAP, n_cols),
        K=TOP_K_CAP,
        LANES=_KEY_LANES,
        BLOCK=merge_block,
        GROUPS=min(_GROUPS, merge_block),
        SLOTS=_SLOTS,
        num_warps=8 if merge_block >= 1024 else 4,
    )
    return out


@triton.jit
def _chunk_max_kernel(logits_ptr, keys_ptr, n_cols, row_stride, n_chunks, BLOCK: tl.constexpr):
    """The largest key (``sortable_key``) of one chunk of one row."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = cols < n_cols
    values = tl.load(logits_ptr + row * row_stride + cols, mask=valid, other=float("-inf")).to(tl.float32)
    keys = tl.where(valid, sortable_key(values, cols), INT64_MIN)
    tl.store(keys_ptr + row * n_chunks + chunk, tl.max(keys, axis=0))


@triton.jit
def _row_max_kernel(keys_ptr, out_ptr, n_chunks, BLOCK: tl.constexpr):
    """The column of a row's largest chunk key."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    keys = tl.load(keys_ptr + row * n_chunks + c, mask=c < n_chunks, other=INT64_MIN)
    tl.store(out_ptr + row, key_column(tl.max(keys, axis=0)))


def greedy_rows(logits: torch.Tensor, vocab_limit: int | None = None, *, chunk: int | None = None) -> torch.Tensor:
    """The argmax id of each row of ``logits [R, V]`` below ``vocab_limit`` (the first among equal maxima) in two
    light launches: each chunk's largest key, then each row's; what :func:`sample_rows` picks for rows of temperature
    0 without penalties. Twin: ``ninfer.kernels.reference.sampling.greedy_rows``."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with unit column stride; got shape {tuple(logits.shape)}")
    rows, width = logits.shape
    n_cols = width if vocab_limit is None else max(1, min(width, vocab_limit))
    block = min(_stage_chunk(rows, chunk), triton.next_power_of_2(n_cols))
    n_chunks = triton.cdiv(n_cols, block)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    keys = torch.empty(rows * n_chunks, dtype=torch.int64, device=logits.device)
    _chunk_max_kernel[(rows, n_chunks)](logits, keys, n_cols, logits.stride(0), n_chunks, BLOCK=block, num_warps=4)
    _row_max_kernel[(rows,)](keys, out, n_chunks, BLOCK=max(2, triton.next_power_of_2(n_chunks)), num_warps=4)
    return out


def _stage_chunk(rows: int, chunk: int | None) -> int:
    """The first stage's chunk of columns: ``chunk`` (a power of two >= ``_KEY_LANES``) or one chosen from the row
    count."""
    if chunk is None:
        return SMALL_BATCH_CHUNK if rows < 4 else CHUNK
    if chunk & (chunk - 1) or chunk < _KEY_LANES:
        raise ValueError(f"chunk must be a power of two >= {_KEY_LANES}, got {chunk}")
    return chunk


def _check_inputs(
    logits: torch.Tensor,
    per_row: tuple[torch.Tensor, ...],
    penalty: torch.Tensor | None,
    penalty_rows: torch.Tensor | None,
) -> tuple[int, int]:
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [rows, vocab] with contiguous rows; got shape {tuple(logits.shape)}")
    rows, width = logits.shape
    if width >= 2**31:
        raise ValueError(f"vocabulary of {width} columns exceeds the kernel's 31-bit column ids")
    for tensor in (*per_row, *((penalty_rows,) if penalty_rows is not None else ())):
        if tuple(tensor.shape) != (rows,) or tensor.device != logits.device:
            raise ValueError(
                f"per-row sampling inputs must be ({rows},) on {logits.device}; "
                f"got {tuple(tensor.shape)} on {tensor.device}"
            )
    if penalty is not None:
        if penalty.dim() != 2 or penalty.stride(1) != 1 or penalty.device != logits.device:
            raise ValueError(
                f"penalty must be [P, W] with contiguous rows on {logits.device}; got {tuple(penalty.shape)}"
            )
        if penalty_rows is None and penalty.shape[0] != rows:
            raise ValueError(f"penalty has {penalty.shape[0]} rows for {rows} logit rows and no penalty_rows")
    return rows, width


def time_sampling(rows: tuple[int, ...] = (1, 8), vocab: int = 248320, iterations: int = 200) -> list[dict[str, float]]:
    """Milliseconds per call on the current CUDA device: this kernel and the torch twin, each called back to back
    (CUDA events; host launch costs included), and the kernel alone replayed in a CUDA graph (device time).

    Random fp32 logits, temperature 0.7 / top-k 20 / top-p 0.95 / min-p 0.05, every other row penalized.
    """
    from triton.testing import do_bench_cudagraph

    from ninfer.kernels.reference import sampling as twin

    results = []
    for count in rows:
        logits = torch.randn(count, vocab, device="cuda") * 4
        penalty = torch.rand(count, vocab, device="cuda") * (torch.rand(count, vocab, device="cuda") < 1e-3)
        per_row = [torch.full((count,), value, dtype=torch.float64, device="cuda") for value in (0.7, 20, 0.95, 0.05)]
        uniform = torch.rand(count, dtype=torch.float64, device="cuda")
        indices = torch.arange(count, device="cuda")
        penalty_rows = torch.where(indices % 2 == 0, indices, -1)
        result = {"rows": float(count), "vocab": float(vocab)}
        for name, sample in (("triton_ms", sample_rows), ("torch_ms", twin.sample_rows)):
            def call(sample=sample) -> torch.Tensor:
                return sample(logits, *per_row, uniform, penalty=penalty, penalty_rows=penalty_rows)

            for _ in range(10):
                call()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iterations):
                call()
            end.record()
            torch.cuda.synchronize()
            result[name] = start.elapsed_time(end) / iterations
        result["triton_graph_ms"] = do_bench_cudagraph(
            lambda: sample_rows(logits, *per_row, uniform, penalty=penalty, penalty_rows=penalty_rows)
        )
        results.append(result)
    return results


if __name__ == "__main__":
    for line in time_sampling():
        print(line)
