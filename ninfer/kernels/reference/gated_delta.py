"""The gated delta rule of Gated DeltaNet: a recurrent (token by token) and a chunked (UT-transform) form.

Per value head with state ``S`` (``Dk x Dv``, fp32), for every token::

    S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q

q and k are L2-normalised over the head dim (eps 1e-6) and q is scaled by ``Dk ** -0.5``. Key heads are shared by
``Hv // Hk`` consecutive value heads. Both forms compute in fp32 and return the output in ``v.dtype``.
"""

from __future__ import annotations

import torch

L2_EPS = 1e-6


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def check_shapes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[int, int, int, int, int, int]:
    """Validate the rule's inputs (ValueError naming the tensor); ``(B, T, Hk, Dk, Hv, Dv)``."""
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, Hk, Dk]; got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, length, key_heads, key_dim = k.shape
    if v.dim() != 4 or v.shape[:2] != (batch, length):
        raise ValueError(f"v must be [B, T, Hv, Dv] with B={batch}, T={length}; got {tuple(v.shape)}")
    value_heads, value_dim = v.shape[2:]
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    for name, tensor in (("g", g), ("beta", beta)):
        if tuple(tensor.shape) != (batch, length, value_heads):
            raise ValueError(f"{name} must be [B, T, Hv] = {(batch, length, value_heads)}; got {tuple(tensor.shape)}")
    state_shape = (batch, value_heads, key_dim, value_dim)
    if initial_state is not None and tuple(initial_state.shape) != state_shape:
        raise ValueError(f"initial_state must be [B, Hv, Dk, Dv] = {state_shape}; got {tuple(initial_state.shape)}")
    return batch, length, key_heads, key_dim, value_heads, value_dim


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
) -> tuple[torch.Tensor, ...]:
    """Check shapes; return head-major fp32 ``q, k [B,Hv,T,Dk]``, ``v [B,Hv,T,Dv]``, ``g, beta [B,Hv,T]``, state."""
    batch, _, key_heads, key_dim, value_heads, value_dim = check_shapes(q, k, v, g, beta, initial_state)
    if initial_state is None:
        state = torch.zeros((batch, value_heads, key_dim, value_dim), dtype=torch.float32, device=v.device)
    else:
        state = initial_state.float()
    group = value_heads // key_heads
    scale = key_dim**-0.5 if scale is None else scale
    q = l2_normalize(q) * scale
    k = l2_normalize(k)
    if group > 1:
        q = q.repeat_interleave(group, dim=2)
        k = k.repeat_interleave(group, dim=2)
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    g, beta = (x.float().transpose(1, 2) for x in (g, beta))
    return q, k, v, g, beta, state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float | None = None,
    output_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token-by-token gated delta rule.

    Returns ``(o [B,T,Hv,Dv] in v.dtype, final_state [B,Hv,Dk,Dv] fp32, states [B,T,Hv,Dk,Dv] fp32 or None)`` where
    ``states[:, t]`` is the state after token t.
    """
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale)
    length = q.shape[2]
    outputs = []
    states = []
    for t in range(length):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k_t)
        delta = beta[:, :, t, None] * (v[:, :, t] - predicted)
        state = state + k_t[..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
        if output_states:
            states.append(state)
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros((v.shape[0], 0, v.shape[1], v.shape[3]))
    all_states = None
    if output_states:
        all_states = torch.stack(states, dim=1) if states else state.new_zeros((state.shape[0], 0, *state.shape[1:]))
    return o.to(out_dtype), state, all_states


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule (UT transform per chunk, sequential scan over chunks); any T.

    Within a chunk with cumulative log-decay ``c_t`` and entering state ``S0`` the corrections ``U`` solve
    ``(I + A) U = beta*V - (beta*exp(c)*K) S0`` with ``A[t,s] = beta_t exp(c_t - c_s) k_t.k_s`` (s < t); then
    ``O = (exp(c)*Q) S0 + (QK^T * decay) U`` and ``S = exp(c_L) S0 + (exp(c_L - c)*K)^T U``.
    Returns ``(o [B,T,Hv,Dv] in v.dtype, final_state [B,Hv,Dk,Dv] fp32)``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    out_dtype = v.dtype
    q, k, v, g, beta, state = _prepare(q, k, v, g, beta, initial_state, scale)
    length = q.shape[2]
    outputs = []
    for start in range(0, length, chunk_size):
        stop = min(start + chunk_size, length)
        size = stop - start
        q_c, k_c, v_c = q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop]
        beta_c = beta[:, :, start:stop]
        cum = g[:, :, start:stop].cumsum(dim=-1)
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        strictly_lower = causal.clone().fill_diagonal_(False)
        a = (beta_c[..., :, None] * (k_c @ k_c.transpose(-1, -2)) * decay).masked_fill(~strictly_lower, 0.0)
        system = a + torch.eye(size, dtype=a.dtype, device=a.device)
        solved_v = torch.linalg.solve_triangular(system, beta_c[..., None] * v_c, upper=False, unitriangular=True)
        decayed_k = (beta_c * cum.exp())[..., None] * k_c
        solved_k = torch.linalg.solve_triangular(system, decayed_k, upper=False, unitriangular=True)
        corrections = solved_v - solved_k @ state
        attention = (q_c @ k_c.transpose(-1, -2)) * decay
        outputs.append((cum.exp()[..., None] * q_c) @ state + attention @ corrections)
        last = cum[..., -1:]
        state = last.exp()[..., None] * state + ((last - cum).exp()[..., None] * k_c).transpose(-1, -2) @ corrections
    if outputs:
        o = torch.cat(outputs, dim=2).transpose(1, 2)
    else:
        o = v.new_zeros((v.shape[0], 0, v.shape[1], v.shape[3]))
    return o.contiguous().to(out_dtype), state
