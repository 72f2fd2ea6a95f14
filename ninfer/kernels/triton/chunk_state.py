"""The sequential chunk-to-chunk state pass of the chunked gated delta rule (prefill), one kernel for all chunks.

Twin: ``ninfer.kernels.reference.prefill.chunk_state_pass_torch``. With every intra-chunk quantity already computed for all
chunks (``ninfer.kernels.reference.prefill.batched_chunk_gated_delta_rule``), chunk ``n`` only needs the state ``S`` that
enters it::

    out[n]         = decayed_q[n] @ S                      # what the entering state contributes to the outputs
    corrections[n] = base_corrections[n] - solved_k[n] @ S
    S              = S * chunk_decay[n] + decayed_k_t[n] @ corrections[n]

One program owns one (sequence·head, block of value columns) and keeps its ``[Dk, BV]`` slice of ``S`` in registers
for the whole sequence, so the pass is one launch instead of three products and a scaling per chunk. The products
run on the tensor cores as three TF32 products each (``tf32x3``: about fp32 accuracy; plain fp32 ``ieee`` dots
take 54 ms per 27B layer at 8192 tokens on the H200, these 1.6 ms). The chunk count is not a specialisation key, so
one compilation serves every prompt length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["chunks", "sequences"])
def _chunk_state_kernel(
    decayed_q_ptr,
    solved_k_ptr,
    base_ptr,
    decayed_k_t_ptr,
    chunk_decay_ptr,
    state_ptr,
    out_ptr,
    corrections_ptr,
    chunks,
    sequences,
    C: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
):
    sequence = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BV + tl.arange(0, BV)
    c = tl.arange(0, C)
    dk = tl.arange(0, DK)
    state_tile = state_ptr + sequence * DK * DV + dk[:, None] * DV + columns[None, :]
    state = tl.load(state_tile)
    for n in range(chunks):
        block = n * sequences + sequence  # [N, S, ...] layout: chunk-major
        rows_by_key = block * C * DK + c[:, None] * DK + dk[None, :]
        rows_by_value = block * C * DV + c[:, None] * DV + columns[None, :]
        decayed_q = tl.load(decayed_q_ptr + rows_by_key)
        tl.store(out_ptr + rows_by_value, tl.dot(decayed_q, state, input_precision="tf32x3"))
        solved_k = tl.load(solved_k_ptr + rows_by_key)
        base = tl.load(base_ptr + rows_by_value)
        corrections = base - tl.dot(solved_k, state, input_precision="tf32x3")
        tl.store(corrections_ptr + rows_by_value, corrections)
        decayed_k_t = tl.load(decayed_k_t_ptr + block * DK * C + dk[:, None] * C + c[None, :])
        decay = tl.load(chunk_decay_ptr + block)
        state = state * decay + tl.dot(decayed_k_t, corrections, input_precision="tf32x3")
    tl.store(state_tile, state)


def chunk_state_pass(
    decayed_q: torch.Tensor,
    solved_k: torch.Tensor,
    base_corrections: torch.Tensor,
    decayed_k_t: torch.Tensor,
    chunk_decay: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the state through all chunks: returns ``(out [N,S,C,Dv], corrections [N,S,C,Dv], final state [S,Dk,Dv])``.

    Inputs are fp32: ``decayed_q, solved_k [N,S,C,Dk]``, ``base_corrections [N,S,C,Dv]``, ``decayed_k_t
    [N,S,Dk,C]``, ``chunk_decay`` with ``N*S`` elements, ``state [S,Dk,Dv]`` (not modified). ``C``, ``Dk`` and ``Dv``
    must be powers of two of at least 16.
    """
    chunks, sequences, size, key_dim = decayed_q.shape
    value_dim = base_corrections.shape[-1]
    for name, value in (("chunk size", size), ("key dim", key_dim), ("value dim", value_dim)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"the Triton state pass needs a power-of-two {name} >= 16; got {value}")
    inputs = [decayed_q, solved_k, base_corrections, decayed_k_t, chunk_decay, state]
    if any(t.dtype != torch.float32 for t in inputs):
        raise ValueError("the Triton state pass takes fp32 tensors")
    decayed_q, solved_k, base_corrections, decayed_k_t, chunk_decay = (
        t.contiguous() for t in (decayed_q, solved_k, base_corrections, decayed_k_t, chunk_decay)
    )
    final = state.contiguous().clone()
    out = torch.empty_like(base_corrections)
    corrections = torch.empty_like(base_corrections)
    block_v = min(32, value_dim)
    if chunks:
        _chunk_state_kernel[(sequences, value_dim // block_v)](
            decayed_q, solved_k, base_corrections, decayed_k_t, chunk_decay, final, out, corrections,
            chunks, sequences, C=size, DK=key_dim, DV=value_dim, BV=block_v, num_warps=4, num_stages=1,
        )
    return out, corrections, final
