"""Gated DeltaNet (Qwen3.5's linear attention) as pure functions: the causal depthwise conv, the
gated delta rule in a chunked parallel form and a recurrent form, and the gated RMSNorm output.

The gated delta rule keeps one (d_k, d_v) state per head instead of a key/value cache. For each
token t (after a reset at a document start, the state before it is zero):

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

`gated_delta_rule_recurrent` runs that one token at a time (decode, and the reference the tests
hold the chunked form to). `gated_delta_rule_chunked` is the training form: within a chunk of C
tokens the C updates are one unit-triangular system (the "UT transform" of DeltaNet, inverted
by doubling: matmuls only), and a `lax.scan` carries the state from chunk to chunk, so memory
is O(L * C) per head, not O(L^2).

Packed documents: a token whose segment id differs from the previous token's starts a new
document, and both forms (and the conv) then forget everything before it. A state handed in
(`initial_state`, the conv state) belongs to the document of the token before this call, whose
segment id the caller passes in, so decode continues exactly where a full forward would be.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def document_starts(segment_ids_BxL, previous_segment_B=None) -> jax.Array:
  """bool (B, L): True where a token's segment differs from the token before it (for the first
  token: from `previous_segment_B`, the segment of whatever state comes in; None = continue)."""
  seg = segment_ids_BxL
  first = (jnp.zeros(seg.shape[:1], bool) if previous_segment_B is None
           else seg[:, 0] != previous_segment_B)
  return jnp.concatenate([first[:, None], seg[:, 1:] != seg[:, :-1]], axis=1)


def l2_normalize(x_xK: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (the form of Qwen3.5's kernels)."""
  x = x_xK.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(x_xV: jax.Array, gate_xV: jax.Array, scale_V: jax.Array,
                   eps: float) -> jax.Array:
  """RMSNorm of each head's output times scale, then times silu(gate): the Gated DeltaNet output
  norm (its scale multiplies as is, initialised at one). float32 inside, x's dtype out."""
  x = x_xV.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  x = scale_V.astype(jnp.float32) * x.astype(x_xV.dtype).astype(jnp.float32)
  return (x * jax.nn.silu(gate_xV.astype(jnp.float32))).astype(x_xV.dtype)


def causal_conv(x_BxLxC, weight_KxC, *, segment_ids_BxL=None, state_BxPxC=None,
                state_segments_BxP=None):
  """Depthwise causal conv: y[t, c] = sum_j weight[j, c] * x[t - (K-1) + j, c], taps from
  another document (or before the first token) counting zero. Returns (y_BxLxC, new state): the
  last P = K-1 inputs and their segment ids, what the next call continues from.

  state_BxPxC / state_segments_BxP: the P inputs before this call (decode); None = zeros."""
  B, L, C = x_BxLxC.shape
  P = weight_KxC.shape[0] - 1
  if segment_ids_BxL is None:
    segment_ids_BxL = jnp.ones((B, L), jnp.int32)
  if state_BxPxC is None:
    state_BxPxC = jnp.zeros((B, P, C), x_BxLxC.dtype)
    state_segments_BxP = jnp.broadcast_to(segment_ids_BxL[:, :1], (B, P))
  full_x = jnp.concatenate([state_BxPxC.astype(x_BxLxC.dtype), x_BxLxC], axis=1)
  full_seg = jnp.concatenate([state_segments_BxP.astype(jnp.int32),
                              segment_ids_BxL.astype(jnp.int32)], axis=1)
  doc_BxT = jnp.cumsum(document_starts(full_seg), axis=1)
  w_KxC = weight_KxC.astype(jnp.float32)
  y_BxLxC = jnp.zeros((B, L, C), jnp.float32)
  for back in range(P + 1):  # tap `back` tokens before each output token
    tap_x = full_x[:, P - back:P - back + L].astype(jnp.float32)
    same_doc_BxL = doc_BxT[:, P - back:P - back + L] == doc_BxT[:, P:]
    y_BxLxC = y_BxLxC + jnp.where(same_doc_BxL[..., None], tap_x * w_KxC[P - back], 0.0)
  return y_BxLxC.astype(x_BxLxC.dtype), (full_x[:, L:], full_seg[:, L:])


