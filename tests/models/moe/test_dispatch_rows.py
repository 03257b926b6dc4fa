"""dispatch_rows against the unchanged path: gather_rows against jnp.take (the same rows, and the
same gradients, which it forms by gathering through the inverse permutation rather than by
scatter-adding), combine_rows against the weighted sum of jnp.take's rows (values, and the
gradients of the outputs and of the weights, which it forms from the tokens' cotangent),
group_sizes against numpy's bincount. test_dispatch_layout.py checks the compiled TPU step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillax.models.moe.dispatch_rows import combine_rows, gather_rows, group_sizes


@pytest.mark.parametrize("k,dtype,tol", [(1, jnp.float32, 1e-6), (4, jnp.float32, 1e-6),
                                         (3, jnp.bfloat16, 2e-2)])
def test_rows_and_gradients_equal_jnp_take(k, dtype, tol):
  T, D, E = 37, 8, 5
  keys = jax.random.split(jax.random.key(0), 4)
  x_TxD = jax.random.normal(keys[0], (T, D)).astype(dtype)
  experts_N = jax.random.randint(keys[1], (k * T,), 0, E)  # slot-major assignments
  order_N = jnp.argsort(experts_N, stable=True)
  inverse_N = jnp.argsort(order_N)
  w_NxD = jax.random.normal(keys[2], (k * T, D)).astype(dtype)

  def through(take):
    """Rows into expert order, a per-row product, back to assignment order, summed per token
    with weights: the dispatch's shape of use."""
    def loss(x):
      sorted_NxD = take(x, order_N, inverse_N, "in") * w_NxD
      back_KxTxD = take(sorted_NxD, inverse_N, order_N, "out").reshape(k, T, D)
      return jnp.sum((back_KxTxD.astype(jnp.float32) * jnp.arange(1, k + 1)[:, None, None]) ** 2)
    return jax.value_and_grad(loss)

  ours = through(lambda x, order, inverse, _: gather_rows(x, order, inverse))
  plain = through(lambda x, order, inverse, way: jnp.take(
      x, order % T if way == "in" else order, axis=0))
  (loss, grad), (loss0, grad0) = ours(x_TxD), plain(x_TxD)
  np.testing.assert_allclose(loss, loss0, rtol=tol)
  scale = float(jnp.max(jnp.abs(grad0.astype(jnp.float32))))
  np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(grad0, np.float32),
                             atol=tol * scale, rtol=0)
  assert grad.dtype == dtype


def test_vmap_and_jit_carry_it():
  T, D, k = 6, 3, 2
  order_N = jnp.array([3, 0, 7, 1, 11, 5, 2, 9, 4, 10, 6, 8])
  inverse_N = jnp.argsort(order_N)
  x_BxTxD = jax.random.normal(jax.random.key(1), (2, T, D))
  grad = jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(gather_rows(x, order_N, inverse_N)
                                                      * jnp.arange(k * T)[:, None]))))
  # Token t's rows are assignments t and t + T: its gradient is the sum of their positions'
  # weights, the sorted positions inverse[t] and inverse[t + T] (hand-read).
  want_T = np.asarray(inverse_N[:T] + inverse_N[T:], np.float32)
  np.testing.assert_allclose(grad(x_BxTxD), np.broadcast_to(want_T[None, :, None], (2, T, D)))


@pytest.mark.parametrize("k,dtype,tol", [(1, jnp.float32, 1e-6), (4, jnp.float32, 1e-6),
                                         (3, jnp.bfloat16, 2e-2)])
def test_combine_equals_the_weighted_sum_of_taken_rows(k, dtype, tol):
  T, D, E = 29, 8, 5
  keys = jax.random.split(jax.random.key(3), 4)
  experts_N = jax.random.randint(keys[0], (k * T,), 0, E + 1)  # E: a dropped assignment
  order_N = jnp.argsort(experts_N, stable=True)
  inverse_N = jnp.argsort(order_N)
  out_NxD = jax.random.normal(keys[1], (k * T, D)).astype(dtype)
  weights_TxK = jax.nn.softmax(jax.random.normal(keys[2], (T, k)), axis=-1)
  weights_TxK = jnp.where(experts_N.reshape(k, T).T == E, 0.0, weights_TxK)
  probe_TxD = jax.random.normal(keys[3], (T, D))

  def plain(out, w):
    back_KxTxD = jnp.take(out, inverse_N, axis=0).reshape(k, T, D)
    return jnp.sum(back_KxTxD * w.T.astype(out.dtype)[:, :, None], axis=0)

  def loss(combine):
    return lambda out, w: jnp.sum(combine(out, w).astype(jnp.float32) * probe_TxD)

  ours = jax.value_and_grad(loss(lambda o, w: combine_rows(o, w, order_N, inverse_N)), (0, 1))
  (value, grads), (value0, grads0) = ours(out_NxD, weights_TxK), \
      jax.value_and_grad(loss(plain), (0, 1))(out_NxD, weights_TxK)
  np.testing.assert_allclose(value, value0, rtol=tol)
  for got, want in zip(grads, grads0):
    assert got.dtype == want.dtype
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol * scale, rtol=0)
  # A dropped assignment's weight is 0, and its row's gradient with it.
  dropped_N = experts_N[order_N] == E
  assert bool(jnp.any(dropped_N))
  np.testing.assert_array_equal(np.asarray(grads[0], np.float32)[np.asarray(dropped_N)], 0.0)


def test_group_sizes_equal_bincount_and_skip_dropped_ids():
  ids_N = np.array([3, 0, 3, 5, 1, 3, 0, 5, 2])  # 5: dropped, past the 5 experts' ids
  np.testing.assert_array_equal(group_sizes(jnp.asarray(ids_N), 5), [2, 1, 1, 3, 0])
  assert group_sizes(jnp.asarray(ids_N), 5).dtype == jnp.int32
