"""A LogitKD over the teacher's top-k tokens plus one rest bucket, over vocabulary slices
(vocab_slices.py; distill/divergences.py has the buckets over whole log-probabilities).

The buckets need three things per token that slices can carry: the teacher's top-k at T (an
online top-k, merged slice by slice: the first pass), and, once their ids are known, the
student's logits at those ids and the log-sum-exp of s / T over every other column (the rest
bucket, exact: no 1 - sum cancellation; the second pass). The divergence is then a function of
a few numbers per token (the caller's `bucket_divergence(teacher top-k log-probs, student
buckets)`), so its gradient by those numbers is autodiff's over (N, K + 1) arrays, and the
gradient by one slice's logits follows from how each number depends on them:

  d D / d s_v = g_lse q_v / T + g_rest exp(s_v / T - rest) [v not in the top-k] / T
                + g_top,k [v = id_k]

with q = softmax(s / T), lse = logsumexp(s / T), and g_* the gradients of D by the student's
top-k logits, its rest log-sum-exp and its log-sum-exp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from distillax.framework import slice_divergences


def top_init(N: int, K: int) -> dict[str, jax.Array]:
  return {"top": jnp.full((N, K), -jnp.inf, jnp.float32), "ids": jnp.zeros((N, K), jnp.int32)}


def top_step(carry, z_NxS, start) -> dict[str, jax.Array]:
  """The running top-k of z (columns that do not count are -inf) after one more slice; ties go
  to the lower column, as jax.lax.top_k over whole logits does."""
  K = carry["top"].shape[-1]
  vals, pos = jax.lax.top_k(z_NxS, min(K, z_NxS.shape[-1]))
  both = jnp.concatenate([carry["top"], vals], axis=-1)
  ids = jnp.concatenate([carry["ids"], start + pos.astype(jnp.int32)], axis=-1)
  top, pick = jax.lax.top_k(both, K)
  return {"top": top, "ids": jnp.take_along_axis(ids, pick, axis=-1)}


def _in_slice(ids_NxK, j, start, size: int, columns: int):
  """(which ids this slice counts, their positions in it, (N, size) which columns are ids)."""
  inside = (ids_NxK >= start) & (ids_NxK < start + size) & (ids_NxK >= j * size) & (
      ids_NxK < columns)
  pos = jnp.where(inside, ids_NxK - start, 0)
  rows = jnp.arange(ids_NxK.shape[0])[:, None]
  is_id = jnp.zeros((ids_NxK.shape[0], size), bool).at[rows, jnp.where(inside, pos, size)].set(
      True, mode="drop")
  return inside, pos, is_id


def gather_init(N: int, K: int) -> dict[str, jax.Array]:
  return {"s_top": jnp.zeros((N, K), jnp.float32), "m": jnp.full((N,), -jnp.inf, jnp.float32),
          "l": jnp.zeros((N,), jnp.float32)}


def gather_step(carry, s_NxS, new_NxS, ids_NxK, j, start, size: int, columns: int, T: float):
  """The student's logits at the ids and the rest's online log-sum-exp after one more slice."""
  inside, pos, is_id = _in_slice(ids_NxK, j, start, size, columns)
  s_top = carry["s_top"] + jnp.where(inside, jnp.take_along_axis(s_NxS, pos, axis=-1), 0.0)
  m, l = slice_divergences.lse_step(carry["m"], carry["l"],
                                    jnp.where(new_NxS & ~is_id, s_NxS / T, -jnp.inf))
  return {"s_top": s_top, "m": m, "l": l}


def divergence_and_grads(bucket_divergence, t_top_logp_NxK, s_top_NxK, rest_N, lse_N, T: float):
  """(D per token, its gradients by the student's top-k logits, rest and log-sum-exp)."""
  def d(s_top, rest, lse):
    s_buckets = jnp.concatenate([s_top / T - lse[:, None], (rest - lse)[:, None]], axis=-1)
    return bucket_divergence(t_top_logp_NxK, s_buckets)

  value, back = jax.vjp(d, s_top_NxK, rest_N, lse_N)
  g_top, g_rest, g_lse = back(jnp.ones_like(value))
  return value, {"g_top": g_top, "g_rest": g_rest, "g_lse": g_lse}


def logit_grad(saved, s_NxS, ids_NxK, j, start, size: int, columns: int, T: float):
  """d D / d s over one slice's columns, per token, from what the forward pass saved."""
  inside, pos, is_id = _in_slice(ids_NxK, j, start, size, columns)
  z = s_NxS / T
  dz = (saved["g_lse"][:, None] * jnp.exp(z - saved["sT"][:, None]) + jnp.where(
      is_id, 0.0, saved["g_rest"][:, None] * jnp.exp(z - saved["rest"][:, None]))) / T
  rows = jnp.arange(ids_NxK.shape[0])[:, None]
  return dz.at[rows, jnp.where(inside, pos, size)].add(saved["g_top"], mode="drop")
