"""Bulk L2 prefetch: a decode kernel whose own work leaves HBM idle asks the L2 for the weights a later kernel of
the step streams, so that kernel reads them from the L2.

At one row most decode kernels between the big GEMVs are latency bound (the gated-delta step, the attention of a
short context, a persistent block's router and barriers): HBM idles for several microseconds per layer while the
next GEMV's weights, known long before, wait to be read. ``prefetch_l2`` spreads ``cp.async.bulk.prefetch.L2``
requests (sm_90+; asynchronous, nothing waits for them) for one contiguous byte range over a grid's programs, one
request per thread. It changes no result: kernels take it behind a ``PREFETCH`` constexpr that is off in Triton's
interpreter and on devices older than sm_90.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

GRANULE = 256  # bytes: every thread's share is a multiple of it (bulk prefetches need 16-byte multiples)


@attrs.frozen
class Prefetch:
    """A contiguous byte range to prefetch into the L2, cut into ``share``-byte pieces, one per thread of the grid
    (``programs`` programs of ``lanes`` threads)."""

    tensor: torch.Tensor
    nbytes: int
    share: int

    @classmethod
    def of(cls, tensor: torch.Tensor, programs: int, lanes: int) -> "Prefetch":
        """``tensor``'s bytes (it must be contiguous) over ``programs * lanes`` threads."""
        if not tensor.is_contiguous():
            raise ValueError("only a contiguous tensor can be prefetched as one byte range")
        nbytes = tensor.numel() * tensor.element_size()
        share = -(-nbytes // (programs * lanes * GRANULE)) * GRANULE
        return cls(tensor, nbytes - nbytes % 16, share)


def prefetch_supported(device: torch.device | str) -> bool:
    """Bulk L2 prefetches need a CUDA device of compute capability 9.0 or newer (not Triton's interpreter)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def prefetch_l2(base_ptr, nbytes, share, LANES: tl.constexpr):
    """This program's ``LANES`` threads each request ``share`` bytes of ``[base_ptr, base_ptr + nbytes)`` into the
    L2 (program ``p``'s lanes cover bytes ``p * LANES * share`` onwards). ``LANES`` must be the program's thread
    count, so that no two threads request the same piece."""
    piece = tl.program_id(0) * LANES + tl.arange(0, LANES)
    offset = piece.to(tl.int64) * share
    size = tl.minimum(nbytes - offset, share).to(tl.int32)
    address = base_ptr.to(tl.pointer_type(tl.int8)) + offset
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [address, size], dtype=tl.int32, is_pure=False, pack=1,
    )
