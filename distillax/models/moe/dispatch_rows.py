"""Row gathers of the MoE dispatch whose gradients are gathers too.

The dispatch copies each token's row once per chosen expert into expert order, and copies the
experts' outputs back into assignment order. Written as `jnp.take`, each copy's gradient is a
scatter-add: XLA cannot know the indices form a permutation, so on a TPU it serializes the
updates row by row (call 31's profile of the MoE student put the dispatch's gathers and
scatters at ~110 ms of its step). Here the inverse permutation is known (the dispatch
sorts anyway), so each backward is a gather through it, and a token's k rows are summed by a
reduction over a leading axis instead of by colliding scatter updates.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def gather_rows(x_TxD, order_N, inverse_N):
  """Rows x[order_N % T] for N = k * T assignments in slot-major order (assignment j * T + t is
  token t's j-th), where order_N is a permutation of range(N) and inverse_N its inverse. With
  k = 1 it permutes the rows."""
  return _gather_rows(x_TxD, order_N, inverse_N, x_TxD.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_rows(x_TxD, order_N, inverse_N, tokens):
  return jnp.take(x_TxD, order_N % tokens, axis=0, mode="clip")


def _gather_rows_fwd(x_TxD, order_N, inverse_N, tokens):
  return _gather_rows(x_TxD, order_N, inverse_N, tokens), inverse_N


def _gather_rows_bwd(tokens, inverse_N, g_NxD):
  # Row i of the output came from assignment order[i], so assignment a's cotangent is row
  # inverse[a]; token t's is the sum over its k slot-major assignments.
  g_KxTxD = jnp.take(g_NxD, inverse_N, axis=0, mode="clip").reshape(-1, tokens, g_NxD.shape[1])
  if g_KxTxD.shape[0] == 1:
    return g_KxTxD[0], None, None
  return jnp.sum(g_KxTxD, axis=0, dtype=jnp.float32).astype(g_NxD.dtype), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)
