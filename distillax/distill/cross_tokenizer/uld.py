"""ULD's distance between two probability vectors (Boizard et al., 2024): sum_k |sort(p_s)_k -
sort(p_t)_k|, the shorter vector padded with zeros; its gradient; and the derivative the
vocabulary-chunk form needs (d / d a row scale).

Sorting is the whole cost, and it is done on integer keys. Probabilities are >= 0, and the IEEE
bit patterns of non-negative floats, read as int32, are ordered as the floats are: sorting the
keys sorts the values, bit for bit. XLA's CPU sort is ~4x faster on int32 than on float32 (its
float comparator is a total order that places NaNs and -0), and a one-operand sort is ~4x
faster again than the two-operand sort (values and positions) that jnp.sort's derivative makes.
So the gradient is written by hand (a custom VJP) from the forward sorts alone:

  d ULD / d p_i = sign(sorted_s_k - sorted_t_k) at k = the rank of p_i in its own row,

the rank found by a binary search of p_i's key in the row's sorted keys. Tied values (equal
probabilities) all take the rank of the first of them, where a sort's permutation would spread
them over their ranks; both are subgradients, and in a softmax only exact underflows tie, whose
gradient through exp is 0 anyway. The zero padding sorts first on both sides; each side is
sorted at its own width and the zeros put in front.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _keys(p_xV: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(p_xV.astype(jnp.float32), jnp.int32)


def _padded(sorted_keys_xV: jax.Array, V: int) -> jax.Array:
  values = jax.lax.bitcast_convert_type(sorted_keys_xV, jnp.float32)
  return jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(V - values.shape[-1], 0)])


def _ranks(sorted_keys_xV: jax.Array, keys_xV: jax.Array) -> jax.Array:
  """Each key's position in its row's sorted keys (the first of equal keys)."""
  shape = keys_xV.shape
  search = jax.vmap(lambda row, keys: jnp.searchsorted(row, keys, method="scan_unrolled"))
  return search(sorted_keys_xV.reshape(-1, shape[-1]), keys_xV.reshape(-1, shape[-1])
                ).reshape(shape).astype(jnp.int32)


def _forward(student_p_xVs, teacher_p_xVt):
  V = max(student_p_xVs.shape[-1], teacher_p_xVt.shape[-1])
  keys_s, keys_t = jnp.sort(_keys(student_p_xVs), -1), jnp.sort(_keys(teacher_p_xVt), -1)
  sorted_s, sorted_t = _padded(keys_s, V), _padded(keys_t, V)
  sign_xV = jnp.sign(sorted_s - sorted_t)
  outputs = (jnp.sum(jnp.abs(sorted_s - sorted_t), -1), jnp.sum(sign_xV * sorted_s, -1))
  return outputs, (keys_s, keys_t, sign_xV)


@jax.custom_vjp
def uld_and_scale_grad(student_p_xVs: jax.Array, teacher_p_xVt: jax.Array):
  """(ULD [...], d ULD(exp(c) * p_s, p_t) / d c at c = 0 [...]) per row of probabilities. The
  second output is a value, not differentiated: scaling a row keeps its order, so each sorted
  entry's derivative is the entry itself, sum_k sign(sorted_s_k - sorted_t_k) * sorted_s_k."""
  return _forward(student_p_xVs, teacher_p_xVt)[0]


def _fwd(student_p_xVs, teacher_p_xVt):
  outputs, (keys_s, keys_t, sign_xV) = _forward(student_p_xVs, teacher_p_xVt)
  return outputs, (student_p_xVs, teacher_p_xVt, keys_s, keys_t, sign_xV)


def _bwd(residuals, cotangents):
  student_p, teacher_p, keys_s, keys_t, sign_xV = residuals
  d_uld = cotangents[0][..., None]  # the scale derivative's cotangent is ignored (see above)
  V = sign_xV.shape[-1]

  def grad(p_xV, sorted_keys, side):
    rank_xV = _ranks(sorted_keys, _keys(p_xV)) + (V - p_xV.shape[-1])
    return (side * d_uld * jnp.take_along_axis(sign_xV, rank_xV, -1)).astype(p_xV.dtype)

  return grad(student_p, keys_s, 1.0), grad(teacher_p, keys_t, -1.0)


uld_and_scale_grad.defvjp(_fwd, _bwd)


def uld_distance(student_p_xVs: jax.Array, teacher_p_xVt: jax.Array) -> jax.Array:
  """sum_k |sorted student probs - sorted teacher probs| per row, the shorter padded with 0."""
  return uld_and_scale_grad(student_p_xVs, teacher_p_xVt)[0]
