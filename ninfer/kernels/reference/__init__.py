"""Pure-torch reference kernels: the CPU path of the model and the oracle for the fast (Triton) kernels.

Every function here depends on torch only, so the kernels can be imported and tested without the server stack.
"""

from __future__ import annotations

from ninfer.kernels.reference.attention import (
    paged_attention,
    paged_slot_mapping,
    token_rows_and_positions,
    write_paged_kv,
)
from ninfer.kernels.reference.conv import causal_conv1d
from ninfer.kernels.reference.gated_delta import chunk_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from ninfer.kernels.reference.moe import moe_forward, route_tokens, swiglu
from ninfer.kernels.reference.norms import gated_rms_norm, rms_norm
from ninfer.kernels.reference.rope import (
    apply_mrope,
    apply_rotary,
    mrope_axis_of_frequency,
    mrope_cos_sin,
    rope_inverse_frequencies,
    rotary_cos_sin,
)

__all__ = [
    "apply_mrope",
    "apply_rotary",
    "causal_conv1d",
    "chunk_gated_delta_rule",
    "gated_rms_norm",
    "l2_normalize",
    "moe_forward",
    "mrope_axis_of_frequency",
    "mrope_cos_sin",
    "paged_attention",
    "paged_slot_mapping",
    "recurrent_gated_delta_rule",
    "rms_norm",
    "rope_inverse_frequencies",
    "rotary_cos_sin",
    "route_tokens",
    "swiglu",
    "token_rows_and_positions",
    "write_paged_kv",
]