def gated_delta_rule_recurrent(q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, g_BxLxH, beta_BxLxH, *,
                               segment_ids_BxL=None, initial_state_BxHxKxV=None,
                               state_segment_B=None):
  """One token at a time (a lax.scan over L): (out_BxLxHxV float32, final state BxHxKxV).

  q, k: one head per value head (repeat grouped key heads first), q already scaled. g: the log
  decay (<= 0); beta: the write strength in (0, 1). state_segment_B: segment id of the token
  before this call (the state's document); None = the state continues the first token's."""
  B, L, H, K = q_BxLxHxK.shape
  V = v_BxLxHxV.shape[-1]
  f32 = lambda a: a.astype(jnp.float32)
  if segment_ids_BxL is None:
    starts_BxL = jnp.zeros((B, L), bool)
  else:
    starts_BxL = document_starts(segment_ids_BxL, state_segment_B)
  state = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state_BxHxKxV is None
           else f32(initial_state_BxHxKxV))

  def step(S_BxHxKxV, token):
    q_BxHxK, k_BxHxK, v_BxHxV, g_BxH, beta_BxH, start_B = token
    S_BxHxKxV = jnp.where(start_B[:, None, None, None], 0.0, S_BxHxKxV)
    S_BxHxKxV = S_BxHxKxV * jnp.exp(g_BxH)[..., None, None]
    remembered_BxHxV = jnp.einsum("BHKV,BHK->BHV", S_BxHxKxV, k_BxHxK)
    delta_BxHxV = (v_BxHxV - remembered_BxHxV) * beta_BxH[..., None]
    S_BxHxKxV = S_BxHxKxV + jnp.einsum("BHK,BHV->BHKV", k_BxHxK, delta_BxHxV)
    return S_BxHxKxV, jnp.einsum("BHKV,BHK->BHV", S_BxHxKxV, q_BxHxK)

  time_major = lambda a: jnp.moveaxis(a, 1, 0)
  tokens = tuple(time_major(f32(a)) for a in (q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, g_BxLxH,
                                              beta_BxLxH)) + (time_major(starts_BxL),)
  state, out_LxBxHxV = jax.lax.scan(step, state, tokens)
  return time_major(out_LxBxHxV), state


