"""An argmax as the maximum of int64 keys: each candidate's key orders like (its fp32 value, then the lower column
first), so the largest key names the first column among equal maxima, and keys from any number of programs merge by
``max`` (an atomic one across programs). The greedy sampler (``sampling.greedy_rows``) and the one-row lm_head's
argmax epilogue (``norm_gemv.ArgmaxEpilogue``) use them."""

from __future__ import annotations

import triton
import triton.language as tl

INT64_MIN = tl.constexpr(-(2**63))  # no candidate


@triton.jit
def sortable_key(values, columns):
    """int64 keys ordered like (fp32 value, then lower column first)."""
    bits = values.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (2147483647 - columns).to(tl.int64)


@triton.jit
def key_column(keys):
    """The column a key names."""
    return 2147483647 - (keys & 2147483647)