def _chunks(a_BxLx, C: int):
  """(B, L, ...) -> (N, B, ..., C) with N = L / C: chunks leading (the scan axis), then heads."""
  B, L = a_BxLx.shape[:2]
  a = a_BxLx.reshape(B, L // C, C, *a_BxLx.shape[2:])
  a = jnp.moveaxis(a, 1, 0)  # (N, B, C, ...)
  return jnp.moveaxis(a, 2, -1) if a.ndim == 4 else jnp.moveaxis(a, 2, 3)


def _unit_lower_inverse(A_xCxC: jax.Array) -> jax.Array:
  """(I + A)^-1 for strictly lower-triangular A, by doubling: with N = -A (nilpotent),
  (I - N)^-1 = (I + N)(I + N^2)(I + N^4)...: log2(C) pairs of matmuls, no triangular solve
  (XLA:CPU runs those through the host LAPACK, whose threads were seen to deadlock)."""
  C = A_xCxC.shape[-1]
  power = -A_xCxC
  inverse = jnp.eye(C, dtype=A_xCxC.dtype) + power
  for _ in range(max(C - 1, 1).bit_length() - 1):
    power = power @ power
    inverse = inverse + inverse @ power
  return inverse


def _within_chunks(q, k, v, g, beta, doc_NxBxC, doc_before_NxB):
  """What each chunk needs from its own tokens, for all chunks at once (O(L * C) per head):
  (values written without S0, their S0 read-out, the masked intra-chunk scores, queries and keys
  for reading and writing S0, the state's decay over the chunk)."""
  C = q.shape[-2]
  same_NxBxCxC = doc_NxBxC[..., :, None] == doc_NxBxC[..., None, :]
  causal_CxC = jnp.tril(jnp.ones((C, C), bool))
  keep = (same_NxBxCxC & causal_CxC)[:, :, None]  # (N, B, 1, C, C): j <= i, one document
  carry = (doc_NxBxC == doc_before_NxB[..., None])[:, :, None]  # (N, B, 1, C)
  G = jnp.cumsum(g, axis=-1)  # (N, B, H, C)
  decay_CxC = jnp.exp(jnp.where(keep, G[..., :, None] - G[..., None, :], -jnp.inf))
  decay_CxC = jnp.where(keep, decay_CxC, 0.0)
  k_beta = k * beta[..., None]
  strict_CxC = jnp.tril(jnp.ones((C, C), bool), -1)
  A = jnp.where(strict_CxC, jnp.einsum("NBHiK,NBHjK->NBHij", k_beta, k) * decay_CxC, 0.0)
  T = _unit_lower_inverse(A)
  solve = lambda rhs: jnp.einsum("NBHij,NBHjX->NBHiX", T, rhs)
  u_NxBxHxCxV = solve(v * beta[..., None])
  w_state_NxBxHxCxK = solve(k_beta * (jnp.exp(G) * carry)[..., None])
  intra_NxBxHxCxC = jnp.einsum("NBHiK,NBHjK->NBHij", q, k) * decay_CxC
  q_state = q * (jnp.exp(G) * carry)[..., None]
  last_keep = keep[..., -1, :]  # (N, B, 1, C): tokens of the chunk's last document
  k_out = k * jnp.where(last_keep, jnp.exp(G[..., -1:] - G), 0.0)[..., None]
  state_decay_NxBxH = jnp.exp(G[..., -1]) * carry[..., -1]
  return (u_NxBxHxCxV, w_state_NxBxHxCxK, intra_NxBxHxCxC, q_state, k_out, state_decay_NxBxH)


def gated_delta_rule_chunked(q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, g_BxLxH, beta_BxLxH, *,
                             segment_ids_BxL=None, initial_state_BxHxKxV=None,
                             state_segment_B=None, chunk_size: int = 64):
  """The same function as `gated_delta_rule_recurrent`, chunk by chunk: (out float32, state).

  Within a chunk (cumulative log decay G_i, same-document mask M_ij for j <= i, `carry_i` whether
  token i is still in the document of the state S0 entering the chunk), the values the chunk
  writes are W = (I + A)^-1 (beta V - carry beta exp(G) K S0), A_ij = beta_i k_i.k_j
  exp(G_i - G_j) M_ij (j < i); outputs are carry exp(G) Q S0 + (Q K^T * exp(G_i - G_j) M) W,
  and the state leaving it is S0 exp(G_C) carry_C + sum_j exp(G_C - G_j) M_Cj k_j W_j^T."""
  B, L, H, K = q_BxLxHxK.shape
  V = v_BxLxHxV.shape[-1]
  C = int(chunk_size)
  pad = (-L) % C
  f32 = lambda a: a.astype(jnp.float32)
  if segment_ids_BxL is None:
    starts_BxL = jnp.zeros((B, L), bool)
  else:
    starts_BxL = document_starts(segment_ids_BxL, state_segment_B)
  # Document index per token, 0 = the incoming state's. Padding tokens (k = v = g = beta = 0)
  # continue the last document and leave the state as it is.
  doc_BxL = jnp.cumsum(starts_BxL.astype(jnp.int32), axis=1)
  zero_pad = lambda a: jnp.pad(f32(a), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
  q, k, v, g, beta = (zero_pad(a) for a in (q_BxLxHxK, k_BxLxHxK, v_BxLxHxV, g_BxLxH,
                                            beta_BxLxH))
  doc_BxL = jnp.pad(doc_BxL, [(0, 0), (0, pad)], mode="edge")
  q, k, v = (_chunks(a, C) for a in (q, k, v))  # (N, B, H, C, K|V)
  g, beta = _chunks(g, C), _chunks(beta, C)  # (N, B, H, C)
  N = q.shape[0]
  doc_NxBxC = jnp.moveaxis(doc_BxL.reshape(B, N, C), 1, 0)
  doc_before_NxB = jnp.concatenate([jnp.zeros((1, B), jnp.int32), doc_NxBxC[:-1, :, -1]], 0)

  chunk_terms = _within_chunks(q, k, v, g, beta, doc_NxBxC, doc_before_NxB)

  def chunk_step(S_BxHxKxV, chunk):
    u, w_state, intra, q_s, k_o, decay = chunk
    written_BxHxCxV = u - jnp.einsum("BHCK,BHKV->BHCV", w_state, S_BxHxKxV)
    out = (jnp.einsum("BHCK,BHKV->BHCV", q_s, S_BxHxKxV)
           + jnp.einsum("BHij,BHjV->BHiV", intra, written_BxHxCxV))
    S_BxHxKxV = (S_BxHxKxV * decay[..., None, None]
                 + jnp.einsum("BHCK,BHCV->BHKV", k_o, written_BxHxCxV))
    return S_BxHxKxV, out

  state = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state_BxHxKxV is None
           else f32(initial_state_BxHxKxV))
  state, out_NxBxHxCxV = jax.lax.scan(chunk_step, state, chunk_terms)
  out_BxLxHxV = jnp.moveaxis(out_NxBxHxCxV, 3, 2).transpose(1, 0, 2, 3, 4).reshape(
      B, N * C, H, V)
  return out_BxLxHxV[:, :L], state
